"""``dfllm run-batch`` with the reasoning parser, the response cache and the dry run (#35).

- ``--reasoning-parser qwen3`` on the tiny Qwen3 of :mod:`test_reasoning` (a bigram machine
  that writes `` wait so</think> Paris``): chat answers carry the reasoning in
  ``message.reasoning_content`` and the answer alone in ``content`` (null when the reasoning
  never ended), ``chat_template_kwargs`` in a line's body reach the template and the parser,
  completions text stays whole as in vLLM.
- ``--cache``: a rerun answers the deterministic lines from the cache, the engine's
  finished-request count not growing for them.
- ``--dry-run``: lines counted, refused with the real run's reasons, tokens; nothing written.
"""

from __future__ import annotations

import json
import threading

import pandas as pd
import pytest
from distributed import default_client
from transformers import AutoTokenizer

from dfllm import SamplingParams
from dfllm.jobs.batch import BatchOptions
from dfllm.jobs.batch_job import BatchRequests, dry_run_batch, dry_run_rows, run_batch
from dfllm.jobs.cli import main as cli_main
from dfllm.jobs.dry_run import refusal_counts
from dfllm.worker import engine_cache

from reasoning_data import ANSWER, CONV, REASONING, SMALL, ids_of
from run_batch_data import ENGINE, chat, check_line, line, read_jsonl, write_jsonl

pytestmark = pytest.mark.timeout(600)


def bodies(rows: list[dict]) -> dict[str, dict]:
    """Each line by custom_id, ``created`` (the time of answering) left out."""
    out = {}
    for r in rows:
        r = json.loads(json.dumps(r))
        body = r["response"]["body"]
        if body and "created" in body:
            del body["created"]
        out[r["custom_id"]] = r
    return out


def finished_requests(model, engine_kwargs: dict) -> int:
    """Requests the engine of ``(model, engine_kwargs)`` has finished (its finished-request
    histogram's count, as :mod:`test_response_cache` reads it), in this process and, when a
    Dask client is current (a job then runs on its cluster), on every worker; 0 where it is
    not loaded."""

    def count(model: str = str(model), kwargs: dict = engine_kwargs) -> int:
        from dfllm.worker import engine_cache

        entry = engine_cache._engines.get(engine_cache.engine_key(model, kwargs))
        if entry is None or entry.llm.engine is None:
            return 0
        return sum(m.count for m in entry.llm.get_metrics() if m.name == "dfllm_request_generation_tokens")

    try:
        client = default_client()
    except ValueError:
        return count()
    return count() + sum(client.run(count).values())


