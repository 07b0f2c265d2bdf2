"""``.llm.judge`` and ``.llm.filter``: whether a templated statement holds for each row.

One constrained, greedy decode per row: ``choice`` of ``"True"``/``"False"`` (with
explanations, a regex ``(True|False): <one line>``, whose first token is chosen under the
same mask), and the first generated token's top log-probabilities (``engine_columns=
("logprobs",)``) for the verdict's probability: the probability mass of the tokens that
begin the answer given against that of the tokens that begin the other one, among those
listed. An answer token not listed is taken to be as likely as the least likely listed one
(or as the chosen token, if that is less), an upper bound, so that the probability is never
overstated; ``logprobs=-1`` lists the whole vocabulary and makes it exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd
import pyarrow as pa

from dfllm.accessors.adapter import FrameAdapter
from dfllm.engine_args import DEFAULTS
from dfllm.sampling_params import SamplingParams
from dfllm.semantic.frames import SHADOW, SemanticFunction, prompted_task, task_columns
from dfllm.semantic.prompts import instruction_fields
from dfllm.structured_outputs import StructuredOutputsParams
from dfllm.tasks.schema import FLOAT, LLM_ERROR, STRING

BOOL = pd.ArrowDtype(pa.bool_())
ANSWERS = ("True", "False")
JUDGE_PREAMBLE = (
    "You judge whether a claim holds for a record. The claim refers to the record's fields by their "
    "names in brackets; the record follows it."
)
ANSWER = "Is the claim true for this record? Answer True or False."
EXPLAINED_ANSWER = (
    "Is the claim true for this record? Answer True or False, then a colon and a one-sentence explanation."
)
DEFAULT_MAX_LOGPROBS = DEFAULTS["max_logprobs"]  # the engine's max_logprobs unless told otherwise
TEXT = "__dfllm_sem_text__"  # the task's own output column (private, so that it clashes with no input)


def verdict_probability(first_token: dict | None, verdict: bool) -> float | None:
    """The probability of ``verdict`` from the first answer token's top log-probabilities
    (token id -> ``{"logprob", "decoded_token", ...}``, as the ``logprobs`` engine column
    holds them): the mass of listed tokens that begin the answer given against that of those
    that begin the other answer (an unlisted one counted at the smallest listed log-probability
    or the chosen token's, whichever is less). None without log-probabilities."""
    if not first_token:
        return None
    chosen, other = ANSWERS if verdict else ANSWERS[::-1]
    entries = [(e["decoded_token"], e["logprob"]) for e in first_token.values()]
    mine = [lp for tok, lp in entries if tok and chosen.startswith(tok) and math.isfinite(lp)]
    theirs = [lp for tok, lp in entries if tok and other.startswith(tok) and math.isfinite(lp)]
    if not mine:
        return None
    if not theirs:
        finite = [lp for _, lp in entries if math.isfinite(lp)]
        theirs = [min(min(finite), max(mine))]
    return 1.0 / (1.0 + math.exp(_logsumexp(theirs) - _logsumexp(mine)))


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


@dataclass(frozen=True)
class JudgeStep:
    """From a judgment task's output to the operator's columns (and, for filter, rows)."""

    output_column: str
    probability_column: str
    explanation_column: str | None  # None: no explanations asked for
    keep: bool  # judge: every row; filter: the rows judged true, and the failed ones
    task_columns: tuple[str, ...]

    def __call__(self, df: pd.DataFrame) -> pd.DataFrame:
        texts = df[TEXT].astype(object).tolist()
        firsts = df["logprobs"].tolist()
        verdicts: list = [None] * len(df)
        probs: list = [None] * len(df)
        notes: list = [None] * len(df)
        for i, (text, lps) in enumerate(zip(texts, firsts, strict=True)):
            if not isinstance(text, str):
                continue
            answer, _, note = text.partition(":")
            if answer not in ANSWERS:
                continue
            verdicts[i] = answer == ANSWERS[0]
            probs[i] = verdict_probability(lps[0] if lps else None, verdicts[i])
            notes[i] = note.strip()
        out = df.drop(columns=[c for c in self.task_columns if c != LLM_ERROR], errors="ignore")
        errors = out.pop(LLM_ERROR)
        out[self.output_column] = pd.Series(verdicts, index=df.index, dtype=BOOL)
        out[self.probability_column] = pd.Series(probs, index=df.index, dtype=FLOAT)
        if self.explanation_column is not None:
            out[self.explanation_column] = pd.Series(notes, index=df.index, dtype=STRING)
        out[LLM_ERROR] = errors
        if not self.keep:  # and a row that failed before (its earlier llm_error, shadowed here)
            keep = out[self.output_column].fillna(False).astype(bool) | errors.notna()
            if SHADOW + LLM_ERROR in out.columns:
                keep |= out[SHADOW + LLM_ERROR].notna().to_numpy()
            out = out[keep.to_numpy()].drop(columns=[self.output_column, self.probability_column])
        return out


@dataclass(frozen=True)
class Judgment:
    """One judgment's arguments (``.llm.judge``'s and ``.llm.filter``'s, less the frame, the
    instruction, ``cascade`` and ``return_stats``), passed on as one to the steps and the cascade."""

    keep: bool  # judge: every row; filter: the rows judged true, and the failed ones
    model: Any
    output_column: str
    probability_column: str
    return_explanations: bool
    explanation_column: str
    chat: bool
    logprobs: int
    max_explanation_tokens: int
    on_error: str
    resources: Any
    cache: Any
    engine_kwargs: dict
    what: str  # the operator's name in error messages

    @property
    def output_columns(self) -> list[str]:
        """The columns the judgment adds (but ``llm_error``)."""
        explanations = [self.explanation_column] if self.return_explanations else []
        return [self.output_column, self.probability_column, *explanations]


def judge_step(
    frame: FrameAdapter, instruction: str, j: Judgment, columns: list[str] | None = None
) -> SemanticFunction:
    """The operator (judge or filter) judging ``instruction`` on the accessor's frame (whose
    columns are ``columns``, if given)."""
    columns = frame.columns if columns is None else columns
    fields = instruction_fields(instruction)
    missing = [f for f in fields if f not in columns]
    if missing:
        raise ValueError(
            f"{j.what}: the instruction names column(s) {missing} that are not in the dataframe (columns: {columns})"
        )
    logprobs, engine_kwargs = j.logprobs, j.engine_kwargs
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not (logprobs == -1 or logprobs >= 2):
        raise ValueError(f"{j.what}: logprobs must be -1 (every token) or at least 2, got {logprobs!r}")
    if (logprobs == -1 or logprobs > DEFAULT_MAX_LOGPROBS) and "max_logprobs" not in engine_kwargs:
        engine_kwargs = {**engine_kwargs, "max_logprobs": logprobs}  # the engine allows 20 unless told
    if j.return_explanations:
        sampling = SamplingParams(
            temperature=0.0,
            logprobs=logprobs,
            max_tokens=j.max_explanation_tokens,
            structured_outputs=StructuredOutputsParams(regex=r"(True|False): [^\n]+"),
        )
        choice = None
    else:
        sampling = SamplingParams(temperature=0.0, logprobs=logprobs, max_tokens=8)
        choice = list(ANSWERS)
    task, shadow = prompted_task(
        frame,
        JUDGE_PREAMBLE,
        instruction,
        fields,
        columns,
        answer=EXPLAINED_ANSWER if j.return_explanations else ANSWER,
        chat=j.chat,
        resources=j.resources,
        output_column=TEXT,
        engine_columns=("logprobs",),
        model=j.model,
        sampling_params=sampling,
        choice=choice,
        on_error=j.on_error,
        engine_kwargs=engine_kwargs,
        cache=j.cache,
    )
    post = JudgeStep(
        j.output_column,
        j.probability_column,
        j.explanation_column if j.return_explanations else None,
        j.keep,
        tuple(task_columns(task.kind, TEXT, ("logprobs",))),
    )
    return SemanticFunction("judge" if j.keep else "filter", task, post, j.resources, shadow)
