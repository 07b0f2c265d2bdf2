"""Running a task on one pandas partition: :func:`run_task` and the runner of each task kind.

``run_task`` turns a pandas frame into the same frame with the task's output columns, rows
in the same order, holding the process's engine for the task while it runs (see
:mod:`dfllm.worker.engine_cache`). Bad rows get a null output and a message in
``llm_error`` (see :mod:`dfllm.tasks.rows`); every other row is processed.

A generative runner (``generate``, ``chat``) turns its rows into requests checked by the
engine's input processor, the one place inputs are checked (a row it refuses gets the
message as its error), and generates them on the driver thread in the batches of every
task using the engine (:class:`Generation`). A pooling runner (``embed``, ``score``,
``classify``) calls the model's pooling method on the driver thread (:class:`Pooling`),
with each row's pooling params.

With a response cache (``LLMTask.cache``), a generative runner answers the deterministic
requests found there without the engine and stores the outputs of the others (see
:mod:`dfllm.tasks.response_cache`); the engine column ``from_cache`` says which.

A task that asks for engine columns (``LLMTask.engine_columns``, see
:data:`dfllm.tasks.kinds.ENGINE_COLUMNS`: Ray Data LLM's engine stage's outputs) gets
them filled by its runner from the engine's outputs, on the rows that got through; so does
``reasoning_content``, the reasoning a generative task's engine split off the answer when it
has a reasoning parser (``reasoning_parser=``, :mod:`dfllm.reasoning`).

A generative task given ``sampling_params=BeamSearchParams(...)`` (``LLMTask.beam_search``) runs
a beam search per row instead (:func:`dfllm.beam_search.search_requests`: every row of the
partition searched together, each step one driver call over all their live beams, in the shared
batches): the output column holds the best beam's continuation (typed as usual, ``json_schema``/
``choice`` constraining every beam), ``beams`` every beam best first (text, score, cumulative
log-probability, finish reason), ``num_generated_tokens`` and ``finish_reason`` the best beam's.
Its rows bypass the response cache (``from_cache`` false).

A generative task with sort keys (``LLMTask.sort_by``) hands its requests to the engine in
that order (:func:`request_order`: by a column, or by the rendered prompt so that rows
sharing a prefix run one after another while its blocks are in the prefix cache); each
output still goes to its own row, so the result's rows keep their order.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pandas as pd

from dfllm.beam_search import BeamSearchParams, beam_outputs, beam_search_score, search_requests
from dfllm.engine.input_processor import EngineRequest, InputProcessor
from dfllm.errors import printable, value_repr
from dfllm.llm import LLM
from dfllm.outputs import RequestOutput
from dfllm.pooling_params import PoolingParams
from dfllm.tasks.images import row_images, with_image_parts
from dfllm.tasks.response_cache import generate_cached
from dfllm.tasks.rows import (
    cell_texts,
    conversations,
    row_chat_template_kwargs,
    row_error,
    row_params,
    row_pooling_params,
    token_id_prompts,
)
from dfllm.tasks.schema import (
    BEAMS,
    FINISH_REASON,
    LLM_ERROR,
    NUM_GENERATED_TOKENS,
    NUM_INPUT_TOKENS,
    PROBS,
    REASONING_CONTENT,
    SORT_BY_PROMPT,
    structured_value,
)
from dfllm.tasks.templates import is_null, is_template
from dfllm.worker.driver import driver
from dfllm.worker.engine_cache import lease

if TYPE_CHECKING:
    from dfllm.config import EngineConfig
    from dfllm.tasks.task import LLMTask


@dataclasses.dataclass(frozen=True)
class Generation:
    """A generative engine as the generate and chat runners use it."""

    processor: InputProcessor  # tokenizes, renders chats, checks requests: call it holding ``lock``
    lock: threading.Lock
    generate: Callable[[list[EngineRequest]], list[RequestOutput]]  # outputs in order, batched with other tasks
    config: EngineConfig | None = None  # the engine's resolved settings (the response cache's key reads them)
    check_lora: Callable[[Any], None] | None = None  # LoRA: the engine's check of an adapter (call holding ``lock``)
    # set: the runner stops before generating and puts its requests there, by row position
    # (:func:`prompt_requests`)
    collect: dict[int, EngineRequest] | None = None


class Pooling:
    """A pooling model as the embed, score and classify runners use it: each call runs on
    the driver thread."""

    def __init__(self, llm: LLM):
        self.llm = llm

    @property
    def takes_images(self) -> bool:
        """Whether the model embeds images too (CLIP, SigLIP)."""
        engine = self.llm.pooling_engine
        return engine is not None and engine.image_text

    def embed(self, texts: list, params: list[PoolingParams] | None = None) -> list:
        return driver().call(lambda: self.llm.embed(texts, params, use_tqdm=False))

    def score(self, left: list[str], right: list[str], params: PoolingParams | None = None) -> list:
        return driver().call(lambda: self.llm.score(left, right, use_tqdm=False, pooling_params=params))

    def classify(self, texts: list[str], params: list[PoolingParams] | None = None) -> list:
        return driver().call(lambda: self.llm.classify(texts, params, use_tqdm=False))


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
                    RUNNERS[spec.runner](df, task, out, Pooling(entry.llm))
            else:
                engine = entry.llm.engine
                if engine is None:
                    raise ValueError(
                        f"{task.kind}: {entry.llm.config.model_path.name} is loaded as a pooling "
                        "model; use embed, classify, score or encode"
                    )
                # a beam search calls the engine once per step: no bar for each of them
                bar = progress and not task.beam_search
                generate = lambda requests: driver().generate(engine, entry.lock, requests, bar)  # noqa: E731
                RUNNERS[spec.runner](
                    df,
                    task,
                    out,
                    Generation(
                        engine.input_processor, entry.lock, generate, entry.llm.config, check_lora=engine.check_lora
                    ),
                )
    cols = {c: pd.Series(v, index=df.index, dtype=dtypes[c]) for c, v in out.items()}
    return pd.concat([df, pd.DataFrame(cols, index=df.index)], axis=1)


def prompt_requests(df: pd.DataFrame, task: LLMTask) -> tuple[dict[int, EngineRequest], int]:
    """The engine requests a generative task's runner makes of ``df``'s rows (rendered,
    tokenized and checked by this process's engine for the task, exactly as :func:`run_task`
    makes them; with their LoRA adapters), by row position, without generating, and the
    engine's KV block size. Rows the runner refuses are left out. The first pass of
    prefix-aware placement (:mod:`dfllm.tasks.prefix_keys`)."""
    spec = task.spec
    if not spec.generative:
        raise ValueError(f"prompt_requests: {task.kind} is not a generative task")
    collected: dict[int, EngineRequest] = {}
    if not len(df):
        return collected, 1
    out: dict[str, list] = {c: [None] * len(df) for c in task.output_dtypes()}
    with lease(task.model, dict(task.engine_kwargs)) as entry:
        engine = entry.llm.engine
        if engine is None:
            raise ValueError(f"{task.kind}: {entry.llm.config.model_path.name} is loaded as a pooling model")
        gen = Generation(
            engine.input_processor, entry.lock, lambda r: [], entry.llm.config, engine.check_lora, collected
        )
        RUNNERS[spec.runner](df, task, out, gen)
        return collected, int(entry.llm.config.block_size)


# ---- generate and chat ------------------------------------------------------------------------------------
def run_generate(df: pd.DataFrame, task: LLMTask, out: dict, gen: Generation) -> None:
    """Complete each row's text (a column or template), or its token ids (the task's token
    id column, where not null; a text beside them in the input column is their prompt text)."""
    prompts: dict[int, dict] = {i: {"prompt_token_ids": ids} for i, ids in token_id_prompts(df, task, out).items()}
    if prompts and not is_template(task.inputs[0]):
        given = df[task.inputs[0]].tolist()
        for i, p in prompts.items():
            if isinstance(given[i], str):
                p["prompt"] = given[i]
    texts = cell_texts(df, task.inputs[0], task, out, skip=_taken(prompts, out))
    with gen.lock:
        ids = gen.processor.tokenize(list(texts.values()))
    prompts.update({i: {"prompt": text, "prompt_token_ids": t} for (i, text), t in zip(texts.items(), ids)})
    if task.images:  # the row's images, as its multi_modal_data (the processor tokenizes text and placeholders)
        for i, images in row_images(df, task, out, sorted(prompts)).items():
            if images:
                p = prompts[i]
                prompts[i] = {"prompt": p["prompt"]} if "prompt" in p else {"prompt_token_ids": p["prompt_token_ids"]}
                prompts[i]["multi_modal_data"] = {"image": images}
        prompts = {i: p for i, p in prompts.items() if out[LLM_ERROR][i] is None}
    _generate(df, task, out, gen, prompts)


def run_chat(df: pd.DataFrame, task: LLMTask, out: dict, gen: Generation) -> None:
    """Reply to each row's conversation, rendered with the chat template (with the task's
    template variables and a row's own), or generate from its token ids (the task's token
    id column, where not null). With ``task.continue_final_message`` a conversation whose
    last message is not the user's is continued rather than answered."""
    prompts: dict[int, Any] = {i: {"prompt_token_ids": ids} for i, ids in token_id_prompts(df, task, out).items()}
    convs = conversations(df, task, out, skip=_taken(prompts, out))
    if task.images:  # the row's images as image_pil parts of its last user turn
        for i, row_imgs in row_images(df, task, out, sorted(convs)).items():
            try:
                convs[i] = with_image_parts(convs[i], row_imgs)
            except ValueError as exc:
                row_error(task, out, i, f"messages: {exc}")
        convs = {i: c for i, c in convs.items() if out[LLM_ERROR][i] is None}
    kwargs = row_chat_template_kwargs(df, task, list(convs), out)
    images: dict[int, list] = {}  # the images of rows whose conversations have image parts
    for i, conv in convs.items():
        if i not in kwargs:
            continue
        cont = task.continue_final_message and conv[-1].get("role") != "user"
        try:
            with gen.lock:
                images[i] = _conversation_images(gen.processor, conv, f"row {i}")
        except ValueError as exc:
            row_error(task, out, i, f"messages: {exc}")
            continue
        try:
            with gen.lock:
                prompts[i] = gen.processor.render_chat(
                    conv,
                    task.chat_template,
                    add_generation_prompt=not cont,
                    continue_final_message=cont,
                    chat_template_kwargs=kwargs[i] or None,
                )
        except Exception as exc:  # a template that cannot render this conversation
            row_error(task, out, i, f"chat template: {exc}")
    _generate(df, task, out, gen, prompts, images)


