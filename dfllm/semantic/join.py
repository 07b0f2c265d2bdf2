"""``.llm.join`` (an LLM judgment over pairs of rows, blocked by embedding similarity) and
``.llm.sim_join`` (an embedding k-nearest join), with the helpers the pairwise operators
(``topk``, ``dedup``) share: :class:`PairJudge` (one constrained decode per pair, through the
``.llm`` chat/generate task) and :class:`Embedder` (the ``.llm`` embed task).

Both joins run on pandas, Polars and Dask. On Dask the right side is embedded once (one
task per right partition, then one frame) and broadcast to one join task per left
partition, so every worker's engine judges its own left partition's pairs; the result is
lazy with exact ``meta``. User docs: docs/semantic.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import numbers
import string
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from dfllm.accessors.adapter import FrameAdapter
from dfllm.errors import shown, value_repr, value_text
from dfllm.semantic.frames import earlier_errors
from dfllm.semantic.prompts import record_template, semantic_prompt
from dfllm.tasks.runners import run_task
from dfllm.tasks.schema import LLM_ERROR, NUM_GENERATED_TOKENS, NUM_INPUT_TOKENS
from dfllm.tasks.task import LLMTask, make_task, repeated_columns
from dfllm.tasks.templates import field_text, is_null

logger = logging.getLogger("dfllm")

TRUE_FALSE = ("True", "False")
JOIN_PREAMBLE = (
    "You judge whether a statement holds for a pair of records, one from the left table and one from "
    "the right table. The statement names the records' fields in [brackets]; the records follow it."
)
SIMILARITY = "similarity"
_EMB = "__dfllm_embedding__"
_ERR = "__dfllm_error__"


# --- costs -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SemanticCost:
    """What an operator asked of the engines: ``engine_calls`` (batches handed to an engine,
    each one ``.llm`` task over a frame), ``requests`` (prompts or texts in them),
    ``input_tokens`` and ``output_tokens`` (generative requests' prompt and generated
    tokens), and the operator's own counts in ``counts`` (``comparisons``, ``pairs_judged``,
    ``cross_product``...)."""

    engine_calls: int = 0
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    counts: dict = dataclasses.field(default_factory=dict)
    cascade: object = None  # a join with cascade=: the cascade's CascadeStats

    def add(self, out: pd.DataFrame, generative: bool) -> None:
        self.engine_calls += 1 if len(out) else 0
        self.requests += len(out)
        if generative and len(out):
            self.input_tokens += int(out[NUM_INPUT_TOKENS].fillna(0).sum())
            self.output_tokens += int(out[NUM_GENERATED_TOKENS].fillna(0).sum())

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


# --- the engines, through the .llm tasks -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PairJudge:
    """One constrained decode per row of a frame of pairs: ``task`` is a ``chat`` (or
    ``generate``) task with ``choice=`` whose template reads the pair frame's columns.
    Greedy unless the user's sampling params say otherwise. Picklable."""

    task: LLMTask

    def __call__(self, pairs: pd.DataFrame, cost: SemanticCost | None = None) -> tuple[list, list]:
        """Each pair's answer (one of the choices; None where it failed) and error (None where it did not)."""
        answers, errors, _ = self.judge(pairs, cost)
        return answers, errors

    def judge(self, pairs: pd.DataFrame, cost: SemanticCost | None = None) -> tuple[list, list, list]:
        """``(answers, errors, first)``: ``first`` is each pair's probability of the first
        choice from its first answer token's log-probabilities (None without them)."""
        if not len(pairs):
            return [], [], []
        out = run_task(pairs, self.task)
        if cost is not None:
            cost.add(out, generative=True)
        answers = [None if pd.isna(v) else str(v) for v in out[self.task.output_column]]
        errors = answer_errors(answers, out)
        choices = tuple(self.task.structured[1]) if self.task.structured[:1] == ("choice",) else ()
        if "logprobs" in out.columns and len(choices) == 2:
            first = [
                first_choice_probability(lps[0] if isinstance(lps, list) and lps else None, *choices)
                for lps in out["logprobs"]
            ]
        else:
            first = [None] * len(out)
        return answers, errors, first


def answer_errors(answers: list, out: pd.DataFrame) -> list:
    """Each judgment's ``llm_error``; never silently none: an answer that is missing is an error."""
    errors = [None if pd.isna(e) else str(e) for e in out[LLM_ERROR]]
    return ["the judgment gave no answer" if a is None and e is None else e for a, e in zip(answers, errors)]


def first_choice_probability(first_token: dict | None, one: str, other: str) -> float | None:
    """The probability of answer ``one`` against ``other`` from the first answer token's top
    log-probabilities (token id -> ``{"logprob", "decoded_token", ...}``): the mass of listed
    tokens that begin ``one`` against that of those that begin ``other``, an answer none of
    whose tokens is listed counted at the smallest listed log-probability. None without them."""
    if not first_token:
        return None
    entries = [
        (str(e["decoded_token"]).strip(), e["logprob"])
        for e in first_token.values()
        if e.get("decoded_token") and e.get("logprob") is not None and math.isfinite(e["logprob"])
    ]
    if not entries:
        return None
    floor = min(lp for _, lp in entries)
    mass = []
    for answer in (one, other):
        lps = [lp for tok, lp in entries if tok and answer.startswith(tok)]
        mass.append(max(lps) + math.log(sum(math.exp(lp - max(lps)) for lp in lps)) if lps else floor)
    return 1.0 / (1.0 + math.exp(mass[1] - mass[0]))


