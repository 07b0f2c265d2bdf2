"""What a dry run reports: :class:`DryRunReport` and its parts, and the text
``dfllm run --dry-run`` prints."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING, Any

import numpy as np

from dfllm.errors import shown

if TYPE_CHECKING:
    from dfllm.jobs.dry_run.calibration import Calibration
    from dfllm.jobs.dry_run.survey import EngineFacts


@dataclasses.dataclass
class Estimate:
    """The job's estimated wall time on this cluster (``seconds``) and its parts; what it
    assumes, in words."""

    seconds: float
    load_seconds: float
    read_seconds: float
    generation_seconds: float
    engines: int
    slots: int
    decode_steps: float
    generated_tokens: int
    computed_prompt_tokens: int
    assumptions: list[str]


@dataclasses.dataclass
class Refusal:
    """Rows refused for one reason: how many, and a few (row label, message) examples."""

    reason: str
    rows: int
    examples: list[tuple[Any, str]]


@dataclasses.dataclass
class DryRunReport:
    """What a job would do (see the module docstring); :meth:`format` is the printed report."""

    what: str  # the job in a few words
    rows: int
    partitions: int
    accepted: int
    refused: int
    refusals: list[Refusal]
    prompt_tokens: int
    prompt_p50: int
    prompt_p99: int
    prompt_longest: int
    longest_row: Any
    max_generated_tokens: int  # the sum of the accepted rows' max_tokens (within the context)
    duplicates: int  # rows identical to an earlier row of their partition: computed once
    duplicate_prompt_tokens: int
    job_duplicates: int  # rows identical to an earlier row anywhere in the job (deterministic ones)
    prefix_cached_tokens: int  # prompt tokens in full blocks another request computes first (one shared cache)
    looked_up_tokens: int  # prompt tokens in full blocks the prefix cache looks up
    cache_hits: int | None  # rows the response cache answers (None: no cache)
    engine: EngineFacts | None
    calibration: Calibration | None
    estimate: Estimate | None
    on_error_raise: bool = False
    output: str | None = None  # what the output folder holds now
    budget: str | None = None  # when a token budget would stop the job
    seconds: float = 0.0
    not_estimated: dict[str, int] = dataclasses.field(default_factory=dict)  # why -> rows neither run nor refused

    @property
    def skipped(self) -> int:
        """Rows the dry run does not estimate (run by another engine)."""
        return sum(self.not_estimated.values())

    def format(self) -> str:
        """The report as ``dfllm run --dry-run`` prints it."""
        lines = [f"dry run:          {self.what}; nothing was written"]
        lines.append(
            f"rows:             {self.rows:,} in {self.partitions:,} partition(s); {self.accepted:,} would "
            f"run, {self.refused:,} refused" + (f", {self.skipped:,} not estimated" if self.skipped else "")
        )
        for why, n in sorted(self.not_estimated.items(), key=lambda kv: -kv[1]):
            lines.append(f"  not estimated:  {n:,} x {why}")
        for r in self.refusals:
            row, message = r.examples[0] if r.examples else (None, "")
            example = f"row {shown(row)}" + ("" if message == r.reason else f": {_short(message)}")
            lines.append(f"  refused:        {r.rows:,} x {_short(r.reason)} (e.g. {example})")
        if self.refused and self.on_error_raise:
            lines.append("  (with --on-error raise the job would fail at the first of them)")
        if self.accepted:
            lines.append(
                f"prompt tokens:    {self.prompt_tokens:,} (p50 {self.prompt_p50:,}, p99 {self.prompt_p99:,}, "
                f"longest {self.prompt_longest:,}"
                + (f", row {shown(self.longest_row)}" if self.longest_row is not None else "")
                + ")"
            )
            lines.append(
                f"max tokens:       {self.max_generated_tokens:,} generated at most (max_tokens, within the context)"
            )
            share = 100 * self.prefix_cached_tokens / max(1, self.prompt_tokens)
            bs = self.engine.block_size if self.engine else 0
            lines.append(
                f"prefix sharing:   {self.prefix_cached_tokens:,} prompt tokens ({share:.0f}%) in full "
                f"{bs}-token blocks shared with an earlier prompt: the prefix cache computes them once "
                "(at most: one cache for the job)"
            )
            lines.append(
                f"identical rows:   {self.duplicates:,} identical to an earlier row of their partition "
                f"(computed once: {self.duplicate_prompt_tokens:,} prompt tokens and their generation); "
                f"{self.job_duplicates:,} in the whole job"
            )
        if self.cache_hits is not None:
            lines.append(
                f"response cache:   {self.cache_hits:,} of {self.accepted:,} rows found (answered without the engine)"
            )
        if self.output:
            lines.append(f"output:           {self.output}")
        c = self.calibration
        if c is not None and c.rows:
            lines.append(
                f"calibration:      {c.rows} rows on {c.worker or 'one worker'} in {c.seconds:.1f} s: "
                f"prefill {c.computed_prompt_tokens / max(c.prefill_seconds, 1e-9):,.0f} tokens/s; a decode "
                f"step {1000 * c.step_seconds:.1f} ms + {1000 * c.row_step_seconds:.2f} ms per row; rows "
                f"generated {100 * c.generated_share:.0f}% of max_tokens"
                + (f" ({c.censored} still running at the time limit)" if c.censored else "")
            )
        e = self.estimate
        if e is not None:
            lines.append(
                f"estimate:         {_duration(e.seconds)} (engine load {_duration(e.load_seconds)}, "
                f"read and tokenize {_duration(e.read_seconds)}, generation "
                f"{_duration(e.generation_seconds)}: ~{e.generated_tokens:,} tokens generated in "
                f"~{e.decode_steps:,.0f} steps on {e.engines} engine(s) x {e.slots} partitions at once)"
            )
            lines += [f"  assumes:        {a}" for a in e.assumptions]
        if self.budget:
            lines.append(f"budget:           {self.budget}")
        lines.append(f"dry run took:     {_duration(self.seconds)}")
        return "\n".join(lines)


def _short(text: str, n: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def nearest_rank(values: np.ndarray, q: float) -> int:
    """The ``q``-th percentile by nearest rank (a value of ``values``; 0 for none)."""
    if not len(values):
        return 0
    return int(np.percentile(values, q, method="inverted_cdf"))


def refusal_counts(report: DryRunReport) -> Counter:
    """Refused rows by reason (for tests and scripts)."""
    return Counter({r.reason: r.rows for r in report.refusals})