def _conversation_images(processor: InputProcessor, conv: list[dict], what: str) -> list:
    """The images of a conversation's image parts, decoded (``ValueError`` for one that
    cannot be read, or for image parts given to a text-only model)."""
    from dfllm.multimodal.processor import has_image_parts

    if not has_image_parts(conv):
        return []
    mm = getattr(processor, "mm", None)
    if mm is None:
        raise ValueError("image parts: this model takes no images (it is a text-only model)")
    return mm.images_of_conversation(conv, what)


def _taken(prompts: dict, out: dict) -> set[int]:
    """Rows not to read the text input of: those given as token ids, and those whose token
    ids were bad (they have their error)."""
    return set(prompts) | {i for i, e in enumerate(out[LLM_ERROR]) if e is not None}


def _generate(
    df: pd.DataFrame, task: LLMTask, out: dict, gen: Generation, prompts: dict, images: dict[int, list] | None = None
) -> None:
    """Generate ``prompts`` (row position -> prompt; ``images``: a rendered chat's images by
    row) with each row's sampling params, and fill the generation columns (and the engine
    columns the task asks for); rows the input processor refuses get its message."""
    params = row_params(df, task, list(prompts), out)
    so = task.structured_params()
    beam = task.beam_params()
    rows, requests = [], []
    for i in sorted(params):
        # the accessor's constraint replaces any a row's own sampling_params carry
        sp = params[i] if so is None else dataclasses.replace(params[i], structured_outputs=so)
        if beam is not None:  # a beam search: its prompt checked with its steps' params
            sp = beam.check_params()
        try:
            with gen.lock:
                own = {"images": images[i]} if images and images.get(i) else {}
                requests.append(gen.processor.process(prompts[i], sp, what="the prompt", **own))
        except ValueError as exc:
            row_error(task, out, i, str(exc))
            continue
        rows.append(i)
    if task.lora or task.lora_column:  # each row's LoRA adapter, resolved and checked here
        rows, requests = _with_loras(df, task, out, gen, rows, requests)
    if gen.collect is not None:  # prompt_requests: the requests, not their outputs
        gen.collect.update(zip(rows, requests))
        return
    if not rows:
        return
    if task.sort_by:
        order = request_order(df, task.sort_by, rows, requests)
        rows, requests = [rows[k] for k in order], [requests[k] for k in order]
    dtype = task.output_dtypes()[task.output_column] if task.structured else None
    start = time.perf_counter()
    if beam is not None:
        outputs, cached = _beam_search(gen, beam, requests), [False] * len(requests)
    else:
        outputs, cached = generate_cached(task.cache, gen.config, task.engine_kwargs, requests, gen.generate)
    took = time.perf_counter() - start
    for i, req, r, hit in zip(rows, requests, outputs, cached):
        c = r.outputs[0]
        out[NUM_INPUT_TOKENS][i] = len(r.prompt_token_ids)
        out[NUM_GENERATED_TOKENS][i] = len(c.token_ids)
        out[FINISH_REASON][i] = c.finish_reason
        if c.finish_reason == "error":  # e.g. non-finite logits: this row's error, not the batch's
            row_error(task, out, i, c.error or "generation failed")
            continue
        _engine_columns(task, out, i, gen, req, r, 0.0 if hit else took, hit)
        if isinstance(r, _Beams):
            out[BEAMS][i] = r.beams
        if REASONING_CONTENT in out:  # the engine's reasoning parser split the text (dfllm.reasoning)
            out[REASONING_CONTENT][i] = c.reasoning_content
        if not task.structured:
            out[task.output_column][i] = c.text
            continue
        try:
            out[task.output_column][i] = structured_value(task.structured, c, dtype)
        except ValueError as exc:
            row_error(task, out, i, str(exc))


