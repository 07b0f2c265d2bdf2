"""``.llm.dedup``: near-duplicate clusters by embeddings, optionally confirmed by an LLM.

Every row's text is embedded once (the ``.llm`` embed task); the pairs whose cosine
similarity is at least ``threshold`` are candidate duplicates; with ``confirm`` each candidate
pair is judged by the model (one constrained True/False decode, in one engine call) and only
confirmed pairs link rows. Clusters are the connected components of the links (union-find).
Every row is kept: ``cluster_id`` is the row number (0-based, in the frame's order) of the
cluster's first row, which is its representative (``is_representative``). On Dask the rows
are embedded one task per partition, clustered in one task (the vectors only), and the
labels go back to each partition (one task each). User docs: docs/semantic.md.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pandas as pd

from dfllm.accessors.adapter import FrameAdapter
from dfllm.accessors.arrow_schema import join_errors
from dfllm.errors import shown
from dfllm.semantic.frames import check_output_names, earlier_errors
from dfllm.semantic.join import (
    TRUE_FALSE,
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
    stack_vectors,
)
from dfllm.tasks.schema import LLM_ERROR

logger = logging.getLogger("dfllm")

DEDUP_PREAMBLE = (
    "You judge whether two records, A and B, are near-duplicates. The statement to judge comes first; "
    "the two records follow it."
)
DEFAULT_CONFIRM = "The two records are near-duplicates: they say the same thing, perhaps in other words."
_EMB, _ERR, _PART, _POS = "__dfllm_embedding__", "__dfllm_error__", "__dfllm_part__", "__dfllm_pos__"


@dataclasses.dataclass(frozen=True)
class DedupSpec:
    column: str
    threshold: float
    embedder: Embedder
    judge: PairJudge | None
    cluster_column: str
    representative_column: str
    resources: dict | None = None
    images: bool = False  # the column holds images (embedded by an image-text model)


class UnionFind:
    """Disjoint sets over ``0..n-1``; each set's root is its smallest member."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def candidate_links(vecs: np.ndarray, ok: np.ndarray, threshold: float, block: int = 1024) -> list[tuple[int, int]]:
    """Pairs ``(i, j)``, ``i < j``, of usable rows whose cosine similarity is ``>= threshold``
    (computed ``block`` rows at a time, so memory grows with the rows, not their square)."""
    idx = np.flatnonzero(ok)
    links: list[tuple[int, int]] = []
    for start in range(0, len(idx), block):
        rows = idx[start : start + block]
        sims = vecs[rows] @ vecs[idx[start:]].T  # this block against itself and every later row
        a, b = np.nonzero(np.triu(sims >= threshold, k=1))
        links += [(int(rows[i]), int(idx[start + j])) for i, j in zip(a, b)]
    return sorted(links)


def cluster(
    vecs: np.ndarray, errors: list, texts: list, spec: DedupSpec, cost: SemanticCost, labels: list | None = None
) -> tuple[list, list]:
    """Each row's cluster id (None where it failed) and error, for rows in frame order
    (``labels``: the rows' index labels, for messages)."""
    labels = labels if labels is not None else list(range(len(errors)))
    ok = np.array([e is None for e in errors], dtype=bool)
    links = candidate_links(vecs, ok, spec.threshold)
    cost.count("candidate_pairs", len(links))
    errors = list(errors)
    if spec.judge is not None and links:
        frame = pd.DataFrame({"__a_text": [texts[i] for i, _ in links], "__b_text": [texts[j] for _, j in links]})
        answers, errs = spec.judge(frame, cost)
        cost.count("pairs_judged", len(links))
        kept = []
        for (i, j), ans, err in zip(links, answers, errs):
            if err is not None:  # reported on both rows, never treated as "not a duplicate" silently
                for x, y in ((i, j), (j, i)):
                    note = f"dedup: the pair with the row of index {shown(labels[y])} could not be judged: {err}"
                    errors[x] = note if errors[x] is None else f"{errors[x]}; {note}"
            elif ans == TRUE_FALSE[0]:
                kept.append((i, j))
        links = kept
    uf = UnionFind(len(errors))
    for i, j in links:
        uf.union(i, j)
    ids = [uf.find(i) if ok[i] else None for i in range(len(errors))]
    return ids, errors


