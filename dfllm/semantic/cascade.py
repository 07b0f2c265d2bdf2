"""Cascades (``cascade=`` of ``.llm.judge`` and ``.llm.filter``): a cheap proxy decides the
rows it is confident about, the large model only the others, with recall and precision
targets that hold with a stated probability (LOTUS's cascade, after SUPG).

1. The proxy scores every row: a smaller model's probability that the statement holds (the
   same judgment, ``proxy="model"``), or the similarity of the row's fields to the
   instruction (``proxy="embedding"``, rescaled to [0, 1]).
2. A sample of rows is drawn with replacement, row ``i`` with probability
   ``w_i = a * sqrt(s_i) / sum(sqrt(s)) + (1 - a) / n`` (importance sampling: likely
   positives are over-represented, ``a = importance_weight``), and the large model (the
   oracle) judges it. Each draw carries the correction ``(1 / n) / w_i``, so that
   importance-weighted means over the sample estimate means over all rows.
3. Two thresholds are learned on the sample: rows scoring at most ``tau_neg`` are judged
   false by the proxy, at least ``tau_pos`` true, and those between go to the oracle (as do
   rows the proxy failed on). Relative to judging every row with the oracle, recall is
   ``A / (A + FN)`` (``A``: positives above ``tau_neg``, ``FN``: positives at or below it)
   and precision ``A / (A + FP)`` (``FP``: negatives at or above ``tau_pos``). ``tau_neg``
   is the highest candidate whose recall lower bound meets ``recall_target``, then
   ``tau_pos`` the lowest above it whose precision lower bound meets ``precision_target``.
   Each lower bound is the importance-weighted ratio estimate minus ``z`` of its standard
   errors (the delta method's normal approximation), with one pseudo-draw counted as a miss
   so that a sample without misses does not claim there are none; ``z`` is the one-sided
   normal quantile of ``failure_probability / 2`` (one half per target), so that both
   targets hold together with probability about ``1 - failure_probability``. The guarantee
   is the normal approximation's, and the thresholds are picked among many candidates:
   tests/semantic/test_semantic_cascade.py measures the rate at which the targets are met over
   repeated runs (above the stated rate).
4. Sampled rows keep the oracle's verdicts; the others get the proxy's or the oracle's.

Figures: :class:`CascadeStats` (``return_stats=True``; pandas results carry it as a dict in
``df.attrs["dfllm_cascade"]``; each cascade logs it at INFO). On Dask the proxy's pass and
the sample's oracle pass are computed when the call is made (the proxy's output is
persisted on the cluster), since the thresholds depend on them; the oracle's pass over the
uncertain band stays lazy. A Polars LazyFrame is collected for the same reason.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import pandas as pd

from dfllm.accessors.adapter import FrameAdapter
from dfllm.semantic.filter import BOOL, Judgment, judge_step
from dfllm.semantic.frames import SemanticFunction, make_llm_task, merge_errors, run_step, shadowed
from dfllm.semantic.prompts import instruction_fields, record_template, render_instruction
from dfllm.tasks.schema import FLOAT, LLM_ERROR, STRING

logger = logging.getLogger("dfllm")

POS = "__dfllm_cascade_pos__"  # each row's position in the frame
SCORE = "__dfllm_cascade_score__"  # the proxy's score: the probability that the statement holds
PRIOR = "__dfllm_cascade_prior_error__"  # the input's own llm_error, while the cascade runs
PROXY_VERDICT, PROXY_PROB = "__dfllm_proxy_verdict__", "__dfllm_proxy_probability__"
EMBEDDING = "__dfllm_proxy_embedding__"
SOURCE = "decided_by"  # which model decided a row: "proxy" or "model"
PROXIES = ("model", "embedding")


@dataclass(frozen=True)
class Cascade:
    """How a cascade decides (``cascade=`` of ``.llm.judge`` and ``.llm.filter``).

    - ``proxy``: ``"model"`` (``proxy_model``'s probability for the same judgment; required)
      or ``"embedding"`` (the similarity of the row's fields to the instruction, embedded
      by ``proxy_model``, default the bundled all-MiniLM-L6-v2);
    - ``recall_target``, ``precision_target``: relative to the large model judging every
      row; both hold together with probability at least ``1 - failure_probability``;
    - ``sample_fraction`` of the rows (at least ``min_sample``, at most all) are drawn for
      the large model to learn the thresholds on; ``importance_weight`` in [0, 1] is the
      share of the sampling that follows the proxy's scores; ``seed`` fixes the draw;
    - ``proxy_kwargs``: engine arguments of the proxy model."""

    proxy: str = "model"
    proxy_model: str | None = None
    recall_target: float = 0.9
    precision_target: float = 0.9
    failure_probability: float = 0.2
    sample_fraction: float = 0.1
    min_sample: int = 50
    importance_weight: float = 0.5
    seed: int = 0
    proxy_kwargs: tuple = ()

    def __post_init__(self):
        if self.proxy not in PROXIES:
            raise ValueError(f"Cascade: proxy must be one of {PROXIES}, got {self.proxy!r}")
        if self.proxy == "model" and not self.proxy_model:
            raise ValueError("Cascade: proxy='model' needs proxy_model= (a smaller generative model)")
        for name in ("recall_target", "precision_target"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"Cascade: {name} must be in (0, 1], got {v!r}")
        if not 0 < self.failure_probability < 1:
            raise ValueError(f"Cascade: failure_probability must be in (0, 1), got {self.failure_probability!r}")
        if not 0 < self.sample_fraction <= 1 or not isinstance(self.min_sample, int) or self.min_sample < 1:
            raise ValueError("Cascade: sample_fraction must be in (0, 1] and min_sample a positive int")
        if not 0 <= self.importance_weight <= 1:
            raise ValueError(f"Cascade: importance_weight must be in [0, 1], got {self.importance_weight!r}")
        if isinstance(self.proxy_kwargs, dict):
            object.__setattr__(self, "proxy_kwargs", tuple(sorted(self.proxy_kwargs.items())))


@dataclass(frozen=True)
class CascadeStats:
    """What a cascade did. ``large_model_rows`` were judged by the large model (the sample's
    distinct rows and the uncertain band), ``large_model_share`` of ``rows``;
    ``estimated_recall``/``estimated_precision`` are the sample's importance-weighted
    estimates at the thresholds and ``recall_bound``/``precision_bound`` their lower
    confidence bounds (each holds with probability ``1 - failure_probability``, both
    together)."""

    rows: int
    sample_draws: int
    sampled_rows: int
    band_rows: int
    large_model_rows: int
    large_model_share: float
    tau_neg: float
    tau_pos: float
    estimated_recall: float
    estimated_precision: float
    recall_bound: float
    precision_bound: float
    recall_target: float
    precision_target: float
    failure_probability: float
    proxy: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- the statistics -----------------------------------------------------------------------------------
def importance_sample(
    scores: np.ndarray, size: int, weight: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(draws, corrections)``: ``size`` positions drawn with replacement, position ``i``
    with probability ``weight * sqrt(s_i) / sum(sqrt(s)) + (1 - weight) / n`` (a missing
    score counts as 0.5), and each draw's correction ``(1 / n) / w_i``."""
    n = len(scores)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    s = np.clip(np.nan_to_num(np.asarray(scores, dtype=float), nan=0.5), 0.0, 1.0)
    root = np.sqrt(s)
    total = root.sum()
    w = (1 - weight) / n + (weight * root / total if total > 0 else np.full(n, weight / n))
    w = w / w.sum()
    draws = rng.choice(n, size=size, p=w)
    return draws, (1.0 / n) / w[draws]


def _z(delta: float) -> float:
    """The one-sided standard normal quantile: P(Z > z) = delta."""
    return NormalDist().inv_cdf(1 - delta)


def ratio_bound(num: np.ndarray, other: np.ndarray, z: float, pseudo: float) -> tuple[float, float]:
    """``(estimate, lower bound)`` of ``sum(num) / sum(num + other)`` from the draws' values
    (importance-weighted), the bound by the delta method's normal approximation, with one
    pseudo-draw of ``pseudo`` added to ``other`` (so that a sample without a miss does not
    claim that there is none)."""
    num, other = np.append(num, 0.0), np.append(other, pseudo)
    total = num + other
    if total.sum() <= 0:
        return 1.0, 0.0
    est = float(num.sum() / total.sum())
    influence = (num - est * total) / total.mean()
    return float(num[:-1].sum() / total[:-1].sum()) if total[:-1].sum() > 0 else 1.0, est - z * float(
        influence.std()
    ) / math.sqrt(len(num))


def learn_thresholds(
    scores: np.ndarray,
    labels: np.ndarray,
    corrections: np.ndarray,
    recall_target: float,
    precision_target: float,
    failure_probability: float,
) -> dict:
    """The thresholds ``tau_neg < tau_pos`` from the sample's draws (their proxy scores,
    the oracle's labels and the corrections; NaN scores are always the oracle's), and the
    estimates and bounds at them (see the module's docstring)."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=bool)
    c = np.asarray(corrections, dtype=float)
    z = _z(failure_probability / 2)
    pseudo = float(c.mean()) if len(c) else 1.0
    known = ~np.isnan(s)
    candidates = np.unique(s[known])

    def recall(tau_neg: float) -> tuple[float, float]:
        below = known & (s <= tau_neg)
        return ratio_bound(c * (y & ~below), c * (y & below), z, pseudo)

    def precision(tau_neg: float, tau_pos: float) -> tuple[float, float]:
        below, above = known & (s <= tau_neg), known & (s >= tau_pos)
        return ratio_bound(c * (y & ~below), c * (~y & above), z, pseudo)

    tau_neg = -math.inf
    for t in candidates:  # recall falls as tau_neg rises: the highest one that meets the target
        if recall(t)[1] >= recall_target:
            tau_neg = float(t)
        else:
            break
    tau_pos = math.inf
    for t in candidates[candidates > tau_neg][::-1]:  # precision falls as tau_pos falls: the lowest one
        if precision(tau_neg, t)[1] >= precision_target:
            tau_pos = float(t)
        else:
            break
    est_r, bound_r = recall(tau_neg)
    est_p, bound_p = precision(tau_neg, tau_pos)
    return {
        "tau_neg": tau_neg,
        "tau_pos": tau_pos,
        "estimated_recall": est_r,
        "recall_bound": bound_r,
        "estimated_precision": est_p,
        "precision_bound": bound_p,
    }


def sample_size(rows: int, cascade: Cascade) -> int:
    """The number of draws for ``rows`` rows."""
    return min(rows, max(cascade.min_sample, math.ceil(cascade.sample_fraction * rows))) if rows else 0


def run_cascade(
    scores: np.ndarray, oracle: Callable[[np.ndarray], np.ndarray], cascade: Cascade
) -> tuple[np.ndarray, np.ndarray, np.ndarray, CascadeStats]:
    """A cascade over ``scores`` (the proxy's probability that each row is positive; NaN:
    none), ``oracle(positions)`` giving the large model's labels of those rows (bool; NaN for
    a row it failed on). Returns ``(sampled, band, decisions, stats)``: the distinct sampled
    positions, the band's positions (not sampled, between the thresholds or unscored) and
    the proxy's decisions (bool per row: ``score >= tau_pos``; only meaningful outside the
    band and the sample). The oracle is called on the sample only: the caller judges the band."""
    n = len(scores)
    rng = np.random.default_rng(cascade.seed)
    draws, corrections = importance_sample(scores, sample_size(n, cascade), cascade.importance_weight, rng)
    sampled = np.unique(draws)
    labels = dict(zip(sampled.tolist(), np.asarray(oracle(sampled), dtype=float).tolist(), strict=True))
    drawn = np.array([labels[d] for d in draws.tolist()], dtype=float)
    ok = ~np.isnan(drawn)  # draws of rows the oracle failed on teach nothing
    learned = learn_thresholds(
        np.asarray(scores, dtype=float)[draws[ok]],
        drawn[ok] > 0.5,
        corrections[ok],
        cascade.recall_target,
        cascade.precision_target,
        cascade.failure_probability,
    )
    s = np.asarray(scores, dtype=float)
    in_sample = np.zeros(n, dtype=bool)
    in_sample[sampled] = True
    uncertain = np.isnan(s) | ((s > learned["tau_neg"]) & (s < learned["tau_pos"]))
    band = np.flatnonzero(uncertain & ~in_sample)
    large = len(sampled) + len(band)
    stats = CascadeStats(
        n,
        len(draws),
        len(sampled),
        len(band),
        large,
        large / n if n else 0.0,
        recall_target=cascade.recall_target,
        precision_target=cascade.precision_target,
        failure_probability=cascade.failure_probability,
        proxy=cascade.proxy,
        **learned,
    )
    return sampled, band, np.nan_to_num(s, nan=0.0) >= learned["tau_pos"], stats


# ---- on dataframes --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EmbeddingScore:
    """The proxy score of an embedding: its cosine similarity to the instruction's, in [0, 1]."""

    query: tuple[float, ...]

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        q = np.asarray(self.query, dtype=float)
        q = q / (np.linalg.norm(q) or 1.0)
        scores: list[float | None] = []
        for v in df[EMBEDDING].tolist():
            if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
                scores.append(None)
                continue
            v = np.asarray(v, dtype=float)
            scores.append(float((1 + v @ q / (np.linalg.norm(v) or 1.0)) / 2))
        out = df.drop(columns=[EMBEDDING])
        errors = out.pop(LLM_ERROR)
        out[SCORE] = pd.Series(scores, index=df.index, dtype=FLOAT)
        out[PROXY_VERDICT] = pd.Series([None] * len(df), index=df.index, dtype=BOOL)
        out[LLM_ERROR] = errors
        return out


