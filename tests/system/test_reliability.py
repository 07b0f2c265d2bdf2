"""When things go wrong, for real: object storage, killed workers, a killed client, resumed.

- an S3-compatible server (moto's standalone server) on 127.0.0.1, read and written through
  s3fs by the CLI and by the accessors;
- worker processes of a ``dask scheduler``/``dask worker`` cluster killed (once, then twice)
  while ``dfllm run`` is writing: every row exactly once, no partial files;
- the ``dfllm run`` client itself killed mid-write, then run again with ``--resume``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from helpers import CLICluster, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# slow enough per partition (hundreds of decode steps) that a job can be interrupted mid-way
LONG = ["--max-tokens", "300", "--max-model-len", "400"]


def dfllm_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dfllm.jobs.cli", *args]


def write_rows(path: Path, n: int) -> pd.DataFrame:
    df = pd.DataFrame({"row_id": range(n), "q": [f"Tell me fact number {i} about rivers." for i in range(n)]})
    df.to_parquet(path)
    return df


def parts(out: Path) -> list[Path]:
    return sorted(out.glob("part.*.parquet"))


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended before {what}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def check_complete(out: Path, n: int) -> pd.DataFrame:
    result = pd.read_parquet(out)
    assert sorted(result["row_id"]) == list(range(n))  # every row exactly once
    assert result["llm_error"].isna().all()
    assert not [p.name for p in out.rglob(".tmp-*")]  # no partial file left behind
    return result


# ---- object storage -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; yields storage options for s3fs."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    opts = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
    }
    import boto3
    import s3fs

    boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{port}",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket="dfllm-test")
    fs = s3fs.S3FileSystem(**opts)
    yield opts, fs
    server.stop()


def test_cli_reads_and_writes_s3(s3, cli_cluster, tiny_llama, tmp_path):
    opts, fs = s3
    write_rows(tmp_path / "in.parquet", 6)
    fs.put(str(tmp_path / "in.parquet"), "dfllm-test/cli/in.parquet")
    cmd = dfllm_cmd(
        "run",
        "s3://dfllm-test/cli/in.parquet",
        "s3://dfllm-test/cli/out/",
        "--prompt",
        "{q}",
        "--model",
        str(tiny_llama),
        "--max-tokens",
        "4",
        "--max-model-len",
        "64",
        "--npartitions",
        "3",
        "--storage-options",
        json.dumps(opts),
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
    )
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    fs.invalidate_cache()
    assert len(fs.glob("dfllm-test/cli/out/part.*.parquet")) == 3
    out = pd.read_parquet("s3://dfllm-test/cli/out/", storage_options=opts)
    assert sorted(out["row_id"]) == list(range(6)) and out["generated_text"].notna().all()


def test_accessors_resume_against_the_bucket(s3, cli_cluster, tiny_llama, tmp_path):
    import dask.dataframe as dd

    import dfllm

    opts, fs = s3
    dd.from_pandas(write_rows(tmp_path / "in.parquet", 8), npartitions=4).to_parquet(
        "s3://dfllm-test/acc/in/", storage_options=opts
    )
    client = cli_cluster.client()
    with client.as_current():

        def job():
            ddf = dd.read_parquet("s3://dfllm-test/acc/in/", storage_options=opts)
            return ddf.llm.generate(
                "{q}", model=str(tiny_llama), max_model_len=64, sampling_params={"max_tokens": 4, "temperature": 0.0}
            )

        first = dfllm.write_parquet(job(), "s3://dfllm-test/acc/out", storage_options=opts, progress=False)
        assert (first.written, first.skipped, first.rows) == (4, 0, 8)
        fs.rm("dfllm-test/acc/out/part.00002.parquet")  # as if the job had died before this partition
        fs.invalidate_cache()
        again = dfllm.write_parquet(job(), "s3://dfllm-test/acc/out", storage_options=opts, resume=True, progress=False)
    assert (again.written, again.skipped, again.rows) == (1, 3, 8)
    out = pd.read_parquet("s3://dfllm-test/acc/out", storage_options=opts)
    assert sorted(out["row_id"]) == list(range(8))


# ---- killed workers -------------------------------------------------------------------------------
def test_job_survives_killed_workers(tiny_llama, tmp_path):
    kills = 2  # one worker after the first part, the other after the second (the single kill is its first half)
    n = 16
    write_rows(tmp_path / "in.parquet", n)
    out = tmp_path / "out"
    cluster = CLICluster(workers=2, threads=1)
    try:
        job = subprocess.Popen(
            dfllm_cmd(
                "run",
                str(tmp_path / "in.parquet"),
                str(out),
                "--prompt",
                "{q}",
                "--model",
                str(tiny_llama),
                *LONG,
                "--npartitions",
                "8",
                "--scheduler",
                cluster.address,
                "--no-progress",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        killed: list[int] = []
        for k in range(kills):
            wait_for(lambda k=k: len(parts(out)) >= k + 1, 240, f"part {k + 1}", job)
            # two workers answering, the killed ones replaced (not merely wait_for_workers(2),
            # which returns while the scheduler still lists a killed worker)
            victim = sorted(cluster.wait_for_worker_pids(2, gone=killed).values())[k % 2]
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
            cluster.wait_for_worker_pids(2, gone=killed)  # the nanny's new worker process answers
        try:
            stdout, stderr = job.communicate(timeout=400)
        except subprocess.TimeoutExpired:  # say where it stands before the job goes
            state = cluster.diagnose()
            job.kill()
            _, stderr = job.communicate()
            raise AssertionError(f"the job did not finish in 400 s\n{stderr[-6000:]}\n{state}") from None
        assert job.returncode == 0, stderr[-2000:]
        assert len(parts(out)) <= 8
        cluster.wait_for_worker_pids(2, gone=killed, timeout=60)  # two workers serve, none of the killed
        # (a killed partition's routed rows may still finish on the live engine beside their
        # rerun, which the engine then computes once: "answered from an identical row")
        assert "rows:        16 (0 with llm_error" in stdout
        check_complete(out, n)
    finally:
        cluster.close()


# ---- a crashed client, resumed --------------------------------------------------------------------
def test_killed_client_resumes_without_recomputing(cli_cluster, tiny_llama, tmp_path):
    n = 16
    write_rows(tmp_path / "in.parquet", n)
    out = tmp_path / "out"
    args = (
        "run",
        str(tmp_path / "in.parquet"),
        str(out),
        "--prompt",
        "{q}",
        "--model",
        str(tiny_llama),
        *LONG,
        "--npartitions",
        "8",
        # a full batch at 2 rows: a worker starts no partition beyond its thread's (see
        # dfllm.worker.driver), so some partitions are unstarted when the client dies
        "--max-num-seqs",
        "2",
        "--resume",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
    )
    job = subprocess.Popen(dfllm_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(parts(out)) >= 2, 240, "two parts", job)
    job.kill()  # SIGKILL: no cleanup of any kind
    job.wait()
    time.sleep(1.0)  # tasks already running on the workers may still finish their (atomic) writes
    done_before = {p.name: p.stat().st_mtime_ns for p in parts(out)}
    assert 2 <= len(done_before) < 8

    result = subprocess.run(dfllm_cmd(*args), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    skipped = int(result.stdout.split("written, ")[1].split(" already")[0])
    assert skipped >= len(done_before)
    for name, mtime in done_before.items():  # finished partitions were not rewritten
        assert (out / name).stat().st_mtime_ns == mtime
    check_complete(out, n)
