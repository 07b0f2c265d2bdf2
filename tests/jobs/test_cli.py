"""The ``dfllm`` command, run as a subprocess: every task, its parquet output, and its errors
(most argument errors through its entry point in this process: one start costs seconds).

Jobs run against a real cluster started with ``dask scheduler`` and ``dask worker``
(``--scheduler``); the demo starts its own LocalCluster, as a new user's first run does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from dfllm import LLM, SamplingParams
from dfllm.jobs.cli import main as cli_main

from helpers import build_tiny_classifier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def dfllm(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dfllm.jobs.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def in_process(argv: list[str], capsys) -> tuple[int, str]:
    """The command's exit status and stderr, run through its entry point in this process."""
    try:
        status = cli_main(argv)
    except SystemExit as exc:  # argparse's errors
        status = exc.code if isinstance(exc.code, int) else 1
    return status, capsys.readouterr().err


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "questions.parquet"
    df = pd.DataFrame({"id": range(10), "q": [f"Question number {i}: why is the sky blue?" for i in range(10)]})
    df.loc[3, "q"] = None
    df.to_parquet(path)
    return path, df


def test_generate_writes_what_llm_generate_gives(cli_cluster, tiny_llama, questions, tmp_path):
    path, df = questions
    out = tmp_path / "out"
    stdout = ok(
        dfllm(
            "run",
            str(path),
            str(out),
            "--prompt",
            "Q: {q} A:",
            "--model",
            str(tiny_llama),
            "--max-tokens",
            "5",
            "--max-model-len",
            "64",
            "--npartitions",
            "3",
            "--scheduler",
            cli_cluster.address,
        )
    )
    assert "rows:        10 (1 with llm_error)" in stdout and "partitions:  3 (3 written" in stdout
    result = pd.read_parquet(out).sort_values("id")
    assert result["id"].tolist() == list(range(10))
    assert result.loc[result["id"] == 3, "llm_error"].item() == "column 'q' is null"
    good = result[result["id"] != 3]
    llm = LLM(tiny_llama, max_model_len=64, kv_cache_memory_bytes=2**22)
    ref = llm.generate([f"Q: {q} A:" for q in good["q"]], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert good["generated_text"].tolist() == [o.outputs[0].text for o in ref]
    assert good["num_generated_tokens"].tolist() == [len(o.outputs[0].token_ids) for o in ref]
    assert f"tokens:      {int(good['num_input_tokens'].sum())} in" in stdout

    again = ok(
        dfllm(
            "run",
            str(path),
            str(out),
            "--prompt",
            "Q: {q} A:",
            "--model",
            str(tiny_llama),
            "--max-tokens",
            "5",
            "--max-model-len",
            "64",
            "--npartitions",
            "3",
            "--resume",
            "--scheduler",
            cli_cluster.address,
        )
    )
    assert "partitions:  3 (0 written, 3 already complete)" in again


def test_chat_reads_conversations_from_json_lines(cli_cluster, tiny_llama, tmp_path):
    src = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say {w}."}]} for w in ("hi", "bye", "yes")]
    rows.append({"messages": [{"role": "wizard", "content": "bad role"}]})
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    ok(
        dfllm(
            "run",
            str(src),
            str(out),
            "--task",
            "chat",
            "--system",
            "Be brief.",
            "--model",
            str(tiny_llama),
            "--max-tokens",
            "4",
            "--max-model-len",
            "128",
            "--scheduler",
            cli_cluster.address,
        )
    )
    result = pd.read_parquet(out)
    assert len(result) == 4
    assert result["llm_error"].isna().tolist() == [True, True, True, False]
    assert "role" in result["llm_error"].iloc[3]
    llm = LLM(tiny_llama, max_model_len=128, kv_cache_memory_bytes=2**22)
    convs = [[{"role": "system", "content": "Be brief."}, *r["messages"]] for r in rows[:3]]
    ref = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert result["generated_text"].iloc[:3].tolist() == [o.outputs[0].text for o in ref]


def test_embed_csv_with_the_default_model(cli_cluster, tmp_path):
    src = tmp_path / "texts.csv"
    texts = ["a cat sat on the mat", "stock markets fell sharply", "the kitten slept"]
    pd.DataFrame({"text": texts}).to_csv(src, index=False)
    out = tmp_path / "out"
    stdout = ok(dfllm("run", str(src), str(out), "--task", "embed", "--scheduler", cli_cluster.address))
    assert "tokens:" not in stdout and "rows/s" in stdout
    got = np.array(pd.read_parquet(out)["embedding"].tolist())
    ref = np.stack([o.outputs.embedding for o in LLM("all-minilm-l6-v2").embed(texts, use_tqdm=False)])
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_score_and_classify(cli_cluster, tmp_path, minilm_classifier):
    src = tmp_path / "pairs.jsonl"
    pd.DataFrame({"text_1": ["a cat", "a cat"], "text_2": ["a kitten", "tax law"]}).to_json(
        src, orient="records", lines=True
    )
    ok(dfllm("run", str(src), str(tmp_path / "scores"), "--task", "score", "--scheduler", cli_cluster.address))
    scores = pd.read_parquet(tmp_path / "scores")["score"].tolist()
    assert scores[0] > scores[1]

    ok(
        dfllm(
            "run",
            str(src),
            str(tmp_path / "labels"),
            "--task",
            "classify",
            "--prompt",
            "text_1",
            "--model",
            str(minilm_classifier),
            "--scheduler",
            cli_cluster.address,
        )
    )
    labels = pd.read_parquet(tmp_path / "labels")
    assert set(labels["label"]) <= {"label_0", "label_1", "label_2"}
    assert all(abs(sum(p) - 1) < 1e-5 for p in labels["probs"])


@pytest.fixture(scope="module")
def minilm_classifier(tmp_path_factory):
    return build_tiny_classifier(tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "{missing}", "{out}"], "input not found"),
        (["run", "{input}", "{out}", "--prompt", "nope"], "column(s) ['nope'] not in the dataframe"),
        (["run", "{input}", "{out}", "--prompt", "q", "--model", "no-such-model"], "Unknown model 'no-such-model'"),
        (
            ["run", "{input}", "{out}", "--prompt", "q", "--storage-options", "{not json"],
            "--storage-options: not valid JSON",
        ),
        (["run", "{input}", "{out}", "--prompt", "q", "--storage-options", "[1, 2]"], "must be a JSON object"),
        (["run", "{input}", "{out}", "--prompt", "q", "--max-tokens", "0"], "max_tokens must be >= 1"),
        (["run", "{input}", "{out}", "--task", "classify", "--prompt", "q"], "--task classify needs --model"),
    ],
)
def test_errors_are_one_line_and_non_zero(questions, tmp_path, args, message, capsys):
    path, _ = questions
    subs = {"{missing}": str(tmp_path / "missing.parquet"), "{input}": str(path), "{out}": str(tmp_path / "out")}
    argv = [subs.get(a, a) for a in args]
    if message == "input not found":  # one through the real command and its exit status
        result = dfllm(*argv, timeout=120)
        status, stderr = result.returncode, result.stderr
    else:  # the others through the command's entry point in this process (each start costs seconds)
        status, stderr = in_process(argv, capsys)
    assert status != 0
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dfllm: error:"), stderr
    assert message in lines[0]
    assert not (tmp_path / "out").exists()  # nothing was started


