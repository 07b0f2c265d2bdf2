"""Prefix-aware placement on a real cluster (a LocalCluster of two worker processes, one
engine each, the tiny Llama): documents asked several questions, in question order, so
that every partition holds one question about many documents.

Each document's rows are computed on one engine (the engines' prefix-cache counters show
each shared prefix computed once across the cluster), every row comes back once with the
output it gets unrouted, in the input's partitions and order; a job without shared
prefixes is spread evenly; the switch turns it off; a resumable write keeps its key."""

from __future__ import annotations

import json
import time

import dask
import dask.dataframe as dd
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dfllm  # noqa: F401  (registers the accessors)
from dfllm.accessors.partitions import llm_origin
from dfllm.accessors.prefix_placement import METADATA_ROOT, STALE_S, directory_report

from helpers import local_client

pytestmark = pytest.mark.slow

SP = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}
BLOCK = 16
DOCS, QUESTIONS, PARTS = 8, 3, 4
OUT = ["generated_text", "num_input_tokens", "num_generated_tokens", "finish_reason", "llm_error"]


@pytest.fixture(scope="module")
def kw(tiny_llama):
    return dict(model=str(tiny_llama), max_model_len=256, kv_cache_memory_bytes=2**23)


@pytest.fixture(scope="module")
def client():
    with local_client(2) as c:
        yield c


def question_order() -> pd.DataFrame:
    docs = [" ".join(f"doc{d}word{k}" for k in range(40)) for d in range(DOCS)]
    prompts = [f"Document: {doc}\nQuestion {q}: what is it?" for q in range(QUESTIONS) for doc in docs]
    return pd.DataFrame({"doc": [d for _ in range(QUESTIONS) for d in range(DOCS)], "prompt": prompts}).set_index(
        pd.Index(range(1000, 1000 + len(prompts)), name="row")
    )


def computed_tokens(client, kw) -> int:
    """Prompt tokens the cluster's engines computed (prefix-cache queries minus hits)."""

    def read(kw=kw):
        from dfllm.worker import engine_cache

        stats = engine_cache.get_engine(kw["model"], {k: v for k, v in kw.items() if k != "model"}).llm_engine.stats()
        return stats.prefix_cache_queries - stats.prefix_cache_hits

    return sum(client.run(read).values())


def reset(client, kw) -> None:
    def clear(kw=kw):
        from dfllm.worker import engine_cache

        engine_cache.get_engine(kw["model"], {k: v for k, v in kw.items() if k != "model"}).reset_prefix_cache()

    client.run(clear)


def ideal(token_lists) -> int:
    blocks, total = set(), 0
    for ids in {tuple(t) for t in token_lists}:
        full = (len(ids) - 1) // BLOCK
        blocks.update(ids[: i * BLOCK] for i in range(1, full + 1))
        total += len(ids) - full * BLOCK
    return total + len(blocks) * BLOCK


def run(client, kw, frame, on: bool, **extra):
    with dask.config.set({"dfllm.prefix-placement": on}):
        result = dd.from_pandas(frame, npartitions=PARTS, sort=False).llm.generate(
            "prompt", sampling_params=SP, engine_columns=["prompt_token_ids", "num_cached_tokens"], **kw, **extra
        )
    reset(client, kw)
    before = computed_tokens(client, kw)
    out = result.compute()
    return result, out, computed_tokens(client, kw) - before


def test_documents_are_computed_once_across_the_cluster(client, kw):
    frame = question_order()
    dd.from_pandas(frame.head(2), npartitions=1).llm.generate("prompt", sampling_params=SP, **kw).compute()  # load
    off_result, off, off_computed = run(client, kw, frame, on=False)
    on_result, on, on_computed = run(client, kw, frame, on=True)
    assert llm_origin(off_result)[1].placement is None and llm_origin(on_result)[1].placement is not None
    report = directory_report(client, llm_origin(on_result)[1].placement)
    # every row once, in the input's order and partitions, with the output it gets unrouted
    assert on.index.equals(frame.index) and on["doc"].tolist() == frame["doc"].tolist()
    pd.testing.assert_frame_equal(on[OUT], off[OUT])
    assert on_result.map_partitions(len).compute().tolist() == off_result.map_partitions(len).compute().tolist()
    # each shared prefix computed about once across the cluster; per-worker copies without placement
    best = ideal(on["prompt_token_ids"])
    assert best / on_computed >= 0.85, (best, on_computed, off_computed)
    assert on_computed < off_computed
    assert report["partitions"] == PARTS and report["split_rows"] == 0
    work = list(report["work"].values())
    assert len(work) == 2 and max(work) <= 1.2 * sum(work) / 2


def test_a_job_without_shared_prefixes_is_spread_evenly(client, kw):
    """... and a new job drops the directories of jobs idle for STALE_S, keeping live ones."""
    frame = pd.DataFrame(
        {"prompt": [f"item {i}: " + " ".join(f"w{i}x{k}" for k in range(i % 7 + 3)) for i in range(24)]}
    )
    now = time.time()
    client.set_metadata([METADATA_ROOT, "old-job"], {"updated": now - STALE_S - 60, "directory": "{}"})
    client.set_metadata([METADATA_ROOT, "live-job"], {"updated": now - 60, "directory": "{}"})
    result, out, _ = run(client, kw, frame, on=True)
    assert client.get_metadata([METADATA_ROOT, "old-job"]) is None
    assert client.get_metadata([METADATA_ROOT, "live-job"])["directory"] == "{}"
    work = list(directory_report(client, llm_origin(result)[1].placement)["work"].values())
    mean = sum(work) / len(work)
    assert all(abs(w - mean) <= 0.2 * mean for w in work)
    assert out.index.equals(frame.index) and out.llm_error.isna().all()


