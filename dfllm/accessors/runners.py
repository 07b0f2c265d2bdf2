"""Running a task on one pandas partition: :func:`run_task` and the runner of each task kind.

``run_task`` turns a pandas frame into the same frame with the task's output columns, rows
in the same order, holding the process's engine for the task while it runs (see
:mod:`dfllm.accessors.engine_cache`). Bad rows get a null output and a message in
``llm_error`` (see :mod:`dfllm.accessors.rows`); every other row is processed.

A generative runner (``generate``, ``chat``) turns its rows into requests checked by the
engine's input processor, the one place inputs are checked (a row it refuses gets the
message as its error), and generates them on the driver thread in the batches of every
task using the engine (:class:`Generation`). A pooling runner (``embed``, ``score``,
``classify``) calls the model's pooling method on the driver thread (:class:`Pooling`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import pandas as pd

from dfllm.accessors.driver import driver
from dfllm.accessors.engine_cache import lease
from dfllm.accessors.rows import cell_texts, conversations, row_error, row_params
from dfllm.accessors.schema import FINISH_REASON, NUM_GENERATED_TOKENS, NUM_INPUT_TOKENS, PROBS, structured_value
from dfllm.engine.input_processor import EngineRequest, InputProcessor
from dfllm.llm import LLM
from dfllm.outputs import RequestOutput

if TYPE_CHECKING:
    from dfllm.accessors.task import LLMTask


@dataclasses.dataclass(frozen=True)
class Generation:
    """A generative engine as the generate and chat runners use it."""

    processor: InputProcessor  # tokenizes, renders chats, checks requests: call it holding ``lock``
    lock: threading.Lock
    generate: Callable[[list[EngineRequest]], list[RequestOutput]]  # outputs in order, batched with other tasks


class Pooling:
    """A pooling model as the embed, score and classify runners use it: each call runs on
    the driver thread."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def embed(self, texts: list[str]) -> list:
        return driver().call(lambda: self.llm.embed(texts, use_tqdm=False))

    def score(self, left: list[str], right: list[str]) -> list:
        return driver().call(lambda: self.llm.score(left, right, use_tqdm=False))

    def classify(self, texts: list[str]) -> list:
        return driver().call(lambda: self.llm.classify(texts, use_tqdm=False))


def run_task(df: pd.DataFrame, task: LLMTask, progress: bool = False) -> pd.DataFrame:
    """``df`` with the task's output columns; rows in the same order. ``progress`` shows a
    bar over the rows being generated (pandas and Polars calls; Dask shows its own)."""
    spec = task.spec
    dtypes = task.output_dtypes()
    out: dict[str, list] = {c: [None] * len(df) for c in dtypes}
    if len(df):
        with lease(task.model, dict(task.engine_kwargs)) as entry:
            if not spec.generative:
                with entry.lock:
                    spec.runner(df, task, out, Pooling(entry.llm))
            else:
                engine = entry.llm.engine
                if engine is None:
                    raise ValueError(f"{task.kind}: {entry.llm.config.model_path.name} is loaded as a pooling "
                                     "model; use embed, classify, score or encode")
                generate = lambda requests: driver().generate(engine, entry.lock, requests, progress)  # noqa: E731
                spec.runner(df, task, out, Generation(engine.input_processor, entry.lock, generate))
    cols = {c: pd.Series(v, index=df.index, dtype=dtypes[c]) for c, v in out.items()}
    return pd.concat([df, pd.DataFrame(cols, index=df.index)], axis=1)


# ---- generate and chat ------------------------------------------------------------------------------------
def run_generate(df: pd.DataFrame, task: LLMTask, out: dict, gen: Generation) -> None:
    """Complete each row's text (a column or template)."""
    texts = cell_texts(df, task.inputs[0], task, out)
    with gen.lock:
        ids = gen.processor.tokenize(list(texts.values()))
    _generate(df, task, out, gen, {i: {"prompt_token_ids": t} for i, t in zip(texts, ids)})


def run_chat(df: pd.DataFrame, task: LLMTask, out: dict, gen: Generation) -> None:
    """Reply to each row's conversation, rendered with the chat template."""
    prompts = {}
    for i, conv in conversations(df, task, out).items():
        try:
            with gen.lock:
                prompts[i] = gen.processor.render_chat(conv, task.chat_template)
        except Exception as exc:  # a template that cannot render this conversation
            row_error(task, out, i, f"chat template: {exc}")
    _generate(df, task, out, gen, prompts)


def _generate(df: pd.DataFrame, task: LLMTask, out: dict, gen: Generation, prompts: dict) -> None:
    """Generate ``prompts`` (row position -> prompt) with each row's sampling params, and
    fill the generation columns; rows the input processor refuses get its message."""
    params = row_params(df, task, list(prompts), out)
    so = task.structured_params()
    rows, requests = [], []
    for i in sorted(params):
        # the accessor's constraint replaces any a row's own sampling_params carry
        sp = params[i] if so is None else dataclasses.replace(params[i], structured_outputs=so)
        try:
            with gen.lock:
                requests.append(gen.processor.process(prompts[i], sp, what="the prompt"))
        except ValueError as exc:
            row_error(task, out, i, str(exc))
            continue
        rows.append(i)
    if not rows:
        return
    dtype = task.output_dtypes()[task.output_column] if task.structured else None
    for i, r in zip(rows, gen.generate(requests)):
        c = r.outputs[0]
        out[NUM_INPUT_TOKENS][i] = len(r.prompt_token_ids)
        out[NUM_GENERATED_TOKENS][i] = len(c.token_ids)
        out[FINISH_REASON][i] = c.finish_reason
        if c.finish_reason == "error":  # e.g. non-finite logits: this row's error, not the batch's
            row_error(task, out, i, c.error or "generation failed")
            continue
        if not task.structured:
            out[task.output_column][i] = c.text
            continue
        try:
            out[task.output_column][i] = structured_value(task.structured, c, dtype)
        except ValueError as exc:
            row_error(task, out, i, str(exc))


# ---- pooling ----------------------------------------------------------------------------------------------
def run_embed(df: pd.DataFrame, task: LLMTask, out: dict, model: Pooling) -> None:
    """Embed each row's text."""
    texts = cell_texts(df, task.inputs[0], task, out)
    if texts:
        for i, e in zip(texts, model.embed(list(texts.values()))):
            out[task.output_column][i] = e.outputs.embedding


def run_classify(df: pd.DataFrame, task: LLMTask, out: dict, model: Pooling) -> None:
    """Classify each row's text: the top label and every label's probability."""
    texts = cell_texts(df, task.inputs[0], task, out)
    if texts:
        for i, r in zip(texts, model.classify(list(texts.values()))):
            out[task.output_column][i] = r.outputs.label
            out[PROBS][i] = r.outputs.probs


def run_score(df: pd.DataFrame, task: LLMTask, out: dict, model: Pooling) -> None:
    """Score each row's left text against its right text."""
    left = cell_texts(df, task.inputs[0], task, out)
    right = cell_texts(df, task.inputs[1], task, out)
    rows = [i for i in left if i in right]
    if rows:
        for i, s in zip(rows, model.score([left[i] for i in rows], [right[i] for i in rows])):
            out[task.output_column][i] = s.outputs.score