def run_cli(*argv: str, capsys) -> tuple[int, str, str]:
    status = cli_main(["run-batch", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# ---- reasoning ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_reasoning_parser_splits_chat_answers_and_a_cached_rerun_gives_the_same(
    cli_cluster,
    thinker,  # noqa: F811
    tmp_path,
    capsys,
):
    tok = AutoTokenizer.from_pretrained(thinker)
    rendered = tok.apply_chat_template(CONV, add_generation_prompt=True, tokenize=False)
    greedy = {"temperature": 0}
    rows = [
        line("think", messages=CONV, max_completion_tokens=12, **greedy),
        line("cut-short", messages=CONV, max_completion_tokens=2, **greedy),
        line(
            "no-thinking",
            messages=CONV,
            max_completion_tokens=2,
            chat_template_kwargs={"enable_thinking": False},
            **greedy,
        ),
        # the chat's own prompt as a completion: vLLM's completions text is not split
        line("completion", "/v1/completions", prompt=rendered, max_tokens=12, **greedy),
        line("think-tag", "/v1/completions", prompt="Capital of France:", max_tokens=12, **greedy),
        line(
            "choice",
            "/v1/completions",
            prompt="Capital of France:",
            max_tokens=12,
            structured_outputs={"choice": ["yes", "no"]},
            **greedy,
        ),
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out, cache = tmp_path / "out.jsonl", tmp_path / "cache"
    engine = ["--max-model-len", "128", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(2**22)]
    status, stdout, err = run_cli(
        "-i",
        str(src),
        "-o",
        str(out),
        "--model",
        str(thinker),
        "--reasoning-parser",
        "qwen3",
        "--cache",
        str(cache),
        *engine,
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
        capsys=capsys,
    )
    assert status == 0, err[-3000:]
    assert "lines:       6 (0 failed)" in stdout and "cache:       0 requests answered" in stdout
    got = {g["custom_id"]: g for g in read_jsonl(out)}
    for g in got.values():
        check_line(g)
    body = lambda cid: got[cid]["response"]["body"]  # noqa: E731

    think = body("think")["choices"][0]
    assert think["message"]["reasoning_content"] == think["message"]["reasoning"] == REASONING
    assert think["message"]["content"] == ANSWER and think["finish_reason"] == "stop"
    generated = len(ids_of(tok, REASONING)) + 1 + len(ids_of(tok, ANSWER)) + 1  # </think> and the end token too
    assert body("think")["usage"]["completion_tokens"] == generated
    short = body("cut-short")["choices"][0]
    assert (short["message"]["reasoning_content"], short["message"]["content"], short["finish_reason"]) == (
        REASONING,
        None,
        "length",
    )  # the reasoning never ended: no answer, content null as in vLLM
    off = body("no-thinking")
    assert (off["choices"][0]["message"]["reasoning_content"], off["choices"][0]["message"]["content"]) == (
        None,
        REASONING,
    )  # enable_thinking=False reached the template and the parser: all answer
    assert off["usage"]["prompt_tokens"] > body("think")["usage"]["prompt_tokens"]  # the template closed </think>

    assert body("completion")["choices"][0]["text"] == REASONING + "</think>" + ANSWER
    assert "reasoning_content" not in body("completion")["choices"][0]
    assert body("think-tag")["choices"][0]["text"] == "<think>" + REASONING + "</think>" + ANSWER
    choice = body("choice")["choices"][0]["text"]  # the grammar engaged after the reasoning, as vLLM's does
    assert choice.startswith("<think>" + REASONING + "</think>") and choice.rsplit("</think>", 1)[1] in ("yes", "no")

    # the same file again, with the Python API, from the cache the first run filled: no line reaches the engine
    kwargs = {**SMALL, "reasoning_parser": "qwen3"}
    before = finished_requests(thinker, kwargs)
    again = tmp_path / "again.jsonl"
    summary = run_batch(
        str(src), str(again), model=str(thinker), reasoning_parser="qwen3", cache=str(cache), progress=False, **SMALL
    )
    assert finished_requests(thinker, kwargs) == before  # every line answered without the engine
    assert summary.cache["hits"] == 6 and summary.failed == 0
    assert bodies(read_jsonl(again)) == bodies(read_jsonl(out))


# ---- the response cache --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_rerun_answers_deterministic_lines_from_the_cache(tiny_llama, tmp_path):
    rows = [
        chat("greedy", "What is the capital of France?"),
        chat("seeded", "Tell a story.", temperature=0.8, seed=7),
        line("completion", "/v1/completions", prompt=["Once upon", [1, 2, 3]], max_tokens=3, temperature=0, logprobs=2),
        chat("best-of", "Tell a story.", temperature=0.8, seed=7, n=2),  # n > 1: not cached
        chat("sampled", "Tell a story.", temperature=0.8),  # sampled without a seed: not cached
        "{not json",
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    cache = tmp_path / "cache"
    run = lambda out: run_batch(  # noqa: E731
        str(src),
        str(tmp_path / out),
        model=str(tiny_llama),
        cache=cache,
        progress=False,
        **ENGINE,
    )
    before = finished_requests(tiny_llama, ENGINE)
    first = run("first.jsonl")
    assert finished_requests(tiny_llama, ENGINE) - before == 6  # one request per chat line, one per completion prompt
    assert first.cache == {**first.cache, "hits": 0, "misses": 4, "stored": 4, "bypassed": 2}
    before = finished_requests(tiny_llama, ENGINE)
    second = run("second.jsonl")
    assert finished_requests(tiny_llama, ENGINE) - before == 2  # only the two lines that bypass the cache
    assert (second.cache["hits"], second.cache["misses"], second.cache["bypassed"]) == (4, 0, 2)

    for g in read_jsonl(tmp_path / "second.jsonl"):
        check_line(g)
    a, b = bodies(read_jsonl(tmp_path / "first.jsonl")), bodies(read_jsonl(tmp_path / "second.jsonl"))
    for cid in ("greedy", "seeded", "completion", None):  # ids included: they are the lines' own
        assert a[cid] == b[cid], cid
    assert "reasoning_content" not in a["greedy"]["response"]["body"]["choices"][0]["message"]  # no parser
    assert len(b["best-of"]["response"]["body"]["choices"]) == 2
    assert len(b["completion"]["response"]["body"]["choices"]) == 2


# ---- the dry run -------------------------------------------------------------------------------------------
DRY = [
    chat("a", "What is the capital of France?"),
    "",  # blank: skipped, as the job skips it
    "{not json",
    chat("too-long", "word " * 300),
    line("two-prompts", "/v1/completions", prompt=["Once upon", "A time"], max_tokens=4, temperature=0),
    line("emb", "/v1/embeddings", input="a cat"),
    chat("bad-temperature", "Hi", temperature=-1),
]


@pytest.mark.slow
def test_dry_run_counts_lines_refusals_and_tokens_and_writes_nothing(cli_cluster, tiny_llama, tmp_path, capsys):
    """With --model every line runs on it: the embeddings line is refused as the real run
    refuses it (model_not_supported); the two prompts of a completions line are two requests."""
    src = write_jsonl(tmp_path / "in.jsonl", DRY)
    out = tmp_path / "out.jsonl"
    report = dry_run_batch(str(src), model=str(tiny_llama), output_file=str(out), sample_rows=0, **ENGINE)
    assert (report.rows, report.accepted, report.refused, report.not_estimated) == (6, 3, 4, {})
    assert sorted(refusal_counts(report).values()) == [1, 1, 1, 1]
    # each refused line by its custom_id (else its line number) with the real run's message
    messages = {label: message for r in report.refusals for label, message in r.examples}
    assert sorted(messages) == ["bad-temperature", "emb", "line 3", "too-long"]
    assert messages["line 3"].startswith("the line is not valid JSON")
    assert "This model's maximum context length is 128 tokens. However, your prompt contains" in messages["too-long"]
    assert messages["bad-temperature"].startswith("body.temperature: temperature must be non-negative")
    assert messages["emb"].startswith("Model does not support endpoint /v1/embeddings")
    llm = engine_cache.get_engine(str(tiny_llama), ENGINE)  # the engine the job runs on, for its token counts
    one = SamplingParams(max_tokens=1)
    want = [
        len(
            llm.chat([[{"role": "user", "content": "What is the capital of France?"}]], one, use_tqdm=False)[
                0
            ].prompt_token_ids
        )
    ]
    want += [len(o.prompt_token_ids) for o in llm.generate(["Once upon", "A time"], one, use_tqdm=False)]
    assert report.prompt_tokens == sum(want) and report.max_generated_tokens == 3 + 4 + 4
    assert "nothing was written" in report.format() and "does not exist yet" in report.format()

    status, stdout, err = run_cli(
        "-i",
        str(src),
        "-o",
        str(out),
        "--model",
        str(tiny_llama),
        "--max-model-len",
        "128",
        "--kv-cache-memory-bytes",
        str(2**22),
        "--dry-run",
        "--calibration-seconds",
        "5",
        "--scheduler",
        cli_cluster.address,
        "--no-progress",
        capsys=capsys,
    )
    assert status == 0, err[-3000:]
    assert "rows:             6 in 1 partition(s); 3 would run, 4 refused" in stdout, stdout
    assert "1 x prompt longer than max_model_len (e.g. row 'too-long': " in stdout
    assert f"prompt tokens:    {sum(want)} " in stdout and "estimate:" in stdout and "nothing was written" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no output, no .parts folder


def test_dry_run_without_a_model_leaves_pooling_lines_not_estimated(tiny_llama):
    """Without --model, embeddings, score and rerank lines run on MiniLM, not on the chat
    engine the dry run checks: counted apart, neither run nor refused."""
    rows = pd.DataFrame(
        {
            "block": [0] * len(DRY),
            "line": range(len(DRY)),
            "text": [r if isinstance(r, str) else json.dumps(r) for r in DRY],
            "utf8": [True] * len(DRY),
        }
    )
    rows = dry_run_rows(rows)
    assert list(rows.index) == ["a", "line 3", "too-long", "two-prompts", "emb", "bad-temperature"]
    llm = engine_cache.get_engine(str(tiny_llama), ENGINE)
    source = BatchRequests(BatchOptions(None, tuple(sorted(ENGINE.items()))))
    requests, refused, skipped = source.requests(rows, llm.engine.input_processor, threading.Lock())
    assert len(requests) == 3 and sorted(refused) == [1, 2, 5]
    assert skipped == {4: "embeddings lines (run on all-minilm-l6-v2; a dry run checks chat and completions lines)"}
    assert source.model is None and source.cache_hits(requests, llm.config) is None
