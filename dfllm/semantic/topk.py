"""``.llm.topk``: the k rows that best satisfy a criterion, by LLM pairwise comparisons.

Each comparison is one constrained decode ("which of A and B better satisfies ...", a
``choice`` of "A"/"B", greedy). A pair of rows is always asked in one orientation, the row
that comes first in the frame as A, and asked at most once per call, so the comparator is a
function of the pair (antisymmetric by construction) and identical judgments are computed
once. ``method="quick"`` (default) is a batched quickselect: every round compares each row
of every undecided block that reaches into the top k with that block's pivot, all in one
engine call, splits the block, and drops the blocks past k; it ends with the top k sorted.
``method="heap"`` keeps a k-heap (``heapq.nlargest``), one comparison per engine call.
On Dask each partition keeps its own top k (one task each) and one last task merges them.
User docs: docs/semantic.md.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import logging

import numpy as np
import pandas as pd

from dfllm.accessors.adapter import FrameAdapter
from dfllm.errors import shown
from dfllm.semantic.frames import check_output_names, earlier_errors
from dfllm.semantic.join import (
    Embedder,
    LLMArgs,
    PairJudge,
    Placed,
    SemanticCost,
    columns_of,
    make_embedder,
    make_judge,
    operator_resources,
    rename_columns,
)
from dfllm.semantic.prompts import instruction_fields, record_template, render_instruction
from dfllm.tasks.schema import LLM_ERROR
from dfllm.tasks.templates import field_text

logger = logging.getLogger("dfllm")

METHODS = ("quick", "heap")
AB = ("A", "B")
TOPK_PREAMBLE = (
    "You compare two records, A and B, by a criterion. The criterion names the records' fields in "
    "[brackets]; the two records follow it."
)
TOPK_ANSWER = "Which record better satisfies the criterion? Answer A or B."


@dataclasses.dataclass(frozen=True)
class TopKSpec:
    """A checked ``topk``: the comparator, the rows' fields, k, the method, and the optional
    embedder seeding the first pivot."""

    judge: PairJudge
    fields: tuple[str, ...]
    k: int
    method: str
    rank_column: str
    embedder: Embedder | None = None  # records' vectors (seeding)
    query_embedder: Embedder | None = None  # the criterion's vector (seeding)
    query: str = ""
    resources: dict | None = None
    both_orders: bool = False  # ask each pair both ways and compare the probabilities of A


def _label(df: pd.DataFrame, i: int):
    """Row ``i``'s index label, a numpy scalar as the Python value (for messages)."""
    label = df.index[i]
    return label.item() if isinstance(label, np.generic) else label