@dataclass(frozen=True)
class ModelScore:
    """The proxy score of a smaller model's judgment: the probability that the statement holds."""

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        verdict, prob = df.pop(PROXY_VERDICT), df.pop(PROXY_PROB)
        v = verdict.astype(object).to_numpy()
        p = prob.astype(float).to_numpy()
        score = [
            None if vi is None or vi is pd.NA or np.isnan(pi) else (pi if vi else 1 - pi)
            for vi, pi in zip(v, p, strict=True)
        ]
        errors = df.pop(LLM_ERROR)
        df[SCORE] = pd.Series(score, index=df.index, dtype=FLOAT)
        df[PROXY_VERDICT] = verdict
        df[LLM_ERROR] = errors
        return df


@dataclass(frozen=True)
class Chain:
    """Two pandas steps, one after the other (a proxy's judgment, then its score)."""

    first: Callable
    second: Callable

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        return self.second(self.first(df))


def proxy_step(
    frame: FrameAdapter, instruction: str, cascade: Cascade, columns: list[str], j: Judgment
) -> SemanticFunction:
    """The proxy's pass (its score in ``SCORE``, its errors in ``llm_error``) for the judgment
    ``j`` (its ``chat``, ``logprobs`` and ``resources``)."""
    kwargs = dict(cascade.proxy_kwargs)
    if cascade.proxy == "model":
        proxy = dataclasses.replace(
            j,
            keep=True,
            model=cascade.proxy_model,
            output_column=PROXY_VERDICT,
            probability_column=PROXY_PROB,
            return_explanations=False,
            explanation_column="",
            max_explanation_tokens=0,
            on_error="null",
            cache=None,
            engine_kwargs=kwargs,
            what="cascade proxy",
        )
        step = judge_step(frame, instruction, proxy, columns)
        return SemanticFunction(step.name, step.task, Chain(step.post, ModelScore()), step.resources, step.shadow)
    fields = instruction_fields(instruction)
    shadow, seen = shadowed(columns, "embed", EMBEDDING, (), fields)
    task = make_llm_task(
        frame,
        "embed",
        (record_template(fields),),
        j.resources,
        model=cascade.proxy_model,
        columns=seen,
        output_column=EMBEDDING,
        engine_kwargs=kwargs,
    )
    query = pd.DataFrame({"q": [render_instruction(instruction)]}).llm.embed("q", model=task.model, **kwargs)
    if query[LLM_ERROR].notna().any():
        raise ValueError(f"cascade: the instruction could not be embedded: {query[LLM_ERROR].iloc[0]}")
    post = EmbeddingScore(tuple(float(x) for x in query["embedding"].iloc[0]))
    return SemanticFunction("proxy", task, post, j.resources, shadow)


