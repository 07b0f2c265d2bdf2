"""``dfllm run-batch`` and :func:`dfllm.run_batch`: OpenAI batch files in, OpenAI batch files out.

The lines are those OpenAI and vLLM document (``custom_id``, ``method``, ``url``, ``body``
in; ``id``, ``custom_id``, ``response`` with ``status_code``, ``request_id`` and ``body``,
and ``error`` out), and the bodies are checked with the ``openai`` package's own types.
Real engines, real files (local and an S3 server), real Dask clusters: a worker killed
mid-job, a client killed mid-job and resumed. Malformed lines get their error line and
every other line is answered.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from dfllm import LLM, SamplingParams
from dfllm.engine.detokenizer import Detokenizer
from dfllm.jobs.batch import BatchOptions, Engines, answer
from dfllm.jobs.batch_job import run_batch
from dfllm.jobs.cli import main as cli_main
from dfllm.jobs.openai_batch import parse_line
from dfllm.jobs.openai_requests import ChatCompletionRequest, LineError
from dfllm.worker import engine_cache

from helpers import build_tiny_model, faulty_detokenizer, free_port, local_client
from run_batch_data import ENGINE, chat, check_line, line, read_jsonl, write_jsonl

pytestmark = pytest.mark.timeout(600)
NAN_WORD, NAN_TOKEN = " zebra", 29106  # a token whose embedding the NaN model has as NaN
MARKER_WORD, MARKER_TOKEN = " volcano", 18051  # a token whose requests the faulty detokenizer fails


MIXED = [
    chat("greedy", "What is the capital of France?"),
    line(
        "completion",
        "/v1/completions",
        model="x",
        prompt=["Once upon", [1, 2, 3]],
        max_tokens=2,
        temperature=0,
        echo=True,
    ),
    chat("logprobs", "Say hi.", logprobs=True, top_logprobs=2),
    chat("sampled", "Tell a story.", temperature=0.8, seed=7, n=2, stop=["\n"]),
    chat(
        "schema",
        "Give me a name.",
        max_completion_tokens=6,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "n",
                "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            },
        },
    ),
    "",  # a blank line: skipped, as vLLM does
    chat("streamed", "Hi", stream=True),
    "{not json",
    line("unknown-url", "/v1/responses", input="Hi"),
    chat("typo", "Hi", max_token=3),
    line("bad-role", messages=[{"role": "wizard", "content": "Hi"}]),
    chat("too-long", "word " * 300),
    chat("bad-temperature", "Hi", temperature=-1),
    {"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {}},
    chat("last", "The end."),
]
ERRORS = {
    "streamed": (400, "body.stream", "Request must not be sent in stream mode"),
    None: (400, None, "not valid JSON"),
    "unknown-url": (404, "url", "URL /v1/responses was used. Supported endpoints"),
    "typo": (400, "body.max_token", "body.max_token is not a field"),
    "bad-role": (400, "body.messages[0].role", "role must be one of"),
    "too-long": (400, "body.messages", "This model's maximum context length is 128 tokens. However, your prompt"),
    "bad-temperature": (400, "body.temperature", "temperature must be non-negative"),
    "get": (405, "method", 'method must be "POST"'),
}


@pytest.mark.slow
def test_lines_parse_as_openai_types_and_match_llm_chat(tiny_llama, tmp_path):
    """A mixed file, answered in this process (no cluster): one line per non-blank input
    line, in input order; good lines parse as the ``openai`` types and their text is what
    ``LLM.chat``/``generate`` give for the same request; each bad line's error names its
    line, field and status; ids are the same when the job runs again."""
    src = write_jsonl(tmp_path / "in.jsonl", MIXED)
    out = tmp_path / "out.jsonl"
    summary = run_batch(str(src), str(out), model=str(tiny_llama), progress=False, partition_bytes=400, **ENGINE)
    got = read_jsonl(out)
    want_ids = [r["custom_id"] if isinstance(r, dict) else None for r in MIXED if r != ""]
    assert [g["custom_id"] for g in got] == want_ids
    assert (summary.lines, summary.failed) == (14, len(ERRORS)) and summary.partitions > 3
    assert not (tmp_path / "out.jsonl.parts").exists()
    for g in got:
        check_line(g)
    by_id = {g["custom_id"]: g for g in got}
    for cid, (status, param, words) in ERRORS.items():
        g = by_id[cid]
        assert g["response"]["status_code"] == status and g["error"]["param"] == param, g
        assert words in g["error"]["message"], g["error"]["message"]
    lines_of = {r["custom_id"] if isinstance(r, dict) else None: i + 1 for i, r in enumerate(MIXED) if r != ""}
    assert by_id["too-long"]["error"]["line"] == lines_of["too-long"] == 12  # the blank line counts

    llm = LLM(tiny_llama, **ENGINE)  # the LLM class's chat path, with the request's own params
    for cid in ("greedy", "logprobs", "sampled", "schema", "last"):
        request = parse_line(json.dumps(next(r for r in MIXED if isinstance(r, dict) and r["custom_id"] == cid)))
        assert isinstance(request.request, ChatCompletionRequest)
        ref = llm.chat(
            [request.request.messages],
            request.request.sampling_params(),
            use_tqdm=False,
            **request.request.chat_kwargs(),
        )[0]
        body = by_id[cid]["response"]["body"]
        assert [c["message"]["content"] for c in body["choices"]] == [c.text for c in ref.outputs]
        assert [c["finish_reason"] for c in body["choices"]] == [c.finish_reason for c in ref.outputs]
        assert body["usage"] == {
            "prompt_tokens": len(ref.prompt_token_ids),
            "completion_tokens": sum(len(c.token_ids) for c in ref.outputs),
            "total_tokens": len(ref.prompt_token_ids) + sum(len(c.token_ids) for c in ref.outputs),
        }
        assert body["model"] == str(tiny_llama) and body["choices"][0]["message"]["role"] == "assistant"
    assert len(by_id["sampled"]["response"]["body"]["choices"]) == 2
    top = by_id["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(top) == 3 and all(len(t["top_logprobs"]) == 2 for t in top)
    assert all(t["top_logprobs"][0]["logprob"] >= t["logprob"] for t in top)

    completion = by_id["completion"]["response"]["body"]
    ref = llm.generate(
        ["Once upon", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False
    )
    assert [c["text"] for c in completion["choices"]] == [
        "Once upon" + ref[0].outputs[0].text,
        llm.tokenizer.decode([1, 2, 3]) + ref[1].outputs[0].text,
    ]
    assert [c["index"] for c in completion["choices"]] == [0, 1]

    again = tmp_path / "again.jsonl"
    run_batch(str(src), str(again), model=str(tiny_llama), progress=False, partition_bytes=400, **ENGINE)
    assert [g["id"] for g in read_jsonl(again)] == [g["id"] for g in got]
    assert len({g["id"] for g in got}) == len(got)


@pytest.mark.slow
def test_embeddings_score_and_rerank_on_the_default_model(tmp_path):
    """Without a model, embeddings, score and rerank lines run on the bundled MiniLM: the
    bodies carry what ``LLM.embed``/``score`` give (base64 as OpenAI encodes it), rerank best
    first; a chat line on an embedding model is refused as vLLM refuses it."""
    rows = [
        line("emb", "/v1/embeddings", model="text-embedding-3-small", input=["a cat", "stock markets"]),
        line("b64", "/v1/embeddings", input="a cat", encoding_format="base64"),
        line("dims", "/v1/embeddings", input="a cat", dimensions=8),
        line("score", "/v1/score", text_1="a cat", text_2=["a kitten", "tax law"]),
        line("rerank", "/rerank", query="a cat", documents=["tax law", {"text": "a kitten"}, "dogs"], top_n=2),
        line("empty", "/v1/embeddings", input=[""]),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_batch(str(src), str(out), progress=False)
    run_batch(
        str(write_jsonl(tmp_path / "chat.jsonl", [chat("chat", "Hi")])),
        str(tmp_path / "chat-out.jsonl"),
        model="all-minilm-l6-v2",
        progress=False,
    )
    got = {g["custom_id"]: g for g in read_jsonl(out) + read_jsonl(tmp_path / "chat-out.jsonl")}
    for g in got.values():
        check_line(g)
    ref = LLM("all-minilm-l6-v2")
    vectors = [o.outputs.embedding for o in ref.embed(["a cat", "stock markets"], use_tqdm=False)]
    emb = got["emb"]["response"]["body"]
    np.testing.assert_allclose([d["embedding"] for d in emb["data"]], vectors, atol=1e-5)
    assert emb["usage"]["prompt_tokens"] > 0 and emb["model"] == "all-minilm-l6-v2"
    decoded = np.frombuffer(base64.b64decode(got["b64"]["response"]["body"]["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vectors[0], atol=1e-5)
    assert got["dims"]["error"]["param"] == "body.dimensions"
    s = [d["score"] for d in got["score"]["response"]["body"]["data"]]
    want = [o.outputs.score for o in ref.score("a cat", ["a kitten", "tax law"], use_tqdm=False)]
    np.testing.assert_allclose(s, want, atol=1e-5)
    results = got["rerank"]["response"]["body"]["results"]
    assert len(results) == 2 and results[0]["document"] == {"text": "a kitten"} and results[0]["index"] == 1
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert got["empty"]["response"]["status_code"] == 400 and "empty" in got["empty"]["error"]["message"]
    assert got["chat"]["error"]["code"] == "model_not_supported"
    assert "Model does not support endpoint /v1/chat/completions" in got["chat"]["error"]["message"]


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory, smollm2_dir):
    """A tiny Llama whose embedding of NAN_TOKEN is NaN: prompts holding it make NaN logits."""
    path = build_tiny_model(tmp_path_factory.mktemp("nan"), smollm2_dir, tie_word_embeddings=False)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][NAN_TOKEN] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def marker_fault(seq):
    """Fails on the second output token of a sequence whose prompt holds MARKER_TOKEN."""
    if seq.num_output_tokens >= 2 and MARKER_TOKEN in seq.token_ids[: seq.num_prompt_tokens]:
        return RuntimeError("cannot decode this request")
    return None


@pytest.mark.slow
def test_engine_failures_stay_with_their_lines(tiny_llama, nan_model):
    """A line whose prompt makes non-finite logits, and one on which an engine step raises,
    get status 500 with the reason; the other lines of the same call are answered with what
    they get alone."""
    good = [
        chat(f"good-{i}", t, max_completion_tokens=4, ignore_eos=True)
        for i, t in enumerate(["What is 2+2?", "Name a colour.", "Tell me about parquet."])
    ]
    lines = [parse_line(json.dumps(r), f"k{i}") for i, r in enumerate(good)]

    def texts(results):
        return [r.body["choices"][0]["message"]["content"] if r.body else None for r in results]

    kwargs = {**ENGINE, "seed": 17}  # an engine of this test's own
    with Engines(BatchOptions(str(tiny_llama), tuple(sorted(kwargs.items())))) as engines:
        alone = texts(answer(lines, engines))
        llm = engine_cache.get_engine(str(tiny_llama), kwargs)
        llm.engine.output_processor.detokenizer = faulty_detokenizer(llm.tokenizer, marker_fault)
        try:
            bad = parse_line(
                json.dumps(chat("bad", f"What is a{MARKER_WORD}?", max_completion_tokens=4, ignore_eos=True)), "kb"
            )
            results = answer([lines[0], bad, lines[1], lines[2]], engines)
        finally:
            llm.engine.output_processor.detokenizer = Detokenizer(llm.tokenizer)
    assert [r.status_code for r in results] == [200, 500, 200, 200]
    assert "cannot decode this request" in results[1].error.message and results[1].error.code == "engine_error"
    assert texts([results[0], results[2], results[3]]) == alone

    with Engines(BatchOptions(str(nan_model), tuple(sorted(ENGINE.items())))) as engines:
        nan = parse_line(json.dumps(chat("nan", f"A{NAN_WORD} here")), "kn")
        results = answer([lines[0], nan], engines)
    assert [r.status_code for r in results] == [200, 500]
    assert "non-finite logits" in results[1].error.message


def test_options_and_paths_are_refused_before_any_work(tiny_llama, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [chat("a", "Hi")])

    def cli(*argv: str) -> tuple[int, str]:
        try:
            status = cli_main(["run-batch", *argv])
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else 1
        return status, capsys.readouterr().err

    status, err = cli("-o", str(tmp_path / "o.jsonl"))
    assert status == 2 and "--input-file" in err
    status, err = cli(
        "-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl"), "--model", str(tiny_llama)
    )
    assert status == 1 and "does not exist" in err
    status, err = cli("-i", str(src), "-o", str(tmp_path / "o.jsonl"), "--trust-remote-code")
    assert status == 1 and "trust_remote_code=True is not supported" in err
    with pytest.raises(ValueError, match="the output file .* is the input file"):
        run_batch(str(src), str(src), model=str(tiny_llama))
    with pytest.raises(ValueError, match="unknown engine argument"):
        run_batch(str(src), str(tmp_path / "o.jsonl"), model=str(tiny_llama), max_model_length=5)
    with pytest.raises(LineError, match="body.n must be an integer"):
        parse_line(json.dumps(chat("x", "Hi", n="2")))
    assert not (tmp_path / "o.jsonl").exists()


# ---- on a cluster ------------------------------------------------------------------------------------------
def dfllm(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dfllm.jobs.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_cli_on_a_cluster_unordered_with_an_error_file(cli_cluster, tiny_llama, tmp_path):
    """``dfllm run-batch`` with vLLM's flags on a running cluster, ``--unordered
    --error-file``: the answered lines in the output, the failed ones in the error file
    (OpenAI's style), exit status 3 above ``--max-error-rate``; the same answers as the
    job in input order with every line in one file (vLLM's style)."""
    rows = [r for r in MIXED if r != ""]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    good, errors = tmp_path / "good.jsonl", tmp_path / "errors.jsonl"
    result = dfllm(
        "run-batch",
        "-i",
        str(src),
        "-o",
        str(good),
        "--error-file",
        str(errors),
        "--unordered",
        "--model",
        str(tiny_llama),
        "--max-model-len",
        "128",
        "--kv-cache-memory-bytes",
        str(2**22),
        "--partition-bytes",
        "300",
        "--max-error-rate",
        "0.2",
        "--port",
        "8000",
        "--disable-log-requests",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
    )
    assert result.returncode == 3 and "failed, above --max-error-rate 0.2" in result.stderr, result.stderr[-3000:]
    assert f"lines:       {len(rows)} ({len(ERRORS)} failed)" in result.stdout
    split = read_jsonl(good) + read_jsonl(errors)
    assert all(g["error"] is None for g in read_jsonl(good)) and len(read_jsonl(errors)) == len(ERRORS)
    for g in split:
        check_line(g)

    out = tmp_path / "out.jsonl"
    with cli_cluster.client().as_current():
        run_batch(str(src), str(out), model=str(tiny_llama), partition_bytes=300, progress=False, **ENGINE)
    ordered = read_jsonl(out)
    assert [g["custom_id"] for g in ordered] == [r["custom_id"] if isinstance(r, dict) else None for r in rows]

    def key(g: dict) -> tuple:  # the same line, id and outcome (logprobs may differ in the last digits)
        return g["id"], g["custom_id"], g["response"]["status_code"], json.dumps(g["error"])

    assert sorted(map(key, split)) == sorted(map(key, ordered))


LONG = {"max_completion_tokens": 300, "ignore_eos": True}  # hundreds of decode steps per line


def slow_file(path: Path, n: int) -> tuple[Path, int]:
    """``n`` slow chat lines of equal length, and the partition size that puts one or two
    lines (never none) in each partition."""
    rows = [chat(f"r{i}", f"Fact number {i} about rivers.", **LONG) for i in range(n)]
    write_jsonl(path, rows)
    return path, len(json.dumps(rows[0])) + 2


@pytest.mark.slow
def test_job_survives_a_killed_worker(tiny_llama, tmp_path):
    """A LocalCluster worker killed while the job runs: its partitions run again elsewhere
    and every line is answered exactly once, in order."""
    n = 6
    src, size = slow_file(tmp_path / "in.jsonl", n)
    out = tmp_path / "out.jsonl"
    staged = tmp_path / "out.jsonl.parts"
    with local_client(workers=2, threads=1) as client:
        result: dict = {}

        def job() -> None:
            try:
                result["summary"] = run_batch(
                    str(src), str(out), model=str(tiny_llama), progress=False, partition_bytes=size, max_model_len=400
                )
            except BaseException as exc:  # reported below
                result["error"] = exc

        thread = threading.Thread(target=job)
        thread.start()
        end = time.time() + 240
        while not list(staged.glob("part.*.parquet")) and time.time() < end and thread.is_alive():
            time.sleep(0.05)
        assert thread.is_alive(), result
        victim = sorted(client.run(os.getpid).values())[0]
        os.kill(victim, signal.SIGKILL)
        thread.join(timeout=400)
    assert "error" not in result, result.get("error")
    summary = result["summary"]
    assert (summary.lines, summary.failed, summary.partitions) == (n, 0, n - 1)
    got = read_jsonl(out)
    assert [g["custom_id"] for g in got] == [f"r{i}" for i in range(n)]
    assert all(g["response"]["body"]["usage"]["completion_tokens"] == 300 for g in got)


@pytest.mark.slow
def test_killed_client_resumes_answering_each_line_once(cli_cluster, tiny_llama, tmp_path):
    """The ``dfllm run-batch`` client killed mid-job, then run again with ``--resume``: the
    partitions it finished are kept (not recomputed), and the output holds each line once,
    in order; no output appears from the killed run."""
    # twelve partitions of one or two lines: however fast the machine, the client dies (two
    # parts written, at most two more running) with most of them unstarted
    n = 12
    src, size = slow_file(tmp_path / "in.jsonl", n)
    out = tmp_path / "out.jsonl"
    staged = tmp_path / "out.jsonl.parts"
    args = [
        sys.executable,
        "-m",
        "dfllm.jobs.cli",
        "run-batch",
        "-i",
        str(src),
        "-o",
        str(out),
        "--model",
        str(tiny_llama),
        "--max-model-len",
        "400",
        # a full batch at 1 row: a worker starts no partition beyond its thread's (see
        # dfllm.worker.driver), so some partitions are unstarted when the client dies
        "--max-num-seqs",
        "1",
        "--partition-bytes",
        str(size),
        "--resume",
        "--keep-parts",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
    ]
    job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.time() + 240
    while len(list(staged.glob("part.*.parquet"))) < 2 and time.time() < end:
        assert job.poll() is None, job.stderr.read()[-2000:]
        time.sleep(0.05)
    job.kill()
    job.wait()
    time.sleep(1.0)  # tasks already running may still finish their (atomic) parts
    done = {p.name: p.stat().st_mtime_ns for p in staged.glob("part.*.parquet")}
    assert 2 <= len(done) < n - 1 and not out.exists()
    result = subprocess.run(args, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    skipped = int(result.stdout.split("computed, ")[1].split(" already")[0])
    assert skipped >= len(done)
    for name, mtime in done.items():
        assert (staged / name).stat().st_mtime_ns == mtime
    got = read_jsonl(out)
    assert [g["custom_id"] for g in got] == [f"r{i}" for i in range(n)] and all(g["error"] is None for g in got)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# ---- object storage ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; yields storage options and an s3fs."""
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
    ).create_bucket(Bucket="batch")
    yield opts, s3fs.S3FileSystem(**opts)
    server.stop()


@pytest.mark.slow
def test_s3_in_and_out(s3, tiny_llama, tmp_path):
    opts, fs = s3
    rows = [chat(f"r{i}", f"Question {i}?") for i in range(5)] + ["{broken"]
    fs.put(str(write_jsonl(tmp_path / "in.jsonl", rows)), "batch/in.jsonl")
    summary = run_batch(
        "s3://batch/in.jsonl",
        "s3://batch/out/results.jsonl",
        error_file="s3://batch/out/errors.jsonl",
        model=str(tiny_llama),
        storage_options=opts,
        progress=False,
        partition_bytes=200,
        **ENGINE,
    )
    assert (summary.lines, summary.failed) == (6, 1)
    fs.invalidate_cache()
    good = [json.loads(t) for t in fs.cat_file("batch/out/results.jsonl").decode().splitlines()]
    bad = [json.loads(t) for t in fs.cat_file("batch/out/errors.jsonl").decode().splitlines()]
    assert [g["custom_id"] for g in good] == [f"r{i}" for i in range(5)]
    assert len(bad) == 1 and bad[0]["error"]["line"] == 6 and bad[0]["custom_id"] is None
    assert not fs.exists("batch/out/results.jsonl.parts")