def test_models_lists_the_bundled_models():
    stdout = ok(dfllm("models"))
    assert "smollm2-135m-instruct" in stdout and "all-minilm-l6-v2" in stdout and "ready" in stdout


def test_demo_runs_the_main_job_on_a_local_cluster(smollm2_dir, tmp_path):
    stdout = ok(dfllm("demo", "--max-tokens", "8", "--output", str(tmp_path / "demo"), timeout=400))
    assert "rows:        8 (0 with llm_error)" in stdout
    assert "> Autumn moonlight / a worm digs silently" in stdout
    assert len(pd.read_parquet(tmp_path / "demo")) == 8


def test_gpu_flag_runs_only_on_workers_declaring_gpus(tiny_llama, questions, tmp_path):
    """``--gpu`` on an existing cluster: tasks go to workers started with ``--resources GPU=1``
    (here CPU workers standing in for GPU ones), and only those load the model."""
    from dfllm.worker import engine_cache

    from helpers import CLICluster

    path, _ = questions
    cluster = CLICluster(workers=2, threads=2, resources=["GPU=1", None])
    try:
        ok(
            dfllm(
                "run",
                str(path),
                str(tmp_path / "out"),
                "--prompt",
                "{q}",
                "--model",
                str(tiny_llama),
                "--max-tokens",
                "3",
                "--max-model-len",
                "64",
                "--npartitions",
                "4",
                "--gpu",
                "--scheduler",
                cluster.address,
            )
        )
        info = cluster.client().scheduler_info(n_workers=-1)["workers"]
        loads = cluster.client().run(engine_cache.load_count)
        assert {a: loads[a] for a, w in info.items() if w["resources"].get("GPU")} == {
            a: 1 for a, w in info.items() if w["resources"].get("GPU")
        }
        assert all(loads[a] == 0 for a, w in info.items() if not w["resources"].get("GPU"))
        assert len(pd.read_parquet(tmp_path / "out")) == 10

        # asking for engines of two GPUs where no worker has two is refused before any work
        bad = dfllm(
            "run",
            str(path),
            str(tmp_path / "out2"),
            "--prompt",
            "{q}",
            "--gpu",
            "--scheduler",
            cluster.address,
            "--tensor-parallel-size",
            "2",
        )
        assert bad.returncode == 1 and "no worker of the cluster declares the resource GPU >= 2" in bad.stderr
        assert not (tmp_path / "out2").exists()
    finally:
        cluster.close()