def _beam_search(gen: Generation, params: BeamSearchParams, requests: list[EngineRequest]) -> list[RequestOutput]:
    """Each request's beam search, all searched together: an output per request whose
    completions are its beams, best first (:func:`dfllm.beam_search.beam_outputs`), carrying
    the ``beams`` column's value."""
    with gen.lock:
        tokenizer = gen.processor.tokenizer
        eos = None if tokenizer is None else tokenizer.eos_token_id
        max_model_len = gen.processor.max_model_len

    def decode(ids: list[int]) -> str:
        with gen.lock:
            return "" if tokenizer is None else str(tokenizer.decode(ids, skip_special_tokens=True))

    found = search_requests(requests, [params] * len(requests), gen.generate, eos, max_model_len)
    outputs: list[RequestOutput] = []
    for req, best in zip(requests, found):
        completions = beam_outputs(best, len(req.prompt_token_ids), params, eos, decode)
        beams = [
            {
                "text": c.text,
                "score": beam_search_score(b.tokens, b.cum_logprob, eos, params.length_penalty),
                "cumulative_logprob": b.cum_logprob,
                "finish_reason": c.finish_reason,
            }
            for b, c in zip(best, completions)
        ]
        outputs.append(_Beams("beam-search", req.prompt, list(req.prompt_token_ids), completions, True, beams=beams))
    return outputs