class _Comparator:
    """Memoised pair judgments over one frame: ``better(i, j)`` is whether row ``i`` beats
    row ``j``; the pair is asked with the earlier row as A. Failed pairs land in ``failed``;
    ``ok`` holds the rows that have had a comparison succeed (so a failure is not theirs alone)."""

    def __init__(self, df: pd.DataFrame, spec: TopKSpec, cost: SemanticCost):
        self.df, self.spec, self.cost = df, spec, cost
        self.memo: dict[tuple[int, int], bool] = {}
        self.failed: dict[tuple[int, int], str] = {}
        self.ok: set[int] = set()
        self.internal = [(f"__{side}_{f}", f) for side in "ab" for f in spec.fields]

    def ask(self, pairs: list[tuple[int, int]]) -> None:
        """Judge every pair not yet judged, in one engine call."""
        todo = list(dict.fromkeys((min(i, j), max(i, j)) for i, j in pairs))
        todo = [p for p in todo if p not in self.memo and p not in self.failed]
        if not todo:
            return
        asked = todo + [(j, i) for i, j in todo] if self.spec.both_orders else todo
        # each column as the frame holds it (object stays object: no inference of an Arrow
        # string column, which cannot hold every Python string)
        frame = pd.DataFrame(
            {
                f"__{side}_{f}": self.df[f].iloc[[p[n] for p in asked]].reset_index(drop=True)
                for n, side in enumerate("ab")
                for f in self.spec.fields
            }
        )
        answers, errors, first = self.spec.judge.judge(frame, self.cost)
        self.cost.count("comparisons", len(todo))
        n = len(todo)
        for k, p in enumerate(todo):
            if not self.spec.both_orders:
                err, wins = errors[k], answers[k] == AB[0]
            else:  # P(A | i shown first) against P(A | j shown first): the position's bias cancels
                missing = first[k] is None or first[n + k] is None
                err = errors[k] or errors[n + k] or ("no log-probabilities of A and B to compare" if missing else None)
                wins = not missing and first[k] >= first[n + k]
            if err is not None:
                self.failed[p] = rename_columns(str(err), self.internal)
            else:
                self.memo[p] = wins
                self.ok.update(p)

    def failure(self, i: int, j: int) -> str:
        """Row ``i``'s message for its failed comparison with row ``j``."""
        return (
            f"its comparison with the row of index {shown(_label(self.df, j))} failed: "
            f"{self.failed[(min(i, j), max(i, j))]}"
        )

    def better(self, i: int, j: int) -> bool | None:
        """Whether row ``i`` beats row ``j`` (None: the judgment failed)."""
        p = (min(i, j), max(i, j))
        if p in self.failed:
            return None
        first_wins = self.memo[p]
        return first_wins if i < j else not first_wins

    def blame(self, x: int, y: int, witnesses) -> list[int]:
        """The rows to hold responsible for the failed comparison of ``x`` and ``y``: the one
        that has never been compared successfully when the other has; else, when a third row
        (among ``witnesses``) compares with one of them and not with the other, that other;
        else both (their order cannot be known)."""
        if (x in self.ok) != (y in self.ok):
            return [y] if x in self.ok else [x]
        if x not in self.ok:
            z = next((w for w in witnesses if w not in (x, y)), None)
            if z is not None:
                self.ask([(x, z), (y, z)])
                fx, fy = self.better(x, z) is None, self.better(y, z) is None
                if fx != fy:
                    return [x] if fx else [y]
        return [x, y]