def test_resume_keeps_the_key_of_the_unrouted_job(client, kw, tmp_path):
    """Placement decides no output: a write with it on is resumed by one with it off (and
    the other way round), every part kept."""
    frame = question_order()
    ddf = dd.from_pandas(frame, npartitions=PARTS, sort=False)
    first = dfllm.write_parquet(
        ddf.llm.generate("prompt", sampling_params=SP, **kw), str(tmp_path / "o"), progress=False
    )
    assert first.written == PARTS
    with dask.config.set({"dfllm.prefix-placement": False}):
        again = ddf.llm.generate("prompt", sampling_params=SP, **kw)
    resumed = dfllm.write_parquet(again, str(tmp_path / "o"), resume=True, progress=False)
    assert resumed.skipped == PARTS and resumed.written == 0
    back = pd.read_parquet(tmp_path / "o")
    assert back.index.tolist() == frame.index.tolist() and back.generated_text.notna().all()


# ---- run-batch ----------------------------------------------------------------------------------
def all_computed(client) -> int:
    """Prompt tokens computed by every generative engine of the cluster's workers."""

    def read():
        from dfllm.worker import engine_cache

        stats = [e.llm_engine.stats() for e in engine_cache.engines() if e.llm_engine is not None]
        return sum(s.prefix_cache_queries - s.prefix_cache_hits for s in stats)

    return sum(client.run(read).values())


def test_run_batch_routes_lines_by_prefix(client, kw, tmp_path):
    """A batch file of documents x questions in question order, with a bad line and an
    embeddings line among them: with placement each document's prefix is computed about once
    across the cluster, and every line's answer is the one it gets unrouted."""
    import json

    frame = question_order()
    lines = [
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "m", "prompt": p, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
            }
        )
        for i, p in enumerate(frame["prompt"])
    ]
    lines.insert(5, "{not json")
    lines.insert(9, json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    engine = {k: v for k, v in kw.items() if k != "model"}
    answers = {}
    computed = {}
    for on in (False, True):
        with dask.config.set({"dfllm.prefix-placement": on}):
            client.run(lambda: __import__("dfllm.worker.engine_cache").worker.engine_cache.release_engines())
            before = all_computed(client)
            out = tmp_path / f"out-{on}.jsonl"
            dfllm.run_batch(
                str(tmp_path / "in.jsonl"), str(out), model=kw["model"], partition_bytes=1500, progress=False, **engine
            )
            computed[on] = all_computed(client) - before
        answers[on] = [json.loads(t) for t in out.read_text().splitlines()]
    ids = [a["custom_id"] for a in answers[True]]
    assert ids == [a["custom_id"] for a in answers[False]] and len(ids) == len(lines)
    strip = [
        (a["custom_id"], a["response"] and a["response"]["status_code"], a["error"] and a["error"]["code"])
        for a in answers[True]
    ]
    assert strip == [
        (a["custom_id"], a["response"] and a["response"]["status_code"], a["error"] and a["error"]["code"])
        for a in answers[False]
    ]
    texts = {
        on: [a["response"]["body"]["choices"][0]["text"] for a in answers[on] if (a["custom_id"] or "").startswith("r")]
        for on in answers
    }
    assert texts[True] == texts[False] and len(texts[True]) == len(frame)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(kw["model"])
    best = ideal(tok(list(frame["prompt"]))["input_ids"])
    assert best / computed[True] >= 0.85 and computed[True] < computed[False], (best, computed)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(),  # odd Unicode, lone surrogates, not JSON
            st.sampled_from(["\ufeff{}", "{}", "[]", "null", "1e999", "9" * 5000, "   "]),
            st.builds(
                lambda url, body: json.dumps({"custom_id": "x", "method": "POST", "url": url, "body": body}),
                st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/nope", 7]),
                st.one_of(
                    st.fixed_dictionaries({"prompt": st.one_of(st.text(), st.integers(), st.lists(st.integers()))}),
                    st.fixed_dictionaries(
                        {"messages": st.one_of(st.text(), st.lists(st.dictionaries(st.text(), st.text())))}
                    ),
                    st.fixed_dictionaries(
                        {"prompt": st.just("hi"), "max_tokens": st.one_of(st.integers(), st.text(), st.floats())}
                    ),
                ),
            ),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_run_batch_keying_takes_hostile_lines(batch_fn, lines):
    """Keying a partition of run-batch lines (before they are routed) never fails: a line it
    cannot key is None, left to its own run to answer with its error; one entry per line."""
    df = pd.DataFrame(
        {
            "text": [t.encode("utf-8", "surrogatepass").decode("utf-8", "replace") for t in lines],
            "utf8": [not any(0xD800 <= ord(c) <= 0xDFFF for c in t) for t in lines],
        }
    )
    keys = batch_fn.prefix_keys(df)
    assert len(keys) == len(df)
    assert all(k is None or (k.keys and k.prompt_tokens >= 1) for k in keys)


@pytest.fixture(scope="module")
def batch_fn(kw):
    from dfllm.jobs.batch_job import BatchFunction, check_options

    return BatchFunction(check_options(kw["model"], {k: v for k, v in kw.items() if k != "model"}))
