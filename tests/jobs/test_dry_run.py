"""``dfllm run --dry-run`` (:mod:`dfllm.jobs.dry_run`) and job budgets (``--max-prompt-tokens``,
``--max-generated-tokens``, ``write_parquet(budget=...)``), on a real cluster with real files.

The dry run's figures are checked against a direct count (the tokenizer, the rows, the
prompts' blocks as token tuples) and its refusals against the real run's ``llm_error``; a
budget stops a job with finished parts kept, and ``--resume`` finishes it with every row once.
"""

from __future__ import annotations

import subprocess
import sys

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
from transformers import AutoTokenizer

import dfllm
from dfllm.accessors.budget import Budget
from dfllm.jobs.cli import main as cli_main
from dfllm.jobs.dry_run import dry_run, refusal_counts

pytestmark = pytest.mark.timeout(600)

MAX_MODEL_LEN = 64
SHARED = "Read the following note about rivers, lakes and the sea before you answer the question that comes after it."


def dfllm_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dfllm.jobs.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def rows() -> pd.DataFrame:
    """Sixteen rows: prompts sharing a long prefix, exact duplicates, per-row max_tokens, and
    bad rows (a null, an empty prompt, one past max_model_len, invalid sampling params)."""
    q = [f"{SHARED} Question {i}: name a river." for i in range(16)]
    q[3] = None
    q[5] = "many words " * 60  # past max_model_len
    q[9] = ""
    q[6] = q[4]  # a duplicate in the same partition
    q[12] = q[4]  # and one in the other partition
    sp = [{"max_tokens": 2 + i % 3, "temperature": 0.0} for i in range(16)]
    sp[6] = sp[12] = sp[4]
    sp[14] = {"max_tokens": -1}  # invalid: refused, naming the field
    return pd.DataFrame({"id": range(16), "q": q, "sp": sp})


def the_job(ddf, model):
    return ddf.llm.generate("{q}", model=str(model), sampling_params="sp", max_model_len=MAX_MODEL_LEN)