@dataclasses.dataclass
class _Beams(RequestOutput):
    """A beam search's output: its completions (best first) and the ``beams`` column's value."""

    beams: list[dict] = dataclasses.field(default_factory=list)


def _with_loras(
    df: pd.DataFrame, task: LLMTask, out: dict, gen: Generation, rows: list[int], requests: list[EngineRequest]
) -> tuple[list[int], list[EngineRequest]]:
    """The rows and requests with each row's LoRA adapter (the task's, or its column's; null:
    the base model), resolved on this worker (:func:`dfllm.lora.resolve.resolve`) and checked
    by the engine once per adapter; a row whose adapter fails gets its error instead."""
    from dfllm.lora.resolve import resolve

    column = df[task.lora_column].tolist() if task.lora_column else None
    where = f"column {task.lora_column!r}" if column is not None else "the lora argument"
    seen: dict[str, Any] = {}  # adapter -> its LoRARequest, or why it cannot run
    kept_rows, kept = [], []
    for i, req in zip(rows, requests):
        spec = task.lora if column is None else column[i]
        if is_null(spec):
            kept_rows.append(i)
            kept.append(req)
            continue
        if not isinstance(spec, str) or not spec:  # a list nested without end too: shown without recursion
            row_error(task, out, i, f"lora: {where} holds {value_repr(spec)}, not an adapter's path, URL or name")
            continue
        if printable(spec) != spec:  # a lone surrogate: no path, no name
            row_error(task, out, i, f"lora: {where} holds {spec!r}, not an adapter's path, URL or name")
            continue
        if spec not in seen:
            try:
                lora = resolve(spec, task.lora_root)
                if gen.check_lora is not None:
                    with gen.lock:
                        gen.check_lora(lora)
                seen[spec] = lora
            except ValueError as exc:
                seen[spec] = exc
        if isinstance(seen[spec], Exception):
            row_error(task, out, i, f"lora: {seen[spec]}")
            continue
        kept_rows.append(i)
        kept.append(dataclasses.replace(req, lora_request=seen[spec]))
    return kept_rows, kept