class CascadeFinish:
    """Each partition's verdicts: the sample's (known), the band's (the oracle, run here) and
    the proxy's (the rest); then the operator's columns, and for filter its rows."""

    def __init__(
        self,
        oracle: SemanticFunction,
        inputs: list[str],
        known: pd.DataFrame,
        band: np.ndarray,
        decisions: np.ndarray,
        j: Judgment,
        prior: bool,
    ):
        self.oracle, self.inputs, self.known = oracle, inputs, known
        self.band, self.decisions = frozenset(band.tolist()), decisions
        self.output_column, self.probability_column = j.output_column, j.probability_column
        self.explanation_column = j.explanation_column if j.return_explanations else None
        self.keep, self.prior = j.keep, prior
        self.token = uuid.uuid4().hex  # one cascade's finish: its thresholds and sample are this call's

    def __dask_tokenize__(self):
        return ("CascadeFinish", self.token)

    def __call__(self, part: pd.DataFrame) -> pd.DataFrame:
        pos = part[POS].to_numpy(dtype=np.int64)
        score = part[SCORE].astype(float).to_numpy()
        n = len(part)
        verdict = np.array([bool(self.decisions[p]) for p in pos], dtype=object)
        prob = np.where(verdict.astype(bool), score, 1 - score).astype(object)
        source = np.array(["proxy"] * n, dtype=object)
        note = np.array([None] * n, dtype=object)
        error = np.array([None] * n, dtype=object)
        sampled = np.isin(pos, self.known.index.to_numpy())
        band = np.array([p in self.band for p in pos], dtype=bool)
        frames = []
        if sampled.any():
            frames.append((sampled, self.known.loc[pos[sampled]].reset_index(drop=True)))
        if band.any():
            frames.append((band, self.oracle(part.loc[band, self.inputs]).reset_index(drop=True)))
        for mask, judged in frames:
            verdict[mask] = judged[self.output_column].astype(object).to_numpy()
            prob[mask] = judged[self.probability_column].astype(object).to_numpy()
            source[mask] = "model"
            error[mask] = judged[LLM_ERROR].astype(object).to_numpy()
            if self.explanation_column is not None:
                note[mask] = judged[self.explanation_column].astype(object).to_numpy()
        out = part[self.inputs].copy()
        columns = [(self.output_column, verdict, BOOL), (self.probability_column, prob, FLOAT)]
        if self.explanation_column is not None:
            columns.append((self.explanation_column, note, STRING))
        for name, values, dtype in [*columns, (SOURCE, source, STRING), (LLM_ERROR, error, STRING)]:
            out[name] = pd.Series([None if v is pd.NA else v for v in values], index=part.index, dtype=dtype)
        if self.prior:
            out[LLM_ERROR] = merge_errors(out.pop(PRIOR), out[LLM_ERROR])
        if not self.keep:
            keep = out[self.output_column].fillna(False).astype(bool) | out[LLM_ERROR].notna()
            out = out[keep.to_numpy()].drop(columns=[self.output_column, self.probability_column])
        return out