def _vectors(df: pd.DataFrame) -> np.ndarray:
    return stack_vectors(df[_EMB].tolist())


def _embed(df: pd.DataFrame, spec: DedupSpec, cost: SemanticCost) -> tuple[np.ndarray, list]:
    # the values as they are (an object column: pandas would make a column of strings Arrow
    # text, which a lone surrogate cannot enter), each checked by the embedder as its row's
    texts = pd.DataFrame({"__text": pd.Series(df[spec.column].to_numpy(dtype=object), dtype=object)})
    vecs, errors = spec.embedder(texts, cost)
    errors = [None if e is None else f"dedup: {rename_columns(e, [('__text', spec.column)])}" for e in errors]
    if LLM_ERROR in df.columns:  # an earlier step's, kept in front (its row is not clustered)
        return vecs, [join_errors(p, e) for p, e in zip(earlier_errors(df[LLM_ERROR]), errors)]
    return vecs, errors


def _representatives(ids: list) -> list:
    """Whether each row is its cluster's first (None where it has no cluster)."""
    return [None if c is None else c == n for n, c in enumerate(ids)]


def _labelled(df: pd.DataFrame, ids: list, reps: list, errors: list, spec: DedupSpec) -> pd.DataFrame:
    """``df`` with its rows' cluster ids, representative flags and errors."""
    out = df.drop(columns=[LLM_ERROR], errors="ignore").copy()
    out[spec.cluster_column] = pd.Series(ids, index=df.index, dtype="int64[pyarrow]")
    out[spec.representative_column] = pd.Series(reps, index=df.index, dtype="bool[pyarrow]")
    out[LLM_ERROR] = pd.Series(errors, index=df.index, dtype="string[pyarrow]")
    return out


def dedup_frame(df: pd.DataFrame, spec: DedupSpec, cost: SemanticCost) -> pd.DataFrame:
    """A pandas frame with its rows' cluster ids, representative flags and errors."""
    vecs, errors = _embed(df, spec, cost)
    ids, errors = cluster(vecs, errors, df[spec.column].astype(object).tolist(), spec, cost, list(df.index))
    if len(df):
        logger.info(
            "dedup: %d rows, %d candidate pairs, %d clusters",
            len(df),
            cost.counts.get("candidate_pairs", 0),
            len({c for c in ids if c is not None}),
        )
    return _labelled(df, ids, _representatives(ids), errors, spec)


@dataclasses.dataclass(frozen=True)
class EmbedRows:
    """Stage 1 on Dask: a partition's vectors, errors, texts and partition number."""

    spec: DedupSpec

    def __call__(self, df: pd.DataFrame, partition_info=None) -> pd.DataFrame:
        vecs, errors = _embed(df, self.spec, SemanticCost())
        number = 0 if partition_info is None else partition_info["number"]
        return pd.DataFrame(
            {
                _EMB: list(vecs) if len(df) else pd.Series([], dtype=object),
                _ERR: pd.Series(errors, dtype=object),
                "__text": [None] * len(df)
                if self.spec.images  # the images stay here
                else df[self.spec.column].astype(object).to_numpy(),
                _PART: pd.Series([number] * len(df), dtype="int64"),
                _POS: pd.Series(range(len(df)), dtype="int64"),
                "__label": pd.Series(list(df.index), dtype=object),
            }
        )


@dataclasses.dataclass(frozen=True)
class ClusterAll:
    """Stage 2 on Dask: every row's vector in one frame, clustered."""

    spec: DedupSpec

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        df = df.sort_values([_PART, _POS], kind="stable").reset_index(drop=True)
        ids, errors = cluster(
            _vectors(df), list(df[_ERR]), df["__text"].tolist(), self.spec, SemanticCost(), list(df["__label"])
        )
        return pd.DataFrame(
            {
                _PART: df[_PART],
                _POS: df[_POS],
                "__cluster": pd.Series(ids, dtype="Int64"),
                "__rep": pd.Series(_representatives(ids), dtype="boolean"),
                _ERR: pd.Series(errors, dtype=object),
            }
        )