def quick_order(items: list[int], k: int, cmp: _Comparator, first_pivot: int | None = None) -> tuple[list, dict]:
    """The best ``k`` of ``items`` (positions), best first, by batched quickselect; and the rows
    whose comparison failed, with the message."""
    blocks: list[list[int]] = [list(items)] if items else []
    errors: dict[int, str] = {}
    first = True
    while True:
        kept, start = [], 0
        for b in blocks:
            if start >= k:
                break
            kept.append(b)
            start += len(b)
        blocks = kept
        pending = [n for n, b in enumerate(blocks) if len(b) > 1]
        if not pending:
            break
        pivots = {
            n: first_pivot if first and first_pivot in blocks[n] else blocks[n][len(blocks[n]) // 2] for n in pending
        }
        first = False
        cmp.ask([(x, pivots[n]) for n in pending for x in blocks[n] if x != pivots[n]])
        new: list[list[int]] = []
        for n, b in enumerate(blocks):
            if n not in pivots:
                new.append(b)
                continue
            p = pivots[n]
            others = [x for x in b if x != p]
            failed = [x for x in others if cmp.better(x, p) is None]
            if failed and len(failed) == len(others) and p not in cmp.ok:
                # the pivot compared with no row: with two rows or more, the pivot is the common
                # factor; with one, find out which of the two fails (a third row as witness)
                blamed = [p] if len(others) > 1 else cmp.blame(others[0], p, _witnesses(blocks, n, errors))
                for x in blamed:
                    errors[x] = cmp.failure(x, others[0] if x == p else p)
                rest = [x for x in b if x not in errors]
                if rest:
                    new.append(rest)  # re-pivoted next round
                continue
            better: list[int] = []
            worse: list[int] = []
            for x in others:
                verdict = cmp.better(x, p)
                if verdict is None:  # the pivot compared with other rows: the failure is x's
                    errors[x] = cmp.failure(x, p)
                else:
                    (better if verdict else worse).append(x)
            new.extend(part for part in (better, [p], worse) if part)
        blocks = new
    return [b[0] for b in blocks][:k], errors


def _witnesses(blocks: list[list[int]], n: int, errors: dict):
    """Rows of the other blocks (not in error), to compare a failed pair's rows with."""
    return (x for m, b in enumerate(blocks) if m != n for x in b if x not in errors)


class _Failed(Exception):
    def __init__(self, i: int, j: int):
        self.i, self.j = i, j


def heap_order(items: list[int], k: int, cmp: _Comparator) -> tuple[list, dict]:
    """The best ``k`` of ``items``, best first, by ``heapq.nlargest`` with one comparison per
    engine call; a failed comparison drops the row it is blamed on (:meth:`_Comparator.blame`;
    both when that cannot be known), with its error, and starts again."""
    errors: dict[int, str] = {}
    items = list(items)

    def less(x: int, y: int) -> int:  # -1 when x is worse than y
        cmp.ask([(x, y)])
        verdict = cmp.better(x, y)
        if verdict is None:
            raise _Failed(x, y)
        return -1 if not verdict else 1

    while True:
        try:
            return heapq.nlargest(k, items, key=functools.cmp_to_key(less)), errors
        except _Failed as exc:
            x, y = exc.i, exc.j
            for bad in cmp.blame(x, y, items):
                errors[bad] = cmp.failure(bad, y if bad == x else x)
            items = [z for z in items if z not in errors]


def row_errors(df: pd.DataFrame, spec: TopKSpec) -> dict[int, str]:
    """Row position -> why the row cannot be ranked, before any comparison: an earlier
    operator's ``llm_error``, or a field whose value the comparator's prompt cannot hold (a
    null, an empty text, invalid UTF-8 or a lone surrogate, a list, a dict...), checked as the
    prompt's template checks it and naming the frame's column. So a bad row is its own error
    and never reaches a comparison, where its failure would fall on the row it meets. With
    ``on_error="raise"`` the first such field raises ``ValueError`` naming the row."""
    errors: dict[int, str] = {}
    if LLM_ERROR in df.columns:
        errors = {i: e for i, e in enumerate(earlier_errors(df[LLM_ERROR])) if e is not None}
    raise_ = spec.judge.task.on_error == "raise"
    for f in spec.fields:
        what = f"column {shown(f)}"
        for i, value in enumerate(df[f].tolist()):
            if i in errors:
                continue
            try:
                field_text(value, what)  # a null too: "column 'x' is null"
            except (ValueError, TypeError) as exc:
                msg = str(exc) if what in str(exc) else f"{what}: {exc}"
                if raise_:
                    raise ValueError(f"topk: the row of index {shown(_label(df, i))}: {msg}") from None
                errors[i] = f"topk: {msg}"
    return errors


def topk_frame(df: pd.DataFrame, spec: TopKSpec, cost: SemanticCost, in_frame_order: bool = False) -> pd.DataFrame:
    """The top ``k`` rows of a pandas frame, best first, with their rank; then the rows that
    could not be ranked (a null field, a failed comparison, an error from an earlier stage),
    with a null rank and their ``llm_error``. The index is kept. ``in_frame_order`` keeps the
    top rows in the frame's order instead (a partition's candidates, so that the merge shows
    every pair in the orientation a single frame would)."""
    errors = row_errors(df, spec)
    items = [i for i in range(len(df)) if i not in errors]
    cmp = _Comparator(df, spec, cost)
    first_pivot = None
    if spec.embedder is not None and len(items) > 1 and spec.query_embedder is not None:
        vecs, verrs = spec.embedder(df.iloc[items], cost)
        qvec, _ = spec.query_embedder(pd.DataFrame({"__q": [spec.query]}), cost)
        sims = [(-float(vecs[n] @ qvec[0]) if verrs[n] is None else np.inf, i) for n, i in enumerate(items)]
        seeded = [i for _, i in sorted(sims)]
        first_pivot = seeded[min(spec.k, len(seeded) - 1)]
    if spec.method == "quick":
        order, failed = quick_order(items, spec.k, cmp, first_pivot)
    else:
        order, failed = heap_order(items, spec.k, cmp)
    for i, msg in failed.items():
        errors.setdefault(i, f"topk: the row could not be ranked: {msg}")
    err_rows = sorted(errors)
    rank_of = {i: r for r, i in enumerate(order, start=1)}
    if in_frame_order:
        order = sorted(order)
    out = df.iloc[order + err_rows].copy()
    ranks = [rank_of[i] for i in order] + [None] * len(err_rows)
    msgs = [None] * len(order) + [errors[i] for i in err_rows]
    out = out.drop(columns=[spec.rank_column, LLM_ERROR], errors="ignore")
    out[spec.rank_column] = pd.Series(ranks, index=out.index, dtype="int64[pyarrow]")
    out[LLM_ERROR] = pd.Series(msgs, index=out.index, dtype="string[pyarrow]")
    if len(df):
        logger.info(
            "topk: %d comparisons in %d engine calls for %d rows (k=%d, %s)",
            cost.counts.get("comparisons", 0),
            cost.engine_calls,
            len(df),
            spec.k,
            spec.method,
        )
    return out


@dataclasses.dataclass(frozen=True)
class TopKPartition:
    """``topk_frame`` of one partition: a Dask task (the partition-local candidates, and the merge)."""

    spec: TopKSpec
    in_frame_order: bool = False

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        return topk_frame(df, self.spec, SemanticCost(), self.in_frame_order)


def semantic_topk(
    frame: FrameAdapter,
    instruction: str,
    k: int,
    llm: LLMArgs,
    *,
    method: str,
    rank_column: str,
    seed_embeddings: bool,
    embed_model,
    return_stats: bool,
    both_orders: bool = False,
    logprobs: int = 20,
):
    """``df.llm.topk``: see :meth:`SemanticFrameMethods.topk`."""
    columns = columns_of(frame, "topk")
    try:
        fields = instruction_fields(instruction)
    except ValueError as exc:
        raise ValueError(f"topk: {exc}") from None
    missing = [f for f in fields if f not in columns]
    if missing:
        raise ValueError(f"topk: the instruction names column(s) {missing} not in the frame (columns: {columns})")
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise ValueError(f"topk: k must be a positive integer, got {shown(k)}")
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not (logprobs == -1 or logprobs >= 2):
        raise ValueError(f"topk: logprobs must be -1 (every token) or at least 2, got {shown(logprobs)}")
    if method not in METHODS:
        raise ValueError(f"topk: method must be one of {METHODS}, got {shown(method)}")
    check_output_names("topk", [rank_column])
    if rank_column in columns:
        raise ValueError(f"topk: the frame already has a column {rank_column!r}; pass another rank_column=")
    record = {f"{side}.{f}": f"__{side.lower()}_{f}" for side in AB for f in fields}
    judge = make_judge(
        frame,
        list(record.values()),
        instruction,
        TOPK_PREAMBLE,
        llm,
        answer=TOPK_ANSWER,
        choices=AB,
        names=None,
        what="topk",
        record=record,
        logprobs=logprobs if both_orders else None,
    )
    embedder = query = None
    if seed_embeddings:
        embedder = make_embedder(
            frame,
            record_template(fields),
            fields,
            model=embed_model,
            resources=llm.resources,
            what="topk",
        )
        query = make_embedder(frame, "{__q}", ["__q"], model=embed_model, resources=llm.resources, what="topk")
    spec = TopKSpec(
        judge,
        tuple(fields),
        int(k),
        method,
        rank_column,
        embedder,
        query,
        render_instruction(instruction),
        operator_resources(frame, llm.resources),
        bool(both_orders),
    )
    obj = frame.obj
    if frame.kind == "dask":
        if return_stats:
            raise ValueError(
                "topk: return_stats=True needs an eager frame (pandas or Polars); on Dask each task "
                "logs its comparisons"
            )
        meta = topk_frame(frame.empty(), spec, SemanticCost())
        if obj.npartitions == 1:
            return obj.map_partitions(Placed(TopKPartition(spec), spec.resources, "topk"), meta=meta)
        local = obj.map_partitions(Placed(TopKPartition(spec, in_frame_order=True), spec.resources, "topk"), meta=meta)
        return local.repartition(npartitions=1).map_partitions(
            Placed(TopKPartition(spec), spec.resources, "topk"), meta=meta
        )
    cost = SemanticCost()
    result = frame.back(topk_frame(frame.to_pandas(), spec, cost))
    return (result, cost) if return_stats else result
