"""``.llm.agg``: summarise many rows (or each group) into one text by hierarchical reduction.

Each row becomes a record (the instruction's fields, ``[field]: value``). Records are packed,
in order, into chunks whose prompt fits ``max_model_len`` (the prompt's fixed part, the
chunk and ``max_tokens`` of answer, counted with the model's tokenizer); every chunk is
summarised (one engine call per level for every group's chunks), and while more than one
summary is left the summaries are packed and summarised again with the fold prompt, until
one is left. On Dask it is a tree reduction: each partition folds its rows to one summary per
group (one task each), and groups of ``split_every`` partitions' summaries are folded again
(:func:`fold_summaries`), up to one. User docs: docs/semantic.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Sequence

import pandas as pd

from dfllm.accessors.adapter import FrameAdapter
from dfllm.errors import printable
from dfllm.inputs import check_unicode
from dfllm.semantic.frames import earlier_errors
from dfllm.semantic.join import LLMArgs, Placed, SemanticCost, columns_of, operator_resources
from dfllm.semantic.prompts import instruction_fields, record_template, semantic_prompt
from dfllm.tasks.schema import LLM_ERROR
from dfllm.tasks.task import LLMTask, make_task
from dfllm.tasks.templates import field_text, is_null

logger = logging.getLogger("dfllm")

AGG_PREAMBLE = (
    "You summarise records. Follow the instruction, which names the records' fields in [brackets]; "
    "the records follow it, separated by blank lines. Answer with the summary only."
)
FOLD_PREAMBLE = (
    "You combine partial summaries of records into one summary. Follow the instruction, which names "
    "the records' fields in [brackets]; the partial summaries follow it, separated by blank lines. "
    "Answer with the combined summary only."
)
_BODY = "__dfllm_body__"
_SUMMARY, _ERR = "__dfllm_summary__", "__dfllm_error__"
SEPARATOR = "\n\n"


@functools.lru_cache(maxsize=8)
def _tokenizer(model: str):
    from transformers import AutoTokenizer

    from dfllm.models.bundled import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model)))


def _model_len(model: str, engine_kwargs: dict) -> int:
    if engine_kwargs.get("max_model_len"):
        return int(engine_kwargs["max_model_len"])
    from dfllm.models.bundled import resolve_model

    config = json.loads((resolve_model(model) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)


@dataclasses.dataclass(frozen=True)
class AggSpec:
    """A checked ``agg``: the two summarising tasks (leaf and fold), the rows' record template,
    the group keys and the token budget of a chunk."""

    leaf: LLMTask
    fold: LLMTask
    fields: tuple[str, ...]
    by: tuple[str, ...]
    model: str
    budget_leaf: int  # tokens of records one leaf prompt may hold
    budget_fold: int
    output_column: str
    split_every: int
    resources: dict | None = None


def pack(texts: Sequence[str], budget: int, tokenizer) -> tuple[list[list[str]], list[str]]:
    """``texts`` in order in chunks of at most ``budget`` tokens (each text's tokens plus the
    separator's); a text alone over the budget is cut to it. Also the notes of cut texts."""
    chunks: list[list[str]] = []
    notes: list[str] = []
    sep = len(tokenizer.encode(SEPARATOR, add_special_tokens=False))
    current: list[str] = []
    used = 0
    for n, text in enumerate(texts):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > budget:
            text = tokenizer.decode(ids[: max(budget - sep, 1)])
            ids = ids[: max(budget - sep, 1)]
            notes.append(f"text {n} was cut to {len(ids)} tokens to fit max_model_len")
        cost = len(ids) + sep
        if current and used + cost > budget:
            chunks.append(current)
            current, used = [], 0
        current.append(text)
        used += cost
    if current:
        chunks.append(current)
    return chunks, notes


def _summarise(task: LLMTask, bodies: list[str], cost: SemanticCost) -> tuple[list, list]:
    from dfllm.tasks.runners import run_task

    if not bodies:
        return [], []
    out = run_task(pd.DataFrame({_BODY: bodies}), task)
    cost.add(out, generative=True)
    texts = [None if pd.isna(t) else str(t).strip() for t in out[task.output_column]]
    errors = [None if pd.isna(e) else str(e) for e in out[LLM_ERROR]]
    return texts, errors


def reduce_groups(groups: list[list[str]], spec: AggSpec, cost: SemanticCost, leaf: bool = True) -> tuple[list, list]:
    """Each group's texts folded to one summary (None where it failed) and its error; the
    first level with the leaf prompt when ``leaf``, every other with the fold prompt. All
    groups' chunks of one level go to the engine in one call."""
    tok = _tokenizer(spec.model)
    current = [list(g) for g in groups]
    results: list = [None] * len(groups)
    errors: list = [None if g else "agg: no rows to summarise" for g in current]
    notes: list[list[str]] = [[] for _ in groups]
    active = [n for n, g in enumerate(current) if g]
    level = 0
    while active:
        task = spec.leaf if (leaf and level == 0) else spec.fold
        budget = spec.budget_leaf if (leaf and level == 0) else spec.budget_fold
        owners, bodies = [], []
        for n in active:
            chunks, cut = pack(current[n], budget, tok)
            notes[n] += cut
            for chunk in chunks:
                owners.append(n)
                bodies.append(SEPARATOR.join(chunk))
        texts, errs = _summarise(task, bodies, cost)
        cost.count("summaries", len(bodies))
        nxt: dict[int, list[str]] = {n: [] for n in active}
        failed: set[int] = set()
        for n, text, err in zip(owners, texts, errs):
            if err is not None or text is None:
                failed.add(n)
                errors[n] = f"agg: a summary failed: {err or 'no text'}"
            else:
                nxt[n].append(text)
        for n in active:
            if n not in failed and len(nxt[n]) == 1:
                results[n] = nxt[n][0]
            current[n] = nxt[n]
        active = [n for n in active if n not in failed and len(nxt[n]) > 1]
        level += 1
    return results, _with_notes(errors, [["agg: " + "; ".join(n)] if n else [] for n in notes])


def _with_notes(errors: list, notes: list[list[str]]) -> list:
    """Each group's error followed by its notes (``"; "``-joined, each once)."""
    return [e if not n else "; ".join(dict.fromkeys([*([e] if e else []), *n])) for e, n in zip(errors, notes)]


def fold_summaries(summaries: Sequence[str], spec: AggSpec, cost: SemanticCost | None = None) -> tuple:
    """Summaries (say, of partitions) folded to one with the fold prompt, as a Dask reduction
    folds them: one summary is returned as it is. ``(summary, error)``."""
    if len(summaries) == 1:
        return summaries[0], None
    texts, errors = reduce_groups([list(summaries)], spec, cost or SemanticCost(), leaf=False)
    return texts[0], errors[0]


def _row_name(label) -> str:
    try:
        return f"the row of index {label!r}"
    except Exception:  # noqa: BLE001 (a label whose repr raises, like an int past the digit limit)
        return f"a row whose index is a {type(label).__name__}"


def _record(template: str, fields: Sequence[str], row: Sequence) -> str:
    """One row's record (``[field]: value`` lines), or ``ValueError`` naming the field whose
    value cannot be in one (:func:`~dfllm.tasks.templates.field_text`, the check every
    operator makes of a cell before it becomes prompt text)."""
    return template.format_map({f: field_text(v, f"its field {f!r}") for f, v in zip(fields, row)})


def _records(
    df: pd.DataFrame, spec: AggSpec, labels: Sequence, key_errors: Sequence
) -> tuple[list[str | None], list[str | None]]:
    """Each row's record, or None and the note of why it was left out: an earlier
    ``llm_error``, a group key that cannot be one (``key_errors``, None where it can) or a
    field that :func:`_record` refuses. ``labels``: the rows' index labels."""
    template = record_template(list(spec.fields))
    texts: list[str | None] = []
    errors: list[str | None] = []
    prior = earlier_errors(df[LLM_ERROR]) if LLM_ERROR in df.columns else [None] * len(df)
    rows = df[list(spec.fields)].itertuples(index=False, name=None)
    for n, (label, row) in enumerate(zip(labels, rows)):
        try:
            if prior[n] is not None:
                raise ValueError(prior[n])
            if key_errors[n] is not None:
                raise ValueError(key_errors[n])
            texts.append(_record(template, spec.fields, row))
            errors.append(None)
        except ValueError as exc:
            texts.append(None)
            errors.append(printable(f"{_row_name(label)} was left out: {exc}"))
    return texts, errors


def _group_keys(df: pd.DataFrame, spec: AggSpec) -> tuple[list[pd.Series], dict[int, str]]:
    """The ``by`` columns as group keys, and the positions of the rows whose key cannot be
    one (a list, a dict, an array: a value without a hash; text with a lone surrogate), each
    with why. Such a key counts as null: the row goes to that group, which leaves it out and
    names it in its error."""
    import pyarrow as pa

    keys: list[pd.Series] = []
    bad: dict[int, str] = {}
    for b in spec.by:
        col = df[b]
        arrow = getattr(col.dtype, "pyarrow_dtype", None)
        if col.dtype == object or (arrow is not None and pa.types.is_nested(arrow)):
            values = col.tolist()
            for n, v in enumerate(values):
                try:
                    hash(v)
                    if isinstance(v, str):
                        check_unicode(v, "it")
                except ValueError as exc:  # a lone surrogate: pandas cannot index it
                    bad.setdefault(n, f"its key {b!r} cannot be a group key: {exc}")
                    values[n] = None
                except Exception:  # noqa: BLE001 (unhashable, or a __hash__ that raises)
                    bad.setdefault(n, f"its key {b!r} holds a {type(v).__name__}, which cannot be a group key")
                    values[n] = None
            col = pd.Series(values, index=col.index, dtype=object, name=b)
        keys.append(col)
    return keys, bad


def _group_items(df: pd.DataFrame, spec: AggSpec, keys: list | None = None) -> list:
    """``(key, rows)`` per group of ``keys`` (default: :func:`_group_keys` of ``df``), nulls
    one group. Typed key columns group with pandas (sorted; categories in their order); a
    column of Python objects groups here, as pandas fails on some mixes of them (a huge int
    and a string), sorted where its keys sort together and else in order of first row."""
    if not spec.by:
        return [((), df)]
    keys = _group_keys(df, spec)[0] if keys is None else keys
    if all(k.dtype != object for k in keys):
        return list(df.groupby(keys, sort=True, dropna=False, observed=True))
    groups: dict[tuple, tuple[tuple, list[int]]] = {}
    for n, key in enumerate(zip(*(k.tolist() for k in keys))):
        key = tuple(None if is_null(v) else v for v in key)
        groups.setdefault(tuple(_NULL if v is None else v for v in key), (key, []))[1].append(n)
    items = list(groups.values())
    try:
        items = sorted(items, key=lambda item: tuple((1, 0) if v is None else (0, v) for v in item[0]))
    except Exception:  # noqa: BLE001 (keys that do not compare: a tuple and an int)
        pass
    return [(key, df.iloc[rows]) for key, rows in items]


_NULL = object()  # a null key, as a dict key


def _frame(keys: list[tuple], texts: list, errors: list, spec: AggSpec, meta: pd.DataFrame, final: bool):
    cols: dict = {}
    for n, b in enumerate(spec.by):
        cols[b] = pd.Series([k[n] for k in keys], dtype=meta[b].dtype)
    name = spec.output_column if final else _SUMMARY
    cols[name] = pd.Series(texts, dtype="string[pyarrow]" if final else object)
    cols[LLM_ERROR if final else _ERR] = pd.Series(errors, dtype="string[pyarrow]" if final else object)
    return pd.DataFrame(cols)


def agg_frame(df: pd.DataFrame, spec: AggSpec, cost: SemanticCost, final: bool = True) -> pd.DataFrame:
    """One row per group (of ``spec.by``; one row without): its keys, the summary and
    ``llm_error``. A row that cannot be summarised is left out and named in its group's error."""
    labels = list(df.index)
    work = df.reset_index(drop=True)  # row positions as the index: labels may repeat
    group_keys, bad_keys = _group_keys(work, spec)
    keys, groups, notes = [], [], []
    for key, g in _group_items(work, spec, group_keys):
        texts, errors = _records(g, spec, [labels[p] for p in g.index], [bad_keys.get(p) for p in g.index])
        keys.append(key if isinstance(key, tuple) else (key,))
        groups.append([t for t in texts if t is not None])
        notes.append([e for e in errors if e is not None])
    if not spec.by and not len(df):
        keys, groups, notes = [], [], []
    summaries, errors = reduce_groups(groups, spec, cost)
    if not final:  # a partial without rows: the final fold says so if no partial has any
        errors = [None if not g else e for g, e in zip(groups, errors)]
    return _frame(keys, summaries, _with_notes(errors, notes), spec, df.iloc[:0], final)


@dataclasses.dataclass(frozen=True)
class AggChunk:
    """A Dask reduction's chunk: a partition to one summary per group."""

    spec: AggSpec

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        return agg_frame(df, self.spec, SemanticCost(), final=False)


@dataclasses.dataclass(frozen=True)
class AggCombine:
    """A Dask reduction's combine (and, ``final``, aggregate): partial summaries folded per group."""

    spec: AggSpec
    final: bool = False

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        keys, groups, notes = [], [], []
        for key, g in _group_items(df, self.spec):
            if not len(g):
                continue
            keys.append(key if isinstance(key, tuple) else (key,))
            groups.append([s for s in g[_SUMMARY] if s is not None and not pd.isna(s)])
            notes.append([e for e in g[_ERR] if e is not None and not pd.isna(e)])
        texts: list = [g[0] if len(g) == 1 else None for g in groups]
        errors: list = [None if g else "agg: no rows to summarise" for g in groups]
        multi = [n for n, g in enumerate(groups) if len(g) > 1]
        if multi:
            folded, errs = reduce_groups([groups[n] for n in multi], self.spec, SemanticCost(), leaf=False)
            for n, t, e in zip(multi, folded, errs):
                texts[n], errors[n] = t, e
        return _frame(keys, texts, _with_notes(errors, notes), self.spec, df.iloc[:0], self.final)


def semantic_agg(
    frame: FrameAdapter,
    instruction: str,
    llm: LLMArgs,
    *,
    by,
    output_column: str,
    max_tokens: int,
    split_every: int,
    return_stats: bool,
):
    """``df.llm.agg``: see :meth:`SemanticFrameMethods.agg`."""
    from dfllm.models.bundled import DEFAULT_CHAT_MODEL

    columns = columns_of(frame, "agg")
    try:
        fields = instruction_fields(instruction)
    except ValueError as exc:
        raise ValueError(f"agg: {exc}") from None
    by_cols = (by,) if isinstance(by, str) else tuple(by or ())
    if LLM_ERROR in by_cols:
        raise ValueError(
            f"agg: by cannot name {LLM_ERROR!r} (the result's error column); group by a copy of it under another name"
        )
    missing = [f for f in [*fields, *by_cols] if f not in columns]
    if missing:
        raise ValueError(f"agg: column(s) {missing} not in the frame (columns: {columns})")
    if output_column in by_cols or output_column == LLM_ERROR:
        raise ValueError(f"agg: output_column {output_column!r} clashes with a key or llm_error")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"agg: max_tokens must be a positive integer, got {max_tokens!r}")
    if not isinstance(split_every, int) or split_every < 2:
        raise ValueError(f"agg: split_every must be an integer >= 2, got {split_every!r}")
    model_name = str(llm.model or DEFAULT_CHAT_MODEL)
    tasks, budgets = [], []
    for preamble, label in ((AGG_PREAMBLE, "records"), (FOLD_PREAMBLE, "partial summaries")):
        prompt = semantic_prompt(preamble, instruction, {label: _BODY}, chat=llm.chat)
        try:
            task = make_task(
                "chat" if llm.chat else "generate",
                (prompt.template,),
                [_BODY],
                output_column="__out",
                model=llm.model,
                sampling_params={"temperature": 0.0, "max_tokens": max_tokens},
                system=prompt.system,
                on_error=llm.on_error,
                engine_kwargs=llm.engine_kwargs,
                cache=llm.cache,
                model_check=frame.model_check(llm.resources),
            )
        except ValueError as exc:
            raise ValueError(f"agg: {exc}") from None
        tasks.append(task)
        tok = _tokenizer(model_name)
        if llm.chat and getattr(tok, "chat_template", None):
            msgs = ([{"role": "system", "content": prompt.system}] if prompt.system else []) + [
                {"role": "user", "content": prompt.template.format(**{_BODY: ""})}
            ]
            rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            n_fixed = len(tok.encode(rendered, add_special_tokens=False))
        else:
            n_fixed = len(tok.encode(prompt.text({_BODY: ""})))
        budget = _model_len(model_name, llm.engine_kwargs) - max_tokens - n_fixed - 8
        if budget < 16:
            raise ValueError(
                f"agg: max_model_len leaves {budget} tokens for records after the prompt's "
                f"{n_fixed} and max_tokens={max_tokens}; raise max_model_len or lower max_tokens"
            )
        budgets.append(budget)
    spec = AggSpec(
        tasks[0],
        tasks[1],
        tuple(fields),
        by_cols,
        model_name,
        budgets[0],
        budgets[1],
        output_column,
        split_every,
        operator_resources(frame, llm.resources),
    )
    if frame.kind == "dask":
        if return_stats:
            raise ValueError("agg: return_stats=True needs an eager frame (pandas or Polars)")
        meta = _frame([], [], [], spec, frame.empty(), True)
        return frame.obj.reduction(
            Placed(AggChunk(spec), spec.resources, "agg"),
            aggregate=Placed(AggCombine(spec, final=True), spec.resources, "agg"),
            combine=Placed(AggCombine(spec), spec.resources, "agg"),
            split_every=split_every,
            meta=meta,
        )
    cost = SemanticCost()
    result = frame.back(agg_frame(frame.to_pandas(), spec, cost))
    return (result, cost) if return_stats else result