def request_order(df: pd.DataFrame, keys: tuple[str, ...], rows: list[int], requests: list[EngineRequest]) -> list[int]:
    """The order (positions into ``rows``/``requests``) in which to hand the requests of
    row positions ``rows`` to the engine: sorted by ``keys``, the first the most significant,
    ties kept in row order. A key is a column (its values sorted, nulls last; values that do
    not compare, such as lists or mixed types, are grouped, equal values together, in order
    of first appearance) or ``"prompt"``: the request's prompt token ids, lexicographically,
    so that prompts sharing a prefix are adjacent."""
    order = list(range(len(rows)))
    for key in reversed(keys):  # stable sorts, least significant key first
        if key == SORT_BY_PROMPT:
            order.sort(key=lambda k: requests[k].prompt_token_ids)
            continue
        codes = _sort_codes(df[key].iloc[rows].reset_index(drop=True))
        order.sort(key=codes.__getitem__)
    return order


def _sort_codes(values: pd.Series) -> list:
    """Per value, a number whose order is the values' (nulls last), or where they do not
    compare, one per distinct value in order of first appearance."""
    try:
        return values.rank(method="dense", na_option="bottom").tolist()
    except Exception:  # noqa: BLE001 (lists, dicts, mixed types: pandas and Arrow raise various errors)
        codes, _ = pd.factorize(values.map(value_repr), use_na_sentinel=False)
        return codes.tolist()


def _engine_columns(
    task: LLMTask,
    out: dict,
    i: int,
    gen: Generation,
    req: EngineRequest,
    r: RequestOutput,
    took: float,
    from_cache: bool = False,
) -> None:
    """Row ``i``'s engine columns that the task asks for (see ``kinds.ENGINE_COLUMNS``);
    ``from_cache``: the row was answered from the response cache."""
    want = task.engine_columns
    if not want:
        return
    c = r.outputs[0]
    values = {
        "prompt_token_ids": list(r.prompt_token_ids),
        "generated_tokens": list(c.token_ids),
        "time_taken_llm": took,
        "logprobs": logprob_dicts(c.logprobs),
        "prompt_logprobs": logprob_dicts(r.prompt_logprobs),
        "num_cached_tokens": r.num_cached_tokens,
        "from_cache": from_cache,
    }
    if "rendered_prompt" in want:
        prompt = r.prompt if r.prompt is not None else req.prompt
        if prompt is None:  # a row given as token ids: their text
            with gen.lock:
                tokenizer = gen.processor.tokenizer
                assert tokenizer is not None  # rows given as text: a tokenizer was loaded
                prompt = str(tokenizer.decode(req.prompt_token_ids))
        values["rendered_prompt"] = prompt
    for name in want:
        out[name][i] = values[name]