def test_structured_outputs_from_the_command_line(cli_cluster, tiny_llama, questions, tmp_path):
    path, _ = questions
    schema = {
        "type": "object",
        "properties": {
            "answer": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["answer", "n"],
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    common = [
        "--prompt",
        "{q}",
        "--model",
        str(tiny_llama),
        "--max-model-len",
        "128",
        "--npartitions",
        "2",
        "--scheduler",
        cli_cluster.address,
    ]
    ok(
        dfllm(
            "run",
            str(path),
            str(tmp_path / "json"),
            "--json-schema",
            str(tmp_path / "schema.json"),
            "--max-tokens",
            "64",
            *common,
        )
    )
    out = pd.read_parquet(tmp_path / "json", dtype_backend="pyarrow")
    assert str(out["generated_text"].dtype).startswith("struct<answer: string, n: int64>")
    done = out[out["llm_error"].isna()]
    assert len(done) >= 1 and all(0 <= v["n"] <= 99 for v in done["generated_text"])
    assert out.loc[out["q"].isna(), "llm_error"].str.contains("null").all()
    unfinished = out[out["llm_error"].notna() & out["q"].notna()]
    assert unfinished["generated_text"].isna().all()  # never a partial JSON in the column

    ok(dfllm("run", str(path), str(tmp_path / "choice"), "--choice", "yes,no", "--max-tokens", "4", *common))
    labels = pd.read_parquet(tmp_path / "choice")["generated_text"].dropna()
    assert len(labels) == 9 and set(labels) <= {"yes", "no"}

    bad = dfllm("run", str(path), str(tmp_path / "bad"), "--json-schema", "{nope", *common)
    assert bad.returncode == 1 and "--json-schema: not valid JSON" in bad.stderr


def test_gpu_worker_hosts_a_tensor_parallel_engine(tiny_llama, questions, tmp_path):
    """``--gpu --tensor-parallel-size 2`` against a worker declaring ``GPU=2``: that worker
    hosts one engine of two ranks (gloo on CPU here) and its output equals one rank's."""
    from helpers import CLICluster

    path, df = questions
    cluster = CLICluster(workers=1, threads=2, resources=["GPU=2"])
    try:
        stdout = ok(
            dfllm(
                "run",
                str(path),
                str(tmp_path / "out"),
                "--prompt",
                "{q}",
                "--model",
                str(tiny_llama),
                "--max-tokens",
                "4",
                "--max-model-len",
                "64",
                "--npartitions",
                "2",
                "--gpu",
                "--tensor-parallel-size",
                "2",
                "--scheduler",
                cluster.address,
            )
        )
        assert "rows:        10 (1 with llm_error)" in stdout

        def engine_ranks() -> list[int]:  # on the worker: how many ranks answer, per engine
            from dfllm.worker import engine_cache

            return [len(llm.apply_model(lambda model: 0)) for llm in engine_cache.engines()]

        ranks = cluster.client().run(engine_ranks)
        assert list(ranks.values()) == [[2]]  # one engine, answering from two ranks
    finally:
        cluster.close()
    out = pd.read_parquet(tmp_path / "out").sort_values("id")
    good = out[out["llm_error"].isna()]
    llm = LLM(tiny_llama, max_model_len=64, kv_cache_memory_bytes=2**22)
    ref = llm.generate(good["q"].tolist(), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert good["generated_text"].tolist() == [o.outputs[0].text for o in ref]


# ---- exit status: a job whose rows failed is a failed job -------------------------------------------
def run_prompts(tmp_path, prompts: list[str], *args: str, out: str = "out") -> subprocess.CompletedProcess:
    """``dfllm run`` over rows whose ``q`` column holds ``prompts`` (an empty one fails its row)."""
    src = tmp_path / "prompts.parquet"
    if not src.exists():
        pd.DataFrame({"id": [f"row-{i}" for i in range(len(prompts))], "q": prompts}).to_parquet(src)
    return dfllm("run", str(src), str(tmp_path / out), "--prompt", "q", *args)


def test_every_row_failing_exits_3_after_writing_the_output(cli_cluster, tiny_llama, tmp_path):
    common = (
        "--model",
        str(tiny_llama),
        "--max-tokens",
        "2",
        "--max-model-len",
        "64",
        "--npartitions",
        "2",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
    )
    result = run_prompts(tmp_path, [""] * 6, *common)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "rows:        6 (6 with llm_error)" in result.stdout  # the summary as usual
    assert result.stderr.strip().splitlines()[-1] == (
        f"dfllm: error: 6 of 6 rows (100.0%) have llm_error, above --max-error-rate 0.5; "
        f"the output was written to {tmp_path / 'out'}"
    )
    out = pd.read_parquet(tmp_path / "out")
    assert len(out) == 6 and out["llm_error"].notna().all()

    # the same job resumed: the skipped partitions' errors count too; 1.0 accepts any share
    again = run_prompts(tmp_path, [""] * 6, *common, "--resume", "--max-error-rate", "1.0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "rows:        6 (6 with llm_error)" in again.stdout and "0 written, 2 already complete" in again.stdout
    assert "dfllm: error" not in again.stderr


def test_error_rate_at_or_below_the_threshold_exits_0(cli_cluster, tiny_llama, tmp_path):
    common = (
        "--model",
        str(tiny_llama),
        "--max-tokens",
        "2",
        "--max-model-len",
        "64",
        "--npartitions",
        "2",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
        "--resume",
    )
    prompts = ["Why is the sky blue?", "", "Name a river.", "Say hi."]  # one row of four fails
    assert "rows:        4 (1 with llm_error)" in ok(run_prompts(tmp_path, prompts, *common))  # default 0.5
    at_threshold = ok(run_prompts(tmp_path, prompts, *common, "--max-error-rate", "0.25"))
    assert "rows:        4 (1 with llm_error)" in at_threshold
    strict = run_prompts(tmp_path, prompts, *common, "--max-error-rate", "0.2")
    assert strict.returncode == 3
    assert "dfllm: error: 1 of 4 rows (25.0%) have llm_error, above --max-error-rate 0.2" in strict.stderr
    assert len(pd.read_parquet(tmp_path / "out")) == 4


def test_empty_input_is_not_an_error(cli_cluster, tiny_llama, tmp_path):
    stdout = ok(
        run_prompts(
            tmp_path,
            [],
            "--model",
            str(tiny_llama),
            "--max-tokens",
            "2",
            "--max-model-len",
            "64",
            "--max-error-rate",
            "0",
            "--scheduler",
            cli_cluster.address,
            "--no-progress",
        )
    )
    assert "rows:        0 (0 with llm_error)" in stdout
    assert len(pd.read_parquet(tmp_path / "out")) == 0


@pytest.mark.parametrize("rate", ["1.5", "-0.1", "nan", "lots"])
def test_max_error_rate_must_be_a_share(questions, tmp_path, rate, capsys):
    path, _ = questions
    argv = ["run", str(path), str(tmp_path / "out"), "--prompt", "q", "--max-error-rate", rate]
    if rate == "1.5":  # through the real command
        result = dfllm(*argv, timeout=120)
        status, stderr = result.returncode, result.stderr
    else:  # argparse's exit, in this process
        status, stderr = in_process(argv, capsys)
    assert status == 2
    assert stderr.startswith("dfllm: error: argument --max-error-rate: must be")
    assert not (tmp_path / "out").exists()


def test_summary_counts_rows_answered_from_an_identical_row(cli_cluster, tiny_llama, tmp_path):
    """Greedy rows identical to one still in the engine are computed once (one partition, so
    they meet in the same engine at once), and the summary says how many."""
    prompts = ["Why is the sky blue?", "Name a river.", "Why is the sky blue?", "Why is the sky blue?"]
    stdout = ok(
        run_prompts(
            tmp_path,
            prompts,
            "--model",
            str(tiny_llama),
            "--max-tokens",
            "4",
            "--max-model-len",
            "64",
            "--npartitions",
            "1",
            "--scheduler",
            cli_cluster.address,
            "--no-progress",
        )
    )
    assert "rows:        4 (0 with llm_error, 2 answered from an identical row)" in stdout
    out = pd.read_parquet(tmp_path / "out").set_index("id")
    assert (
        out.loc["row-0", "generated_text"] == out.loc["row-2", "generated_text"] == out.loc["row-3", "generated_text"]
    )
