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
)
from dfllm.semantic.prompts import instruction_fields, record_template, render_instruction
from dfllm.tasks.schema import LLM_ERROR

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


class _Comparator:
    """Memoised pair judgments over one frame: ``better(i, j)`` is whether row ``i`` beats
    row ``j``; the pair is asked with the earlier row as A. Failed pairs land in ``failed``."""

    def __init__(self, df: pd.DataFrame, spec: TopKSpec, cost: SemanticCost):
        self.df, self.spec, self.cost = df, spec, cost
        self.memo: dict[tuple[int, int], bool] = {}
        self.failed: dict[tuple[int, int], str] = {}

    def ask(self, pairs: list[tuple[int, int]]) -> None:
        """Judge every pair not yet judged, in one engine call."""
        todo = list(dict.fromkeys((min(i, j), max(i, j)) for i, j in pairs))
        todo = [p for p in todo if p not in self.memo and p not in self.failed]
        if not todo:
            return
        asked = todo + [(j, i) for i, j in todo] if self.spec.both_orders else todo
        sides = {side: self.df.iloc[[p[n] for p in asked]] for n, side in enumerate("ab")}
        frame = pd.DataFrame(
            {f"__{side}_{f}": rows[f].to_numpy() for side, rows in sides.items() for f in self.spec.fields}
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
                self.failed[p] = err
            else:
                self.memo[p] = wins

    def failure(self, i: int, j: int) -> str:
        """Row ``i``'s message for its failed comparison with row ``j``."""
        return (
            f"its comparison with the row of index {self.df.index[j]!r} failed: {self.failed[(min(i, j), max(i, j))]}"
        )

    def better(self, i: int, j: int) -> bool | None:
        """Whether row ``i`` beats row ``j`` (None: the judgment failed)."""
        p = (min(i, j), max(i, j))
        if p in self.failed:
            return None
        first_wins = self.memo[p]
        return first_wins if i < j else not first_wins


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
            better: list[int] = []
            worse: list[int] = []
            for x in b:
                if x == p:
                    continue
                verdict = cmp.better(x, p)
                if verdict is None:
                    errors[x] = cmp.failure(x, p)
                else:
                    (better if verdict else worse).append(x)
            new.extend(part for part in (better, [p], worse) if part)
        blocks = new
    return [b[0] for b in blocks][:k], errors


class _Failed(Exception):
    def __init__(self, i: int, j: int):
        self.i, self.j = i, j


def heap_order(items: list[int], k: int, cmp: _Comparator) -> tuple[list, dict]:
    """The best ``k`` of ``items``, best first, by ``heapq.nlargest`` with one comparison per
    engine call; a failed comparison drops both rows (their errors) and starts again."""
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
            for x, y in ((exc.i, exc.j), (exc.j, exc.i)):
                errors[x] = cmp.failure(x, y)
            items = [x for x in items if x not in errors]


def topk_frame(df: pd.DataFrame, spec: TopKSpec, cost: SemanticCost, in_frame_order: bool = False) -> pd.DataFrame:
    """The top ``k`` rows of a pandas frame, best first, with their rank; then the rows that
    could not be ranked (a null field, a failed comparison, an error from an earlier stage),
    with a null rank and their ``llm_error``. The index is kept. ``in_frame_order`` keeps the
    top rows in the frame's order instead (a partition's candidates, so that the merge shows
    every pair in the orientation a single frame would)."""
    prior = df[LLM_ERROR].tolist() if LLM_ERROR in df.columns else []
    errors: dict[int, str] = {i: e for i, e in enumerate(prior) if not pd.isna(e)}
    for f in spec.fields:
        for i in np.flatnonzero(df[f].isna().to_numpy()):
            errors.setdefault(int(i), f"topk: the field {f!r} is null")
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
    columns = columns_of(frame)
    try:
        fields = instruction_fields(instruction)
    except ValueError as exc:
        raise ValueError(f"topk: {exc}") from None
    missing = [f for f in fields if f not in columns]
    if missing:
        raise ValueError(f"topk: the instruction names column(s) {missing} not in the frame (columns: {columns})")
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise ValueError(f"topk: k must be a positive integer, got {k!r}")
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not (logprobs == -1 or logprobs >= 2):
        raise ValueError(f"topk: logprobs must be -1 (every token) or at least 2, got {logprobs!r}")
    if method not in METHODS:
        raise ValueError(f"topk: method must be one of {METHODS}, got {method!r}")
    if rank_column in columns and rank_column != LLM_ERROR:
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