def logprob_dicts(logprobs) -> list | None:
    """vLLM's logprobs (per token a dict token id -> ``Logprob``, or None) as Ray Data LLM
    gives them: per token a dict token id -> ``{"logprob", "rank", "decoded_token"}``."""
    if logprobs is None:
        return None
    return [None if step is None else {int(t): dataclasses.asdict(lp) for t, lp in step.items()} for step in logprobs]


# ---- pooling ----------------------------------------------------------------------------------------------
def run_embed(df: pd.DataFrame, task: LLMTask, out: dict, model: Pooling) -> None:
    """Embed each row's text, or its image (``task.images``), with its pooling params."""
    if task.images:
        if not model.takes_images:
            raise ValueError(
                f"embed images=: {model.llm.config.model_path.name} is a text-only model; image "
                "embeddings need an image-text model (CLIP, SigLIP)"
            )
        images = row_images(df, task, out, range(len(df)))
        params = row_pooling_params(df, task, list(images), out)
        rows = [i for i in images if i in params]
        inputs: list = [{"multi_modal_data": {"image": images[i][0]}} for i in rows]
    else:
        texts = cell_texts(df, task.inputs[0], task, out)
        params = row_pooling_params(df, task, list(texts), out)
        rows = [i for i in texts if i in params]
        inputs = [texts[i] for i in rows]
    if rows:
        start = time.perf_counter()
        results = model.embed(inputs, [params[i] for i in rows])
        took = time.perf_counter() - start
        for i, e in zip(rows, results):
            out[task.output_column][i] = e.outputs.embedding
            _pooling_columns(task, out, i, e.outputs.embedding, took)


def run_classify(df: pd.DataFrame, task: LLMTask, out: dict, model: Pooling) -> None:
    """Classify each row's text (with its pooling params): the top label and every label's
    probability."""
    texts = cell_texts(df, task.inputs[0], task, out)
    params = row_pooling_params(df, task, list(texts), out)
    rows = [i for i in texts if i in params]
    if rows:
        start = time.perf_counter()
        results = model.classify([texts[i] for i in rows], [params[i] for i in rows])
        took = time.perf_counter() - start
        for i, r in zip(rows, results):
            out[task.output_column][i] = r.outputs.label
            out[PROBS][i] = r.outputs.probs
            _pooling_columns(task, out, i, r.outputs.probs, took)


def run_score(df: pd.DataFrame, task: LLMTask, out: dict, model: Pooling) -> None:
    """Score each row's left text against its right text (with its pooling params: rows
    sharing them are scored in one call)."""
    left = cell_texts(df, task.inputs[0], task, out)
    right = cell_texts(df, task.inputs[1], task, out)
    params = row_pooling_params(df, task, [i for i in left if i in right], out)
    groups: dict[tuple, list[int]] = {}
    for i, p in params.items():
        groups.setdefault(tuple(sorted(vars(p).items())), []).append(i)
    for rows in groups.values():
        start = time.perf_counter()
        results = model.score([left[i] for i in rows], [right[i] for i in rows], params[rows[0]])
        took = time.perf_counter() - start
        for i, s in zip(rows, results):
            out[task.output_column][i] = s.outputs.score
            _pooling_columns(task, out, i, [float(s.outputs.score)], took)


def _pooling_columns(task: LLMTask, out: dict, i: int, embeddings, took: float) -> None:
    """Row ``i``'s pooling engine columns that the task asks for: ``embeddings`` (embed's
    vector, classify's probabilities, ``[score]``) and ``time_taken_llm``."""
    if "embeddings" in task.engine_columns:
        out["embeddings"][i] = embeddings
    if "time_taken_llm" in task.engine_columns:
        out["time_taken_llm"][i] = took


#: The function that runs each task kind on one partition, by the kind's ``runner`` key.
RUNNERS: dict[str, Callable[..., None]] = {
    "generate": run_generate,
    "chat": run_chat,
    "embed": run_embed,
    "score": run_score,
    "classify": run_classify,
}