@pytest.mark.slow
def test_dry_run_counts_what_a_direct_count_gives_and_refuses_what_the_real_run_refuses(
    cli_cluster, tiny_llama, tmp_path
):
    df = rows()
    client = cli_cluster.client()
    out = tmp_path / "out"
    with client.as_current():
        ddf = dd.from_pandas(df, npartitions=2)
        report = dry_run(the_job(ddf, tiny_llama), output=str(out), sample_rows=4, calibration_seconds=10)
        real = the_job(ddf, tiny_llama).compute()
        partitions = [ddf.partitions[i].compute()["id"].tolist() for i in range(ddf.npartitions)]
    assert not out.exists()  # nothing written

    # refused rows: exactly those the real run fails before generating, with its messages
    failed = real[real["llm_error"].notna()]
    assert sorted(failed["id"]) == [3, 5, 9, 14]
    assert report.refused == 4 and report.accepted == 12 and report.rows == 16 and report.partitions == 2
    examples = {row: message for r in report.refusals for row, message in r.examples}
    assert examples == dict(zip(failed.index, failed["llm_error"]))
    assert refusal_counts(report)["prompt longer than max_model_len"] == 1
    assert any("max_tokens" in m for m in examples.values())  # the bad sampling params name the field

    # prompt tokens, by the tokenizer
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ok = df[~df["id"].isin([3, 5, 9, 14])]
    ids = {i: tok(text)["input_ids"] for i, text in zip(ok["id"], ok["q"])}
    lengths = np.array([len(ids[i]) for i in ok["id"]])
    assert report.prompt_tokens == lengths.sum()
    assert report.prompt_p50 == int(np.percentile(lengths, 50, method="inverted_cdf"))
    assert report.prompt_p99 == int(np.percentile(lengths, 99, method="inverted_cdf"))
    assert report.prompt_longest == lengths.max() and len(ids[report.longest_row]) == lengths.max()
    limits = {i: min(sp["max_tokens"], MAX_MODEL_LEN - len(ids[i])) for i, sp in zip(ok["id"], ok["sp"])}
    assert report.max_generated_tokens == sum(limits.values())

    # identical rows: row 6 repeats row 4 in its partition (computed once), row 12 in the other
    part_of = {i: k for k, members in enumerate(partitions) for i in members}
    assert part_of[4] == part_of[6] != part_of[12]
    assert report.duplicates == 1 and report.job_duplicates == 2
    assert report.duplicate_prompt_tokens == len(ids[6])

    # prefix sharing: full 16-token blocks (all but a last block leaving no token to compute) of
    # the prompts the engine computes, counted once per distinct prefix
    computed = [i for i in ok["id"] if i != 6]
    blocks = [tuple(ids[i][: 16 * (b + 1)]) for i in computed for b in range((len(ids[i]) - 1) // 16)]
    assert report.prefix_cached_tokens == 16 * (len(blocks) - len(set(blocks))) > 0
    assert report.engine.block_size == 16 and report.engine.max_model_len == MAX_MODEL_LEN

    # the calibration ran on the cluster and priced the job
    assert report.calibration.rows == 4 and report.calibration.worker.startswith("tcp://")
    assert report.estimate.seconds > 0 and report.estimate.engines == 2
    text = report.format()
    assert "nothing was written" in text and "prompt longer than max_model_len" in text and "estimate:" in text


@pytest.mark.slow
def test_dry_run_on_the_command_line_writes_nothing_and_checks_the_output(cli_cluster, tiny_llama, tmp_path):
    src = tmp_path / "in.parquet"
    rows().drop(columns="sp").to_parquet(src)
    common = (
        "--prompt",
        "{q}",
        "--model",
        str(tiny_llama),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-tokens",
        "3",
        "--npartitions",
        "2",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
        "--dry-run",
        "--calibration-seconds",
        "10",
        "--max-prompt-tokens",
        "100",
    )
    result = dfllm_cli("run", str(src), str(tmp_path / "out"), *common)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nothing was written" in result.stdout and "13 would run, 3 refused" in result.stdout
    assert "budget:           would stop the job after about 1 of 2 partitions" in result.stdout
    assert not (tmp_path / "out").exists()

    foreign = tmp_path / "taken"
    foreign.mkdir()
    (foreign / "notes.csv").write_text("a,b\n")  # a file a reader would read: the real run refuses it, so does this
    refused = dfllm_cli("run", str(src), str(foreign), *common)
    assert refused.returncode == 1 and "that dfllm did not write" in refused.stderr
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.csv"]


@pytest.mark.slow
def test_a_budget_stops_the_job_and_resume_finishes_it(cli_cluster, tiny_llama, tmp_path):
    src = tmp_path / "in.parquet"
    n = 24
    pd.DataFrame({"id": range(n), "q": [f"Question {i}: why is the sky blue?" for i in range(n)]}).to_parquet(src)
    out = tmp_path / "out"
    common = (
        "--prompt",
        "{q}",
        "--model",
        str(tiny_llama),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-tokens",
        "3",
        "--npartitions",
        "6",
        # a partition (4 rows) fills a batch: a worker's task then holds its thread rather than
        # seceding (dfllm.worker.driver), so each worker runs one partition at a time and the
        # budget stops the job with partitions unstarted, however fast the workers admit them
        "--max-num-seqs",
        "4",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
    )
    first = dfllm_cli("run", str(src), str(out), *common, "--max-prompt-tokens", "1")
    assert first.returncode == 4, first.stderr[-3000:]
    assert "dfllm: stopped: the prompt token budget (1) was reached" in first.stderr
    assert "stopped:     the prompt token budget (1) was reached" in first.stdout
    parts = sorted(out.glob("part.*.parquet"))
    assert 1 <= len(parts) < 6  # the first partitions to finish, and those running then; no other
    assert f"({len(parts)} written, 0 already complete, {6 - len(parts)} not written)" in first.stdout
    kept = pd.read_parquet(out)
    assert 0 < len(kept) < n and kept["id"].is_unique

    again = dfllm_cli("run", str(src), str(out), *common, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"({6 - len(parts)} written, {len(parts)} already complete)" in again.stdout
    done = pd.read_parquet(out)
    assert sorted(done["id"]) == list(range(n)) and done["generated_text"].notna().all()


@pytest.mark.slow
def test_write_parquet_budget_without_a_distributed_client(tiny_llama, tmp_path):
    df = pd.DataFrame({"id": range(8), "q": [f"Name river number {i}." for i in range(8)]})

    def job():
        return dd.from_pandas(df, npartitions=4).llm.generate(
            "{q}",
            model=str(tiny_llama),
            max_model_len=MAX_MODEL_LEN,
            sampling_params={"max_tokens": 2, "temperature": 0.0},
        )

    seen: list[int] = []
    with pytest.raises(ValueError, match="generated_tokens must be a positive integer"):
        Budget(generated_tokens=0)
    with dask.config.set(num_workers=2):  # two partitions at once: once one is done, no other starts
        stopped = dfllm.write_parquet(
            job(),
            str(tmp_path / "out"),
            progress=False,
            budget=Budget(generated_tokens=1),
            on_partition=lambda i, record: seen.append(i),
        )
    assert stopped.stopped and "generated token budget (1)" in stopped.stopped
    assert (stopped.written, stopped.missing, len(seen)) == (2, 2, 2)
    assert sorted(seen) == sorted(int(p.name.split(".")[1]) for p in (tmp_path / "out").glob("part.*.parquet"))
    done = dfllm.write_parquet(
        job(), str(tmp_path / "out"), progress=False, resume=True, budget=Budget(prompt_tokens=10**9)
    )
    assert done.stopped is None and done.missing == 0 and (done.written, done.skipped) == (4 - len(seen), len(seen))
    assert sorted(pd.read_parquet(tmp_path / "out")["id"]) == list(range(8))


@pytest.mark.parametrize(
    "argv, message, status",
    [
        (["--max-prompt-tokens", "0"], "argument --max-prompt-tokens: must be a positive integer", 2),
        (["--calibration-seconds", "-1"], "argument --calibration-seconds: must be a positive number", 2),
        (["--task", "embed", "--max-generated-tokens", "5"], "apply to --task generate or chat", 1),
        (["--calibration-seconds", "5"], "--calibration-seconds applies to --dry-run", 1),
    ],
)
def test_budget_and_dry_run_options_are_checked(tmp_path, capsys, argv, message, status):
    src = tmp_path / "in.parquet"
    pd.DataFrame({"q": ["a"], "text": ["b"]}).to_parquet(src)
    try:
        got = cli_main(["run", str(src), str(tmp_path / "out"), "--prompt", "q", *argv])
    except SystemExit as exc:
        got = exc.code
    assert got == status and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_dry_run_counts_response_cache_hits_and_writes_no_entry(tiny_llama, tmp_path):
    pytest.importorskip("dfllm.tasks.response_cache")
    cache = tmp_path / "cache"
    df = pd.DataFrame({"id": range(6), "q": [f"Name river number {i}." for i in range(5)] + [None]})

    def job():
        return dd.from_pandas(df, npartitions=2).llm.generate(
            "{q}",
            model=str(tiny_llama),
            max_model_len=MAX_MODEL_LEN,
            cache=str(cache),
            sampling_params={"max_tokens": 2, "temperature": 0.0},
        )

    before = dry_run(job(), sample_rows=0)
    assert (before.accepted, before.refused, before.cache_hits) == (5, 1, 0)
    assert not cache.exists() or not [p for p in cache.rglob("*") if p.is_file()]  # no entry written
    job().compute()  # the real run stores the five answers
    after = dry_run(job(), sample_rows=2, calibration_seconds=5)
    assert after.cache_hits == 5 and "5 of 5 rows found" in after.format()
    assert after.estimate is not None and after.estimate.generated_tokens == 0  # nothing left for the engine