@dataclasses.dataclass(frozen=True)
class LLMArgs:
    """An operator's (``topk``, ``join``, ``dedup``) arguments for its model's judgments, as its
    method takes them (``resources`` places its embeddings too; ``sampling_params``: join's)."""

    model: Any
    chat: bool
    on_error: str
    resources: dict | None
    cache: Any
    engine_kwargs: dict
    sampling_params: Any = None


def make_judge(
    frame: FrameAdapter,
    template_columns: Sequence[str],
    instruction: str,
    preamble: str,
    llm: LLMArgs,
    *,
    answer: str,
    choices: Sequence[str],
    names: dict | None,
    what: str,
    record: dict | None = None,
    logprobs: int | None = None,
) -> PairJudge:
    """A :class:`PairJudge` for ``instruction`` (its fields already the pair frame's columns),
    checked now: its task is built as ``.llm.chat``/``.llm.generate`` builds theirs (the model
    checked by the accessor, on a worker for Dask) with the operator's ``llm`` arguments. ``record``
    (label -> pair column) lists the record after the instruction (default: the instruction's
    fields); ``logprobs`` (top log-probabilities per token) lets :meth:`PairJudge.judge` read the
    first choice's probability."""
    chat, sampling_params = llm.chat, llm.sampling_params
    prompt = semantic_prompt(preamble, instruction, record, answer=answer, chat=chat, names=names)
    params: dict = {"temperature": 0.0, "max_tokens": 8}
    if logprobs is not None:
        params["logprobs"] = logprobs
    params.update(_given_params(sampling_params, what))
    try:
        task = make_task(
            "chat" if chat else "generate",
            (prompt.template,),
            list(template_columns),
            output_column="__dfllm_answer__",
            model=llm.model,
            sampling_params=params,
            system=prompt.system if chat else None,
            on_error=llm.on_error,
            engine_kwargs=llm.engine_kwargs,
            choice=list(choices),
            model_check=frame.model_check(llm.resources),
            cache=llm.cache,
            engine_columns=("logprobs",) if logprobs is not None else (),
        )
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return PairJudge(task)


