"""The estimate: the partitions' surveys and the calibration priced on the cluster's
engines and threads (:func:`build_report`)."""

from __future__ import annotations

import heapq
import math

import numpy as np

from dfllm.jobs.dry_run.calibration import Calibration
from dfllm.jobs.dry_run.report import DryRunReport, Estimate, Refusal, nearest_rank
from dfllm.jobs.dry_run.survey import EXAMPLES, EngineFacts, PartitionSurvey


def build_report(
    surveys: list[PartitionSurvey],
    calibration: Calibration | None,
    shape: tuple[int, int],
    read_seconds: float,
    what: str,
    budget=None,
) -> DryRunReport:
    """The report from the partitions' surveys and the calibration (see :class:`DryRunReport`)."""
    lengths = np.concatenate([s.prompt_tokens for s in surveys]) if surveys else np.zeros(0, dtype=np.int64)
    limits = np.concatenate([s.max_tokens for s in surveys]) if surveys else np.zeros(0, dtype=np.int64)
    reasons: dict[str, Refusal] = {}
    for s in surveys:
        for reason, (n, examples) in s.reasons.items():
            r = reasons.setdefault(reason, Refusal(reason, 0, []))
            r.rows += n
            r.examples += examples[: max(0, EXAMPLES - len(r.examples))]
    facts = next((s.engine for s in surveys), None)
    longest = max((s.longest for s in surveys if s.longest[0]), default=(0, None), key=lambda x: x[0])
    digests = [s.request_digests for s in surveys if len(s.request_digests)]
    distinct_requests = len(np.unique(np.concatenate(digests))) if digests else 0
    job_duplicates = sum(s.duplicates for s in surveys) + sum(len(d) for d in digests) - distinct_requests
    blocks = [s.block_digests for s in surveys if len(s.block_digests)]
    distinct_blocks = len(np.unique(np.concatenate(blocks))) if blocks else 0
    looked_up = sum(s.looked_up_blocks for s in surveys)
    bs = facts.block_size if facts else 0
    hits = [s.cache_hits for s in surveys if s.cache_hits is not None]
    report = DryRunReport(
        what=what,
        rows=sum(s.rows for s in surveys),
        partitions=len(surveys),
        accepted=len(lengths),
        refused=sum(s.refused for s in surveys),
        refusals=sorted(reasons.values(), key=lambda r: -r.rows),
        prompt_tokens=int(lengths.sum()),
        prompt_p50=nearest_rank(lengths, 50),
        prompt_p99=nearest_rank(lengths, 99),
        prompt_longest=longest[0],
        longest_row=longest[1],
        max_generated_tokens=int(limits.sum()),
        duplicates=sum(s.duplicates for s in surveys),
        duplicate_prompt_tokens=sum(s.duplicate_tokens for s in surveys),
        job_duplicates=job_duplicates,
        prefix_cached_tokens=(looked_up - distinct_blocks) * bs,
        looked_up_tokens=looked_up * bs,
        cache_hits=sum(hits) if hits else None,
        engine=facts,
        calibration=calibration,
        estimate=None,
    )
    for s in surveys:
        for why, n in s.not_estimated.items():
            report.not_estimated[why] = report.not_estimated.get(why, 0) + n
    if calibration is not None and calibration.rows and facts is not None:
        report.estimate = estimate(surveys, calibration, shape, read_seconds, report.prefix_cached_tokens, facts)
    if budget:
        report.budget = _budget_note(surveys, budget, calibration)
    return report


def estimate(
    surveys: list[PartitionSurvey],
    cal: Calibration,
    shape: tuple[int, int],
    read_seconds: float,
    prefix_cached: int,
    facts: EngineFacts,
) -> Estimate:
    """The job's wall time: engine load, reading and tokenizing (as measured by the dry run),
    and generation, from the partitions' rows and the calibration (see the module docstring)."""
    engines, slots = shape
    durations, generated, prompt = [], 0.0, 0
    for s in surveys:
        runs = s.runs if len(s.runs) else np.zeros(0, dtype=bool)
        limits, lengths = s.max_tokens[runs], s.prompt_tokens[runs]
        if not len(limits):
            continue
        generated += cal.generated_share * float(limits.sum())
        prompt += int(lengths.sum())
        prefill_steps = math.ceil(int(lengths.sum()) / max(1, facts.max_num_batched_tokens))
        durations.append(cal.longest_share * float(limits.max()) + prefill_steps)
    lanes = [0.0] * (engines * slots)  # Dask starts partitions in order on the first free thread
    for d in durations:
        heapq.heappush(lanes, heapq.heappop(lanes) + d)
    steps = max(max(lanes), generated / (engines * facts.max_num_seqs))
    computed = max(0, prompt - prefix_cached)
    gen_seconds = (
        steps * cal.step_seconds + (cal.row_step_seconds * generated + cal.prefill_token_seconds * computed) / engines
    )
    load = max((s.load_seconds for s in surveys), default=0.0)
    read = max(0.0, read_seconds - load)
    assumptions = [
        f"each row generates {100 * cal.generated_share:.0f}% of its max_tokens, as the {cal.rows} calibration "
        "rows did"
        + (
            f" ({cal.censored} stopped by the time limit counted halfway to their max_tokens; a longer "
            "calibration is more exact)"
            if cal.censored
            else ""
        ),
        f"{engines} engine(s) as fast as the calibration's, each running {slots} partition(s) at once; a partition "
        "takes as many decode steps as its longest row",
        "prompt blocks shared with an earlier prompt are computed once (one prefix cache for the job); identical "
        "rows of a partition once",
        "engine load, reading and tokenizing take what they took in this dry run; writing the parts, nothing",
    ]
    return Estimate(
        load + read + gen_seconds,
        load,
        read,
        gen_seconds,
        engines,
        slots,
        steps,
        round(generated),
        computed,
        assumptions,
    )


def _budget_note(surveys: list[PartitionSurvey], budget, cal: Calibration | None) -> str:
    """When ``budget`` would stop the job: the partitions (in order) whose tokens reach it."""
    prompt = generated = 0.0
    share = cal.generated_share if cal is not None and cal.rows else 1.0
    for k, s in enumerate(surveys, 1):
        runs = s.runs if len(s.runs) else np.zeros(0, dtype=bool)
        prompt += float(s.prompt_tokens[runs].sum())
        generated += share * float(s.max_tokens[runs].sum())
        if budget.reached(int(prompt), int(generated)):
            return (
                f"would stop the job after about {k:,} of {len(surveys):,} partitions "
                f"(~{int(prompt):,} prompt and ~{int(generated):,} generated tokens by then; partitions "
                "running at that moment finish too)"
            )
    return f"the job fits (~{int(prompt):,} prompt and ~{int(generated):,} generated tokens in all)"