def cascade_judge(frame: FrameAdapter, instruction: str, cascade: Cascade, j: Judgment, return_stats: bool):
    """``.llm.judge``/``.llm.filter`` with ``cascade=``: see the module's docstring."""
    if not isinstance(cascade, Cascade):
        raise ValueError(f"{j.what}: cascade must be a dfllm.Cascade, got {type(cascade).__name__}")
    if j.on_error != "null":
        raise ValueError(f"{j.what}: a cascade keeps failed rows with their llm_error; on_error must be 'null'")
    if SOURCE in frame.columns:
        raise ValueError(f"{j.what}: a cascade adds the column {SOURCE!r}, which the dataframe already has; rename it")
    dask = frame.kind == "dask"
    inputs = [PRIOR if c == LLM_ERROR else c for c in frame.columns]
    prior = PRIOR in inputs
    data = frame.obj if dask else frame.to_pandas()
    data = data.rename(columns={LLM_ERROR: PRIOR}) if prior else data
    if dask:
        ones = data.assign(**{POS: 1})[POS]
        data = data.assign(**{POS: ones.cumsum() - 1})
    else:
        data = data.assign(**{POS: np.arange(len(data), dtype=np.int64)})
    # the oracle keeps every row: CascadeFinish drops filter's
    oracle = judge_step(frame, instruction, dataclasses.replace(j, keep=True, on_error="null"), inputs)
    scored = run_step(FrameAdapter(data), proxy_step(frame, instruction, cascade, [*inputs, POS], j))
    if dask:
        scored = scored.persist()
    table = (scored[[POS, SCORE]].compute() if dask else scored[[POS, SCORE]]).sort_values(POS)
    scores = table[SCORE].astype(float).to_numpy()
    known: list[pd.DataFrame] = []

    def judge_sample(positions: np.ndarray) -> np.ndarray:
        rows = scored[scored[POS].isin(positions.tolist())][[*inputs, POS]]
        carry = _keeping(oracle, POS)
        judged = carry(rows) if not dask else rows.map_partitions(carry, meta=carry.meta(rows._meta)).compute()
        judged = judged.set_index(POS).loc[positions]
        known.append(judged)
        v = judged[j.output_column].astype(object)
        return np.array([np.nan if x is None or x is pd.NA else float(bool(x)) for x in v], dtype=float)

    sampled, band, decisions, stats = run_cascade(scores, judge_sample, cascade)
    logger.info(
        "%s cascade: %d of %d rows (%.1f%%) went to the large model (%d sampled, %d uncertain); estimated "
        "recall %.3f (bound %.3f, target %.3f), precision %.3f (bound %.3f, target %.3f)",
        j.what,
        stats.large_model_rows,
        stats.rows,
        100 * stats.large_model_share,
        stats.sampled_rows,
        stats.band_rows,
        stats.estimated_recall,
        stats.recall_bound,
        stats.recall_target,
        stats.estimated_precision,
        stats.precision_bound,
        stats.precision_target,
    )
    keep_columns = [*j.output_columns, LLM_ERROR]
    known_frame = known[0][keep_columns] if known else pd.DataFrame(columns=keep_columns)
    fin = CascadeFinish(oracle, inputs, known_frame, band, decisions, j, prior)
    if dask:
        result = scored.map_partitions(fin, meta=fin(scored._meta))
    else:
        result = fin(scored)
        result.attrs["dfllm_cascade"] = stats.as_dict()
        result = frame.back(result)
    return (result, stats) if return_stats else result


class _keeping:
    """A semantic step that carries one extra column (``column``) through untouched."""

    def __init__(self, step: SemanticFunction, column: str):
        self.step, self.column = step, column
        self.resources, self.task, self.name, self.shadow = step.resources, step.task, step.name, step.shadow
        self.__name__ = step.__name__

    def __dask_tokenize__(self):
        return ("keeping", self.step.__dask_tokenize__(), self.column)

    def meta(self, meta: pd.DataFrame) -> pd.DataFrame:
        out = self.step.meta(meta.drop(columns=[self.column]))
        out[self.column] = meta[self.column]
        return out

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        out = self.step(df.drop(columns=[self.column]))
        out[self.column] = df[self.column]
        return out