def _given_params(sampling_params, what: str) -> dict:
    """The fields a judge's ``sampling_params`` (None, a dict of fields or a
    :class:`~dfllm.sampling_params.SamplingParams`) set, as a dict; ``ValueError`` for anything else."""
    from dfllm.sampling_params import SamplingParams

    if sampling_params is None:
        return {}
    if isinstance(sampling_params, dict):
        return dict(sampling_params)
    if isinstance(sampling_params, SamplingParams):  # its own fields, not the ones it derives (init=False)
        return {f.name: getattr(sampling_params, f.name) for f in dataclasses.fields(sampling_params) if f.init}
    raise ValueError(
        f"{what}: sampling_params must be a dfllm.SamplingParams or a dict of its fields, "
        f"got {type(sampling_params).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class Embedder:
    """The ``.llm`` embed task over a ``{column}`` template: unit vectors, per-row errors. Picklable."""

    task: LLMTask

    def __call__(self, df: pd.DataFrame, cost: SemanticCost | None = None) -> tuple[np.ndarray, list]:
        """``(vectors, errors)``: one L2-normalised row per input row (zeros where it failed).
        An image task on a text-only model (known only here, on a worker): every row's error."""
        if not len(df):
            return np.zeros((0, 0), dtype=np.float32), []
        if self.task.images and image_text_model(self.task.model) is False:
            return np.zeros((len(df), 0), dtype=np.float32), [text_only_message(self.task.model)] * len(df)
        out = run_task(df, self.task)
        if cost is not None:
            cost.add(out, generative=False)
        errors = [None if pd.isna(e) else str(e) for e in out[LLM_ERROR]]
        vecs = [
            None if e is not None else np.asarray(v, dtype=np.float32)
            for v, e in zip(out[self.task.output_column], errors)
        ]
        dim = next((len(v) for v in vecs if v is not None), 0)
        mat = np.zeros((len(vecs), dim), dtype=np.float32)
        for i, v in enumerate(vecs):
            if v is not None:
                norm = float(np.linalg.norm(v))
                mat[i] = v / norm if norm > 0 else v
        return mat, errors


def stack_vectors(vectors: list) -> np.ndarray:
    """Rows' vectors as :class:`Embedder` gives them, kept in a frame's column, as one matrix:
    a failed row's vector (None, or empty: a partition whose every row failed embeds to width
    0, and a Dask frame's right side joins such partitions with others) as zeros of the others'
    width."""
    dim = next((len(v) for v in vectors if v is not None and len(v)), 0)
    if not vectors:
        return np.zeros((0, 0), np.float32)
    return np.stack(
        [np.asarray(v, np.float32) if v is not None and len(v) else np.zeros(dim, np.float32) for v in vectors]
    )


def make_embedder(
    frame: FrameAdapter,
    template: str,
    columns: Sequence[str],
    *,
    model,
    resources: dict | None,
    what: str,
    engine_kwargs: dict | None = None,
    images: str | None = None,
) -> Embedder:
    """An :class:`Embedder` of ``template`` (default model: the bundled MiniLM), checked now.
    ``images`` (the argument that asked for it, e.g. ``"right_images=True"``) embeds the
    single column ``columns[0]`` as images instead (its cells as ``.llm.embed(images=)``
    takes them), which needs an image-text model (CLIP, SigLIP): a text-only one is refused
    now when its files are here, else each row's error on the workers."""
    from dfllm.tasks.kinds import DEFAULT_EMBED_MODEL
    from dfllm.tasks.task import check_model

    base = frame.model_check(resources)

    def check(task: LLMTask) -> None:
        (base or check_model)(task)
        if images and image_text_model(task.model) is False:
            raise ValueError(f"{images} embeds images: {text_only_message(task.model)}")

    try:
        task = make_task(
            "embed",
            () if images else (template,),
            list(columns),
            output_column="__dfllm_vector__",
            model=model or DEFAULT_EMBED_MODEL,
            engine_kwargs=engine_kwargs or {},
            model_check=check,
            images=columns[0] if images else None,
        )
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return Embedder(task)


def image_text_model(model: str | None) -> bool | None:
    """Whether ``model`` (a bundled alias or a directory) embeds images too (CLIP, SigLIP),
    read from its ``config.json``; None when its files are not here (a worker's directory)."""
    from dfllm.models.bundled import resolve_model
    from dfllm.models.loader import load_config
    from dfllm.models.registry import ENCODER_ARCHITECTURES

    try:
        archs = load_config(resolve_model(model)).architectures or []
    except (ValueError, OSError):
        return None
    return any(getattr(ENCODER_ARCHITECTURES.get(a), "image_text", False) for a in archs)


def text_only_message(model: str | None) -> str:
    return (
        f"{model!r} is a text-only model; embedding images needs an image-text embed_model (CLIP, SigLIP) "
        "that embeds texts and images into one space"
    )


# --- Dask tasks -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Placed:
    """A semantic operator's Dask task function, run on a worker declaring ``resources``: here
    when this worker does (or without any), else handed to one that does, as a task holding
    them, and waited for without holding a thread (as :func:`dfllm.accessors.placement.run_placed`
    places an ``.llm`` task). Named ``llm-sem-<name>`` in the dashboard's task stream."""

    fn: Callable
    resources: dict | None
    name: str

    def __post_init__(self):
        object.__setattr__(self, "__name__", f"llm-sem-{self.name}")

    def __call__(self, *args, partition_info=None):
        kwargs = {"partition_info": partition_info} if "partition_info" in inspect.signature(self.fn).parameters else {}
        if self.resources is None or not _on_worker():
            return self.fn(*args, **kwargs)
        from dfllm.accessors.placement import worker_has

        if worker_has(self.resources):
            return self.fn(*args, **kwargs)
        from distributed import worker_client

        with worker_client() as client:
            future = client.submit(
                self.fn,
                *args,
                resources=self.resources,
                pure=False,
                key=f"llm-sem-{self.name}-placed-{uuid.uuid4().hex[:12]}",
                **kwargs,
            )
            return future.result()


def _on_worker() -> bool:
    try:
        from distributed import get_worker

        get_worker()
        return True
    except (ImportError, ValueError):
        return False


def columns_of(frame: FrameAdapter, what: str = "semantic operator", side: str = "the frame") -> list:
    """The frame's column names, as they are (a pandas name ``0`` is not named by ``"0"``), which
    an operator's fields and column arguments name: ``ValueError`` where two are the same
    (which of them a field reads would be a guess)."""
    names = list(frame.columns)
    twice = repeated_columns(names)
    if twice:
        raise ValueError(f"{what}: {side} has more than one column named {twice}; rename them")
    return names


# --- join -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JoinSpec:
    """A checked ``join`` or ``sim_join``: the pair judge (None for ``sim_join``), how each side
    is embedded (None: no blocking), the blocking bounds, and how the right side's columns
    are named in the result."""

    judge: PairJudge | None
    left_fields: tuple[tuple[str, str], ...]  # (pair-frame column, left column)
    right_fields: tuple[tuple[str, str], ...]  # (pair-frame column, right column)
    left_embedder: Embedder | None
    right_embedder: Embedder | None
    block_k: int | None
    min_similarity: float | None
    right_names: tuple[tuple[str, str], ...]  # right column -> its name in the result
    similarity_column: str | None
    resources: dict | None = None  # Dask: the worker resources its tasks run with
    # cascade= (eager frames): the Cascade, the statement over readable pair columns, the pair
    # columns' readable names, and the judge's keyword arguments (model, chat, engine arguments)
    cascade: object = None
    cascade_instruction: str = ""
    readable: tuple[tuple[str, str], ...] = ()
    judge_kwargs: tuple = ()


def parse_join_instruction(instruction: str, left: list[str], right: list[str]) -> tuple[str, list, list, dict]:
    """``instruction`` with each field renamed to a pair-frame column, the left and right
    fields ``[(pair column, column)]`` and the labels the prompt shows. A field is a column
    of one side (``{abstract}``), or of the side named after a colon (``{title:left}``,
    ``{title:right}``) when both sides have it. ``ValueError`` names an unknown or ambiguous one."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"join: the instruction must be a non-empty string, got {instruction!r}")
    parts: list[str] = []
    lf: dict[str, str] = {}
    rf: dict[str, str] = {}
    names: dict[str, str] = {}
    try:
        parsed = list(string.Formatter().parse(instruction))
    except ValueError as exc:
        raise ValueError(f"join: bad instruction {instruction!r}: {exc}") from None
    for literal, name, spec, conv in parsed:
        parts.append(literal.replace("{", "{{").replace("}", "}}"))
        if name is None:
            continue
        if conv or (spec and spec not in ("left", "right")):
            raise ValueError(f"join: {{{name}:{spec}}}: a field is {{column}}, {{column:left}} or {{column:right}}")
        side = spec or (
            "left" if name in left and name not in right else "right" if name in right and name not in left else None
        )
        if side is None:
            where = "both frames" if name in left else "neither frame"
            hint = f"; write {{{name}:left}} or {{{name}:right}}" if name in left else ""
            raise ValueError(
                f"join: the instruction's field {{{name}}} is in {where} (left columns: {left}; right "
                f"columns: {right}){hint}"
            )
        if name not in (left if side == "left" else right):
            raise ValueError(f"join: {{{name}:{side}}}: no column {name!r} in the {side} frame")
        if "." in name or "[" in name:  # a template reads plain names only (no attribute or index access)
            raise ValueError(
                f"join: the instruction's field {{{name}}} names the {side} column {name!r}, whose '.' or '[' "
                "an instruction cannot hold; rename the column"
            )
        col = f"__{side[0]}_{name}"
        (lf if side == "left" else rf)[col] = name
        names[col] = f"{side}.{name}" if (name in left and name in right) else name
        parts.append("{" + col + "}")
    if not lf or not rf:
        raise ValueError(
            f"join: the instruction {instruction!r} must name a field of each frame "
            f"(left columns: {left}; right columns: {right})"
        )
    return "".join(parts), list(lf.items()), list(rf.items()), names


def right_names(
    left: list[str],
    right: list[str],
    suffix: str,
    reserved: Sequence[str],
    what: str = "join",
    as_text: bool = False,
) -> dict[str, str]:
    """The result's name of each right column: as is, or with ``suffix`` where the left has it.
    A column the operator adds (``reserved``: its similarity column) that either frame already
    has is refused, naming it, as is a suffixed name that is taken (``llm_error`` is not
    reserved on the left: it is an earlier operator's error, reported per row). ``as_text``
    (a Polars result, whose columns are named by strings): names that are the same as text
    (a pandas ``other``'s column ``0`` beside a column ``"0"``) are refused too."""
    if not isinstance(suffix, str):
        raise ValueError(f"{what}: suffix must be a string, got {shown(suffix)}")
    added = [c for c in reserved if c != LLM_ERROR]
    for c in added:
        if not isinstance(c, str) or not c:
            raise ValueError(f"{what}: similarity_column must be a non-empty string, got {shown(c)}")
    if list(reserved).count(LLM_ERROR) > 1:
        raise ValueError(f"{what}: similarity_column cannot be {LLM_ERROR!r} (the result's error column)")
    out = {c: (f"{c}{suffix}" if c in left else c) for c in right}
    for side, names in (("the frame", left), ("other", list(out.values()))):
        taken = [c for c in added if c in names]
        if taken:
            raise ValueError(
                f"{what}: {side} already has a column {taken[0]!r}, which the result adds; pass another "
                "similarity_column= (or rename the column)"
            )
    clash = sorted(set(out.values()) & (set(left) | set(reserved)))
    if clash:
        raise ValueError(f"{what}: the result would have column(s) {clash} twice; pass another suffix=")
    twice = repeated_columns([value_text(c) for c in [*left, *out.values(), *reserved]]) if as_text else []
    if twice:
        raise ValueError(
            f"{what}: a Polars result names its columns by strings, and {twice} would name more than one of "
            "them (a pandas other's column 0 beside a column '0'); rename them"
        )
    return out


def _fields_frame(df: pd.DataFrame, fields: Sequence[tuple[str, str]]) -> pd.DataFrame:
    return pd.DataFrame({col: df[src].reset_index(drop=True) for col, src in fields})


def embed_side(
    df: pd.DataFrame, embedder: Embedder, fields: Sequence[tuple[str, str]], cost: SemanticCost | None = None
) -> pd.DataFrame:
    """``df`` with its records' unit vectors and each row's error (naming the frame's column)."""
    vecs, errors = embedder(_fields_frame(df, fields), cost)
    errors = [None if e is None else rename_columns(e, fields) for e in errors]
    return df.assign(
        **{
            _EMB: pd.Series(list(vecs) if len(df) else [], index=df.index, dtype=object),
            _ERR: pd.Series(errors, index=df.index, dtype=object),
        }
    )


def rename_columns(message: str, fields: Sequence[tuple[str, str]]) -> str:
    """An engine's message with the operator's internal column names as the user's columns (a
    column of any name: ``0``, ``1.5``, a tuple)."""
    for col, src in fields:
        message = message.replace(repr(col), value_repr(src)).replace(col, value_text(src))
    return message


def candidate_pairs(
    lv: np.ndarray, rv: np.ndarray, lok: np.ndarray, rok: np.ndarray, k: int | None, min_similarity: float | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(left positions, right positions, similarities)`` of the pairs to judge: for every
    usable left row its ``k`` most similar usable right rows (all of them when ``k`` is None),
    those below ``min_similarity`` left out; ordered by left row, then similarity (highest
    first), ties by right position."""
    li_all, ri_all, s_all = [np.zeros(0, int)], [np.zeros(0, int)], [np.zeros(0, float)]
    rpos = np.flatnonzero(rok)
    sims = lv[np.flatnonzero(lok)] @ rv[rpos].T if lv.size and rv.size else np.zeros((int(lok.sum()), len(rpos)))
    for row, i in enumerate(np.flatnonzero(lok)):
        s = sims[row].astype(np.float64)
        order = np.lexsort((rpos, -s))  # similarity desc, then right position
        if k is not None:
            order = order[:k]
        if min_similarity is not None:
            order = order[s[order] >= min_similarity]
        li_all.append(np.full(len(order), i))
        ri_all.append(rpos[order])
        s_all.append(s[order])
    return np.concatenate(li_all), np.concatenate(ri_all), np.concatenate(s_all)


def _null_fields(df: pd.DataFrame, fields: Sequence[tuple[str, str]], errors: list, prompted: bool) -> list:
    """``errors`` with a message for each row (without one) that has a null field or an
    earlier operator's ``llm_error``, or (``prompted``: a join's fields go into the pair's
    prompt) a field no prompt can hold: such a row is not paired. ``sim_join``'s fields are
    only embedded (text or images), and the embedder checks them."""
    errors = list(errors)
    prior = earlier_errors(df[LLM_ERROR]) if LLM_ERROR in df.columns else [None] * len(df)
    for i in range(len(df)):
        if errors[i] is not None:
            continue
        if prior[i] is not None:
            errors[i] = prior[i]
            continue
        for _, src in fields:  # each field as the pair's prompt will write it
            value, what = df[src].iat[i], f"column {shown(src)}"
            try:
                if prompted:
                    field_text(value, what)
                elif is_null(value):
                    raise ValueError(f"{what} is null")
            except ValueError as exc:
                errors[i] = str(exc)
                break
    return errors


def _assemble(left: pd.DataFrame, right: pd.DataFrame, rows: list[tuple], spec: JoinSpec) -> pd.DataFrame:
    """The result of ``rows`` ``(left position, right position, similarity, error)``: the left
    row beside the right row (a None position: that side null)."""
    li, ri, sims, errors = (list(c) for c in zip(*rows)) if rows else ([], [], [], [])
    lcols = [c for c in left.columns if c not in (_EMB, _ERR, LLM_ERROR)]
    rcols = [c for c in right.columns if c not in (_EMB, _ERR, LLM_ERROR)]
    parts = [_take(left[lcols], li), _take(right[rcols], ri).rename(columns=dict(spec.right_names))]
    if spec.similarity_column:
        parts.append(pd.DataFrame({spec.similarity_column: pd.Series(sims, dtype="double[pyarrow]")}))
    parts.append(pd.DataFrame({LLM_ERROR: pd.Series(errors, dtype="string[pyarrow]")}))
    return pd.concat(parts, axis=1)


def _take(df: pd.DataFrame, positions: list) -> pd.DataFrame:
    """Rows at ``positions`` (None: a row of nulls), index dropped, each column of the dtype
    :func:`_nullable` gives it, whether or not a null row is taken (so that every result, and a
    Dask join's ``meta``, has the same dtypes)."""
    df = _nullable(df)
    if all(p is not None for p in positions):
        return df.iloc[list(positions)].reset_index(drop=True)
    rows = df.reset_index(drop=True).reindex([-1 if p is None else p for p in positions])
    rows.index = pd.RangeIndex(len(positions))
    return rows


def _nullable(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with each NumPy integer and boolean column (which cannot hold a null: reindexing
    would make an ``int64`` column ``float64``, rounding ids past 2**53, and a ``bool`` one
    ``object``) as the Arrow type of the same values (``int64[pyarrow]``, ``bool[pyarrow]``)."""
    kinds = {
        i: pd.ArrowDtype(pa.from_numpy_dtype(t))
        for i, t in enumerate(df.dtypes)
        if isinstance(t, np.dtype) and t.kind in "iub"
    }
    if not kinds:
        return df
    df = df.copy(deep=False)
    for i, dtype in kinds.items():
        df.isetitem(i, df.iloc[:, i].astype(dtype))
    return df


def join_frames(
    left: pd.DataFrame, right: pd.DataFrame, spec: JoinSpec, cost: SemanticCost, report_right_errors: bool = True
) -> pd.DataFrame:
    """The join of two pandas frames (``right`` already embedded when the spec blocks):
    matching pairs, then every left row and (``report_right_errors``) right row that could not
    be used, with its error; a pair whose judgment failed is kept with its error, never dropped."""
    blocked = spec.left_embedder is not None and spec.right_embedder is not None
    if spec.left_embedder is not None and _EMB not in left.columns:
        left = embed_side(left, spec.left_embedder, spec.left_fields, cost)
    if spec.right_embedder is not None and _EMB not in right.columns:
        right = embed_side(right, spec.right_embedder, spec.right_fields, cost)
    lidx, ridx = list(left.index), list(right.index)
    left, right = left.reset_index(drop=True), right.reset_index(drop=True)
    prompted = spec.judge is not None
    lerr = _null_fields(left, spec.left_fields, list(left[_ERR]) if blocked else [None] * len(left), prompted)
    rerr = _null_fields(
        right,
        spec.right_fields,
        list(right[_ERR]) if blocked and _ERR in right.columns else [None] * len(right),
        prompted,
    )
    lok = np.array([e is None for e in lerr], dtype=bool)
    rok = np.array([e is None for e in rerr], dtype=bool)
    if blocked:
        lv, rv = stack_vectors(left[_EMB].to_list()), stack_vectors(right[_EMB].to_list())
        li, ri, sims = candidate_pairs(lv, rv, lok, rok, spec.block_k, spec.min_similarity)
    else:
        li, ri = (a.ravel() for a in np.meshgrid(np.flatnonzero(lok), np.flatnonzero(rok), indexing="ij"))
        sims = None
    cost.count("cross_product", len(left) * len(right))
    answers: list = [TRUE_FALSE[0]] * len(li)  # sim_join: every pair matches
    errors: list = [None] * len(li)
    sources: list = []
    if spec.judge is not None:
        pairs = pd.concat(
            [_fields_frame(left.iloc[li], spec.left_fields), _fields_frame(right.iloc[ri], spec.right_fields)], axis=1
        )
        if spec.cascade is not None:
            answers, errors, sources = _cascade_pairs(pairs, spec, cost)
        else:
            answers, errors = spec.judge(pairs, cost)
        cost.count("pairs_judged", len(pairs))
    kept = [n for n, (a, e) in enumerate(zip(answers, errors)) if e is not None or a == TRUE_FALSE[0]]
    rows: list[tuple] = [  # (left position, right position, similarity, error)
        (
            int(li[n]),
            int(ri[n]),
            None if sims is None else float(sims[n]),
            None
            if errors[n] is None
            else f"join: the pair (left index {shown(lidx[li[n]])}, right index {shown(ridx[ri[n]])}) "
            "could not be judged: "
            f"{rename_columns(errors[n], spec.left_fields + spec.right_fields)}",
        )
        for n in kept
    ]
    rows += [(int(i), None, None, f"left index {shown(lidx[i])}: {lerr[i]}") for i in np.flatnonzero(~lok)]
    if report_right_errors:
        rows += [(None, int(j), None, f"right index {shown(ridx[j])}: {rerr[j]}") for j in np.flatnonzero(~rok)]
    out = _assemble(left, right, rows, spec)
    if spec.cascade is not None:
        from dfllm.semantic.cascade import SOURCE

        src = [sources[n] for n in kept] + [None] * (len(out) - len(kept))
        out.insert(len(out.columns) - 1, SOURCE, pd.Series(src, index=out.index, dtype="string[pyarrow]"))
    return out


def _cascade_pairs(pairs: pd.DataFrame, spec: JoinSpec, cost: SemanticCost) -> tuple[list, list, list]:
    """The pairs judged by ``.llm.judge`` with the spec's cascade (on readable column names):
    answers, errors and which model decided each pair."""
    from dfllm.semantic.cascade import SOURCE

    readable = pairs.rename(columns=dict(spec.readable))
    kwargs = dict(spec.judge_kwargs)
    engine_kwargs = kwargs.pop("engine_kwargs", {})
    out, stats = readable.llm.judge(
        spec.cascade_instruction, cascade=spec.cascade, return_stats=True, **kwargs, **engine_kwargs
    )
    cost.cascade = stats
    cost.count("large_model_pairs", stats.large_model_rows)
    answers = [None if pd.isna(v) else TRUE_FALSE[0] if bool(v) else TRUE_FALSE[1] for v in out["verdict"]]
    errors = answer_errors(answers, out)
    sources = [None if pd.isna(v) else str(v) for v in out[SOURCE]]
    return answers, errors, sources


@dataclasses.dataclass(frozen=True)
class JoinPartition:
    """One left partition joined with the whole (embedded) right side: a Dask task."""

    spec: JoinSpec

    def __call__(self, left: pd.DataFrame, right: pd.DataFrame, partition_info=None) -> pd.DataFrame:
        first = partition_info is None or partition_info.get("number", 0) == 0
        return join_frames(left, right, self.spec, SemanticCost(), report_right_errors=first)


@dataclasses.dataclass(frozen=True)
class EmbedPartition:
    """A right partition with its records' vectors and errors: a Dask task."""

    embedder: Embedder
    fields: tuple

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        return embed_side(df, self.embedder, self.fields)


def run_join(frame: FrameAdapter, other, spec: JoinSpec, return_stats: bool):
    """``spec`` over the accessor's frame and ``other`` (the same library's frame, or pandas)."""
    right_frame = FrameAdapter(other)
    if frame.kind == "dask":
        import dask.dataframe as dd

        right = other if right_frame.kind == "dask" else dd.from_pandas(right_frame.to_pandas(), npartitions=1)
        if spec.right_embedder is not None:
            meta_r = right._meta.assign(**{_EMB: pd.Series([], dtype=object), _ERR: pd.Series([], dtype=object)})
            right = right.map_partitions(
                Placed(EmbedPartition(spec.right_embedder, spec.right_fields), spec.resources, "embed"), meta=meta_r
            )
        right = right.repartition(npartitions=1)
        meta = _assemble(frame.empty(), right._meta, [], spec)
        if return_stats:
            raise ValueError(
                "return_stats=True needs an eager frame (pandas or Polars); on Dask, the pairs "
                "judged are logged by each task"
            )
        return frame.obj.map_partitions(
            Placed(JoinPartition(spec), spec.resources, "join"), right, meta=meta, align_dataframes=False
        )
    cost = SemanticCost()
    out = join_frames(frame.to_pandas(), right_frame.to_pandas(), spec, cost)
    logger.info(
        "%s: %d of %d pairs judged (%d engine calls, %d prompt tokens)",
        "join" if spec.judge else "sim_join",
        cost.counts.get("pairs_judged", 0),
        cost.counts.get("cross_product", 0),
        cost.engine_calls,
        cost.input_tokens,
    )
    other_types = right_frame.polars_schema()  # other's Polars dtypes, by their names in the result
    result = frame.back(out, {new: other_types[old] for old, new in spec.right_names if old in other_types})
    return (result, cost) if return_stats else result


def semantic_join(
    frame: FrameAdapter,
    other,
    instruction: str,
    llm: LLMArgs,
    *,
    block_k: int | None,
    min_similarity: float | None,
    embed_model,
    suffix: str,
    similarity_column: str,
    return_stats: bool,
    cascade=None,
):
    """``df.llm.join``: see :meth:`SemanticFrameMethods.join`."""
    left_cols, right_cols = _data_columns(frame, "join"), _other_columns(frame, other, "join")
    template, lf, rf, names = parse_join_instruction(instruction, left_cols, right_cols)
    _check_block(block_k, min_similarity, "join")
    blocked = block_k is not None or min_similarity is not None
    judge = make_judge(
        frame,
        [c for c, _ in lf + rf],
        template,
        JOIN_PREAMBLE,
        llm,
        answer="Does the statement hold for these two records? Answer True or False.",
        choices=TRUE_FALSE,
        names=names,
        what="join",
    )
    embed = {}
    if blocked:
        for side, fields in (("left", lf), ("right", rf)):
            labels = {names[c]: c for c, _ in fields}
            embed[side] = make_embedder(
                frame,
                record_template(labels),
                [c for c, _ in fields],
                model=embed_model,
                resources=llm.resources,
                what="join",
            )
    reserved = [LLM_ERROR, similarity_column] if blocked else [LLM_ERROR]
    rnames = right_names(left_cols, right_cols, suffix, reserved, as_text=frame.kind in ("polars", "lazy"))
    spec = JoinSpec(
        judge,
        tuple(lf),
        tuple(rf),
        embed.get("left"),
        embed.get("right"),
        block_k,
        min_similarity,
        tuple(rnames.items()),
        similarity_column if blocked else None,
        operator_resources(frame, llm.resources),
    )
    if cascade is not None:
        spec = _with_cascade(frame, spec, cascade, template, names, llm)
    return run_join(frame, other, spec, return_stats)


def _with_cascade(frame: FrameAdapter, spec: JoinSpec, cascade, template: str, names: dict, llm: LLMArgs) -> JoinSpec:
    """``spec`` judging its pairs through ``.llm.judge(..., cascade=cascade)`` (pandas and
    Polars frames): the pair columns renamed as the prompt shows them (``review``, or
    ``left_title``/``right_title`` for a column both frames have)."""
    from dfllm.semantic.cascade import Cascade

    if not isinstance(cascade, Cascade):
        raise ValueError(f"join: cascade must be a dfllm.Cascade, got {type(cascade).__name__}")
    if frame.kind == "dask":
        raise ValueError(
            "join: cascade= learns its thresholds on a sample of every pair; it runs on pandas and "
            "Polars frames (compute the Dask frames first, or join without cascade=)"
        )
    if llm.on_error != "null":
        raise ValueError("join: a cascade keeps failed pairs with their llm_error; on_error must be 'null'")
    from dfllm.semantic.cascade import SOURCE

    if SOURCE in _data_columns(frame, "join") or SOURCE in dict(spec.right_names).values():
        raise ValueError(f"join: a cascade adds the column {SOURCE!r}, which a frame already has; rename it")
    readable = {col: label.replace(".", "_") for col, label in names.items()}
    if len(set(readable.values())) != len(readable):
        raise ValueError(f"join: the instruction's fields {sorted(readable.values())} must have distinct names")
    instruction = template
    for col, name in readable.items():
        instruction = instruction.replace("{" + col + "}", "{" + name + "}")
    kwargs = (
        ("model", llm.model),
        ("chat", llm.chat),
        ("cache", llm.cache),
        ("engine_kwargs", dict(llm.engine_kwargs)),
    )
    return dataclasses.replace(
        spec, cascade=cascade, cascade_instruction=instruction, readable=tuple(readable.items()), judge_kwargs=kwargs
    )


def semantic_sim_join(
    frame: FrameAdapter,
    other,
    left_on: str,
    right_on: str,
    k: int,
    *,
    embed_model,
    suffix: str,
    similarity_column: str,
    min_similarity: float | None,
    resources: dict | None,
    return_stats: bool,
    engine_kwargs: dict | None,
    left_images: bool = False,
    right_images: bool = False,
):
    """``df.llm.sim_join``: see :meth:`SemanticFrameMethods.sim_join`."""
    left_cols, right_cols = _data_columns(frame, "sim_join"), _other_columns(frame, other, "sim_join")
    if left_on not in left_cols:
        raise ValueError(f"sim_join: left_on {shown(left_on)} is not a column of the frame (columns: {left_cols})")
    if right_on not in right_cols:
        raise ValueError(f"sim_join: right_on {shown(right_on)} is not a column of other (columns: {right_cols})")
    for name, flag in (("left_images", left_images), ("right_images", right_images)):
        if not isinstance(flag, (bool, np.bool_)):
            raise ValueError(f"sim_join: {name} must be True or False, got {shown(flag)}")
    _check_block(k, min_similarity, "sim_join")
    if k is None:
        raise ValueError("sim_join: k (the neighbours per left row) is required")
    lf, rf = (("__l_text", left_on),), (("__r_text", right_on),)
    le, re_ = (
        make_embedder(
            frame,
            "{" + col + "}",
            [col],
            model=embed_model,
            resources=resources,
            engine_kwargs=engine_kwargs,
            what="sim_join",
            images=f"{side}_images=True" if flag else None,
        )
        for side, col, flag in (("left", "__l_text", left_images), ("right", "__r_text", right_images))
    )
    rnames = right_names(
        left_cols, right_cols, suffix, [LLM_ERROR, similarity_column], "sim_join", frame.kind in ("polars", "lazy")
    )
    spec = JoinSpec(
        None,
        lf,
        rf,
        le,
        re_,
        k,
        min_similarity,
        tuple(rnames.items()),
        similarity_column,
        operator_resources(frame, resources),
    )
    return run_join(frame, other, spec, return_stats)


def _other_columns(frame: FrameAdapter, other, what: str) -> list[str]:
    kind, right = frame.kind, FrameAdapter(other)
    allowed = {
        "pandas": ("pandas",),
        "dask": ("dask", "pandas"),
        "polars": ("polars", "lazy", "pandas"),
        "lazy": ("polars", "lazy", "pandas"),
    }[kind]
    if right.kind not in allowed:
        raise ValueError(
            f"{what}: other is a {type(other).__name__}; a {kind} frame joins {' or '.join(allowed)} frames"
        )
    return _data_columns(right, what, "other")


def operator_resources(frame: FrameAdapter, resources: dict | None) -> dict | None:
    """``resources`` for a Dask frame's tasks; for a pandas or Polars frame the accessor's own
    check refuses them (they run in this process)."""
    if frame.kind == "dask":
        from dfllm.accessors.placement import check_resources

        return check_resources(resources)
    frame.model_check(resources)
    return None


def _data_columns(frame: FrameAdapter, what: str, side: str = "the frame") -> list[str]:
    """A frame's columns but an earlier operator's ``llm_error`` (its rows are reported, not paired).
    ``ValueError`` naming a column that has a name the join gives its own columns while it runs
    (each row's vector and embedding error), which would be dropped or read as the join's."""
    names = columns_of(frame, what, side)
    private = [c for c in names if c in (_EMB, _ERR)]
    if private:
        raise ValueError(f"{what}: {side} has a column named {private[0]!r}, a name the join uses itself; rename it")
    return [c for c in names if c != LLM_ERROR]


def _check_block(k, min_similarity, what: str) -> None:
    if k is not None and (not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1):
        raise ValueError(f"{what}: k must be a positive integer, got {shown(k)}")
    number = isinstance(min_similarity, numbers.Real) and not isinstance(min_similarity, (bool, np.bool_))
    if min_similarity is not None and not (number and -1 <= min_similarity <= 1):
        raise ValueError(f"{what}: min_similarity must be a number in [-1, 1], got {shown(min_similarity)}")