@dataclasses.dataclass(frozen=True)
class Attach:
    """Stage 3 on Dask: a partition with its rows' labels from stage 2."""

    spec: DedupSpec

    def __call__(self, df: pd.DataFrame, labels: pd.DataFrame, partition_info=None) -> pd.DataFrame:
        number = 0 if partition_info is None else partition_info["number"]
        mine = labels[labels[_PART] == number].sort_values(_POS)
        if len(mine) != len(df):
            raise RuntimeError(f"dedup: partition {number} has {len(df)} rows but {len(mine)} labels")
        ids = [None if pd.isna(c) else int(c) for c in mine["__cluster"]]
        reps = [None if pd.isna(r) else bool(r) for r in mine["__rep"]]
        return _labelled(df, ids, reps, list(mine[_ERR]), self.spec)


def semantic_dedup(
    frame: FrameAdapter,
    column: str,
    llm: LLMArgs,
    *,
    threshold: float,
    confirm,
    embed_model,
    cluster_column: str,
    representative_column: str,
    return_stats: bool,
    images: bool = False,
):
    """``df.llm.dedup``: see :meth:`SemanticFrameMethods.dedup`."""
    columns = columns_of(frame, "dedup")
    if column not in columns:
        raise ValueError(f"dedup: column {shown(column)} is not in the frame (columns: {columns})")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1 <= threshold <= 1:
        raise ValueError(f"dedup: threshold must be a cosine similarity in [-1, 1], got {shown(threshold)}")
    check_output_names("dedup", (cluster_column, representative_column))
    for name in (cluster_column, representative_column):
        if name in columns:
            raise ValueError(f"dedup: the frame already has a column {name!r}; choose another name")
    if cluster_column == representative_column:
        raise ValueError("dedup: cluster_column and representative_column must differ")
    if not isinstance(images, (bool, np.bool_)):
        raise ValueError(f"dedup: images must be True or False, got {shown(images)}")
    if images and confirm:
        raise ValueError(
            "dedup: confirm= has a language model judge each pair's texts; with images=True the "
            "clusters come from the image embeddings alone (leave confirm off)"
        )
    embedder = make_embedder(
        frame,
        "{__text}",
        ["__text"],
        model=embed_model,
        resources=llm.resources,
        what="dedup",
        images="images=True" if images else None,
    )
    judge = None
    if confirm:
        statement = DEFAULT_CONFIRM if confirm is True else confirm
        if not isinstance(statement, str):
            raise ValueError(f"dedup: confirm is True or a statement about records A and B, got {shown(confirm)}")
        judge = make_judge(
            frame,
            ["__a_text", "__b_text"],
            statement.replace("{", "{{").replace("}", "}}"),
            DEDUP_PREAMBLE,
            llm,
            answer="Does the statement hold for A and B? Answer True or False.",
            choices=TRUE_FALSE,
            names=None,
            what="dedup",
            record={"A": "__a_text", "B": "__b_text"},
        )
    spec = DedupSpec(
        column,
        float(threshold),
        embedder,
        judge,
        cluster_column,
        representative_column,
        operator_resources(frame, llm.resources),
        bool(images),
    )
    if frame.kind == "dask":
        if return_stats:
            raise ValueError("dedup: return_stats=True needs an eager frame (pandas or Polars)")
        obj, empty = frame.obj, frame.empty()
        meta = _labelled(empty, [], [], [], spec)
        stage1 = obj.map_partitions(Placed(EmbedRows(spec), spec.resources, "embed"), meta=EmbedRows(spec)(empty))
        labels = stage1.repartition(npartitions=1).map_partitions(
            Placed(ClusterAll(spec), spec.resources, "dedup"), meta=ClusterAll(spec)(stage1._meta)
        )
        return obj.map_partitions(Attach(spec), labels, meta=meta, align_dataframes=False)
    cost = SemanticCost()
    result = frame.back(dedup_frame(frame.to_pandas(), spec, cost))
    return (result, cost) if return_stats else result
