"""Failures stay with the requests that cause them; engines are shared and loaded once.

* Non-finite logits: a tiny model whose embedding row for one token is NaN (tied embeddings
  off), so that exactly the prompts holding that token make NaN. Those requests end with
  ``finish_reason="error"``; every other sequence of the batch, the ones whose decodes read
  padding or stale KV slots included, gives its output alone token for token.
* A step that raises: the engine's real detokenizer replaced by a subclass that fails on
  one request only (its prompt holds a marker token), as a tokenizer bug on some input
  would. The engine, the ``LLM`` class, the accessors' driver and Dask are the real ones.
* On a real Dask cluster of worker processes: concurrent partitions share engine steps,
  and the worker loads the model once however many partitions it runs.
"""

from __future__ import annotations

import logging
import threading
import time

import dask.dataframe as dd
import pandas as pd
import pytest
from safetensors.torch import load_file, save_file

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, SamplingParams
from dfllm.engine.detokenizer import Detokenizer
from dfllm.outputs import RequestFailedError
from dfllm.worker import driver, engine_cache

from helpers import build_tiny_model, faulty_detokenizer

ENGINE = dict(max_model_len=64, kv_cache_memory_bytes=2**22)
SP = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
NAN_WORD, NAN_TOKEN = " zebra", 29106  # the token whose embedding is NaN
MARKER_WORD, MARKER_TOKEN = " volcano", 18051  # the token whose requests the faulty detokenizer fails
GOOD = ["What is 2+2?", "Name a colour.", "Tell me about parquet files."]


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory, smollm2_dir):
    """A tiny Llama (untied embeddings) whose embedding of NAN_TOKEN is NaN."""
    path = build_tiny_model(tmp_path_factory.mktemp("nan"), smollm2_dir, tie_word_embeddings=False)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][NAN_TOKEN] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(smollm2_dir)
    assert t.encode(NAN_WORD, add_special_tokens=False) == [NAN_TOKEN]
    assert t.encode(MARKER_WORD, add_special_tokens=False) == [MARKER_TOKEN]
    return t


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def alone(path, prompts: list, params: SamplingParams, **kw) -> list[list[int]]:
    """Each prompt's output tokens, generated alone in a fresh engine."""
    llm = LLM(path, **ENGINE, **kw)
    return [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


# ---- non-finite logits -------------------------------------------------------------------------------
@pytest.mark.slow
def test_nan_logits_fail_only_their_prompt(nan_model, tok):
    """``generate`` raises naming the prompt whose logits are NaN; the error carries every
    output, and the other prompts' are those they have alone."""
    prompts = [GOOD[0], f"Tell me about a{NAN_WORD}.", GOOD[1], GOOD[2]]
    good = [prompts[i] for i in (0, 2, 3)]
    want = alone(nan_model, good, SamplingParams(**SP))
    llm = LLM(nan_model, **ENGINE)
    with pytest.raises(
        RequestFailedError,
        match=r"1 of 4 requests failed .*prompt 1: the model produced "
        r"non-finite logits \(NaN\) at output token 0",
    ) as info:
        llm.generate(prompts, SamplingParams(**SP), use_tqdm=False)
    outs = info.value.outputs
    assert info.value.failed == [1] and isinstance(info.value, RuntimeError)
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == want
    assert all(outs[i].outputs[0].finish_reason == "length" and outs[i].outputs[0].error is None for i in (0, 2, 3))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(RequestFailedError, match=r"conversation 0: the model produced non-finite logits"):
        llm.chat([[{"role": "user", "content": f"A{NAN_WORD}?"}]], SamplingParams(**SP), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in llm.generate(good, SamplingParams(**SP), use_tqdm=False)] == want


def test_nan_logits_under_asynchronous_scheduling(nan_model, tok):
    """With a step in flight, the NaN row's token (coded -1 on the device by the sampler's
    check) is already the next step's input when the host learns it failed: that step reads
    a valid token for it and drops its output; the failure and every other output are the
    synchronous engine's."""
    prompts = [GOOD[0], f"Tell me about a{NAN_WORD}.", GOOD[1]]
    got = {}
    for mode in (False, True):
        llm = LLM(nan_model, async_scheduling=mode, **ENGINE)
        assert llm.engine.async_scheduling == mode
        with pytest.raises(RequestFailedError, match=r"prompt 1: the model produced non-finite logits \(NaN\)") as info:
            llm.generate(prompts, SamplingParams(**SP), use_tqdm=False)
        got[mode] = [(o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in info.value.outputs]
        assert not llm.engine.has_unfinished_requests()
    assert got[True] == got[False] and got[True][1] == ("error", [])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_nan_in_the_kv_cache_reaches_no_other_sequence(nan_model, backend):
    """A NaN sequence's keys and values never reach another sequence's attention: neither
    as the padding of a shorter block table in a decode group (the NaN prefill runs in the
    same step as the decodes, in the block they would pad with), nor as the stale slots of
    a freed block handed, uncleared, to the next request. Every other output equals its
    output alone; on the CPU kernels and on the PyTorch references."""
    sp = SamplingParams(**SP)
    a, b, c = list(range(100, 140)), [7, 8, 9], [11, 12]  # a: 3 blocks of 16; b and c: 1
    poison = [NAN_TOKEN, 5, 6, 7, 8]
    want = alone(nan_model, [{"prompt_token_ids": p} for p in (a, b, c)], sp, attention_backend=backend)
    llm = LLM(nan_model, attention_backend=backend, **ENGINE)
    engine = llm.engine
    bm = engine.scheduler.bm  # white box: which free block is handed out next

    def add(rid, ids, params=sp):
        engine.add_request(rid, engine.input_processor.process({"prompt_token_ids": ids}, params))

    add("w", [300, 301], SamplingParams(temperature=0.0, max_tokens=1))
    add("a", a)
    add("b", b)
    done = {r.request_id: r for r in engine.step()}
    assert set(done) == {"w"} and next(iter(bm.free)) == 0  # w's block 0 is free again, next in line
    add("p", poison)
    done.update((r.request_id, r) for r in engine.step())  # p prefills in block 0 beside a's and b's decodes
    assert "p" in done and next(iter(bm.free)) == 0  # p failed; its block, NaN in slots 0-4, is next
    add("c", c)  # c takes it: slots 2-4 are masked but stale
    while engine.has_unfinished_requests():
        done.update((r.request_id, r) for r in engine.step())
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # type: ignore[method-assign]
    logging.getLogger("dfllm").addHandler(handler)
    try:
        assert engine.step() == []  # an idle engine's step runs nothing, and nothing fails
    finally:
        logging.getLogger("dfllm").removeHandler(handler)
    assert not warnings, [w.getMessage() for w in warnings]
    outs = {k: r.outputs[0] for k, r in done.items()}
    assert outs["p"].finish_reason == "error" and "non-finite logits (NaN) at output token 0" in outs["p"].error
    assert [outs[k].token_ids for k in "abc"] == want
    assert all(outs[k].finish_reason == "length" for k in "abc")


def test_nan_rows_get_llm_error_in_dataframes(nan_model, tok):
    """In the accessors the NaN row gets the message in ``llm_error`` (and finish_reason
    "error"); every other row its normal output, on pandas and on Dask."""
    texts = [GOOD[0], f"Tell me about a{NAN_WORD}.", GOOD[1], None]
    df = pd.DataFrame({"q": texts})
    want = alone(nan_model, [{"prompt_token_ids": ids(tok, t)} for t in (texts[0], texts[2])], SamplingParams(**SP))
    out = df.llm.generate("q", model=str(nan_model), sampling_params=SP, **ENGINE)
    assert "the model produced non-finite logits (NaN) at output token 0" in out.llm_error[1]
    assert pd.isna(out.generated_text[1]) and out.finish_reason[1] == "error"
    assert out.llm_error[[0, 2]].isna().all() and "is null" in out.llm_error[3]
    assert out.generated_text[[0, 2]].tolist() == [tok.decode(w) for w in want]
    lazy = dd.from_pandas(df, npartitions=2).llm.generate("q", model=str(nan_model), sampling_params=SP, **ENGINE)
    pd.testing.assert_frame_equal(lazy.compute(scheduler="threads"), out, check_dtype=False)
    with pytest.raises(ValueError, match=r"row 1 of the partition: the model produced non-finite logits"):
        df[:3].llm.generate("q", model=str(nan_model), sampling_params=SP, on_error="raise", **ENGINE)


# ---- a step that raises ------------------------------------------------------------------------------
class MarkerFault(RuntimeError):
    pass


def marker_fault(seq):
    """The engine's detokenizer fails on the third output token of any sequence whose prompt
    holds MARKER_TOKEN (the batch is well under way by then)."""
    if seq.num_output_tokens >= 3 and MARKER_TOKEN in seq.token_ids[: seq.num_prompt_tokens]:
        return MarkerFault(f"cannot decode the output of request {seq.request.request_id}")
    return None


@pytest.fixture
def faulty(tiny_llama):
    """An LLM whose detokenizer fails on the requests holding the marker."""
    llm = LLM(tiny_llama, **ENGINE)
    llm.engine.output_processor.detokenizer = faulty_detokenizer(llm.tokenizer, marker_fault)
    return llm


@pytest.mark.slow
def test_failed_step_fails_only_the_call_that_causes_it(faulty, tiny_llama, tok):
    """A step that raises because of an enqueued request: ``generate``'s prompts (greedy and
    seeded) are re-run on their own and come back as they would have; the queued requests
    are re-queued from scratch, and ``wait_for_completion`` returns the good call's outputs
    and raises naming the faulty call's request. And the other way round."""
    params = [SamplingParams(**SP), SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)]
    want = alone(tiny_llama, GOOD[:2], params[0]) + alone(tiny_llama, GOOD[:1], params[1])
    good_queued = faulty.enqueue(GOOD[:2], params[0])
    bad_queued = faulty.enqueue(f"What is a{MARKER_WORD}?", params[0])
    got = faulty.generate([GOOD[0]], params[1], use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[2]
    with pytest.raises(
        RequestFailedError,
        match=rf"1 of 3 requests failed .*request {bad_queued[0]}: the engine "
        rf"failed while serving request {bad_queued[0]}: MarkerFault",
    ) as info:
        faulty.wait_for_completion(use_tqdm=False)
    outs = info.value.outputs
    assert [o.request_id for o in outs] == good_queued + bad_queued and info.value.failed == [2]
    assert [o.outputs[0].token_ids for o in outs[:2]] == want[:2]
    assert not faulty.engine.has_unfinished_requests()

    faulty.enqueue(GOOD[:2], params[0])
    with pytest.raises(MarkerFault):  # generate's own prompt fails on its own: its error, as raised
        faulty.generate([GOOD[0], f"What is a{MARKER_WORD}?"], params[1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in faulty.wait_for_completion(use_tqdm=False)] == want[:2]
    assert not faulty.engine.has_unfinished_requests()


def _hold_driver_until(pending: int, engine) -> threading.Event:
    """Keep the accessors' driver thread busy until ``pending`` tasks have handed it rows,
    so that they all start in the same step; returns the event that releases it early."""
    release = threading.Event()
    busy = threading.Event()

    def hold():
        busy.set()
        deadline = time.monotonic() + 60
        while not release.is_set() and time.monotonic() < deadline:
            if driver.driver().waiting(engine) >= pending:
                return
            time.sleep(0.005)

    threading.Thread(target=lambda: driver.driver().call(hold), daemon=True).start()
    assert busy.wait(30), "the driver thread did not pick up the hold"
    return release


def _run_frames(frames: list[pd.DataFrame], kw: dict) -> list:
    """Each frame's ``.llm.generate`` in its own thread, all starting in the same engine step."""
    llm = engine_cache.get_engine(kw["model"], {k: v for k, v in kw.items() if k != "model"})
    release = _hold_driver_until(len(frames), llm.engine)
    results: list = [None] * len(frames)

    def work(i):
        try:
            results[i] = frames[i].llm.generate("q", sampling_params=SP, **kw)
        except Exception as exc:  # noqa: BLE001
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(frames))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    release.set()
    assert not any(t.is_alive() for t in threads), "a partition hung"
    return results


@pytest.mark.slow
@pytest.mark.parametrize("dedupe", [False, True])
def test_failed_step_fails_only_its_partition(tiny_llama, tok, dedupe):
    """Three partitions in the same steps of one shared engine; a step fails because of a
    row of the second. Only that partition fails (with the error); the others get the
    outputs they have alone, and the engine serves on. With deduplication the third
    partition's rows (and the second's first) follow the first partition's identical ones,
    and still get their own outputs when the failed step is re-run group by group."""
    kw = dict(model=str(tiny_llama), seed=11, deduplicate_requests=dedupe, **ENGINE)  # engines of their own
    llm = engine_cache.get_engine(kw["model"], {k: v for k, v in kw.items() if k != "model"})
    frames = [
        pd.DataFrame({"q": GOOD}),
        pd.DataFrame({"q": [GOOD[0], f"What is a{MARKER_WORD}?"]}),
        pd.DataFrame({"q": GOOD[::-1]}),
    ]
    want = alone(tiny_llama, [{"prompt_token_ids": ids(tok, t)} for t in GOOD], SamplingParams(**SP))
    steps = len(driver.partitions_per_step())
    llm.engine.output_processor.detokenizer = faulty_detokenizer(llm.tokenizer, marker_fault)
    try:
        results = _run_frames(frames, kw)
    finally:
        llm.engine.output_processor.detokenizer = Detokenizer(llm.tokenizer)
    assert (
        isinstance(results[1], RuntimeError)
        and "the engine failed while generating these rows" in str(results[1])
        and "MarkerFault" in str(results[1])
    )
    assert results[0].generated_text.tolist() == [tok.decode(w) for w in want]
    assert results[2].generated_text.tolist() == [tok.decode(w) for w in want[::-1]]
    assert results[0].llm_error.isna().all() and results[2].llm_error.isna().all()
    if not dedupe:  # every row computed: the three partitions did share the failed step
        assert max(driver.partitions_per_step()[steps:]) == 3
    assert not llm.engine.has_unfinished_requests()
    again = pd.DataFrame({"q": GOOD}).llm.generate("q", sampling_params=SP, **kw)
    assert again.generated_text.tolist() == results[0].generated_text.tolist()


def test_rows_being_queued_count_as_in_flight(tiny_llama, monkeypatch):
    """A task handing rows over reads how many rows the engine holds (``rows_in_flight``) to
    decide whether to leave its worker's thread pool while it waits. Rows the driver has taken
    from the hand-over list and is queueing into the engine count too: missed in between, a
    task seceded while the engine was full, and a worker of one thread held three 1-row
    partitions at ``max_num_seqs=2`` (a CI run of the test below)."""
    seen: list[tuple[int, int]] = []
    real_step = driver._step

    def step(queue, subs):  # what a task reading rows_in_flight now would see
        seen.append((queue.rows_in_flight(), sum(len(s.requests) for s in subs)))
        return real_step(queue, subs)

    monkeypatch.setattr(driver, "_step", step)
    df = pd.DataFrame({"q": [f"Question {i}: {GOOD[i % 3]}" for i in range(6)]})
    got = df.llm.generate("q", model=str(tiny_llama), sampling_params=SP, **ENGINE)
    assert got.llm_error.isna().all()
    queued = [(in_flight, new) for in_flight, new in seen if new]
    assert queued and all(in_flight >= new for in_flight, new in queued), queued


# ---- a real cluster of worker processes ------------------------------------------------------------------
@pytest.mark.slow
def test_partitions_share_steps_and_one_model_load_on_a_cluster(tiny_llama):
    """One worker process with four threads runs six partitions: at least one engine step
    served rows of two or more partitions (none would if they ran one after another), the
    worker built exactly one engine (it would count one per partition, or per thread, if
    engines were not shared), and every row gets its serial output. (Two workers, each
    loading once: ``tests/accessors/test_accessors.py::test_dask_generate_on_a_cluster``.)"""
    from distributed import Client, LocalCluster

    kw = dict(model=str(tiny_llama), **ENGINE)
    df = pd.DataFrame({"q": [f"Question {i}: {GOOD[i % 3]}" for i in range(18)]})
    serial = df.llm.generate("q", sampling_params=SP, **kw)
    with (
        LocalCluster(n_workers=1, threads_per_worker=4, processes=True, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        got = dd.from_pandas(df, npartitions=6).llm.generate("q", sampling_params=SP, **kw).compute()
        (shared,) = client.run(driver.partitions_per_step).values()
        (loads,) = client.run(engine_cache.load_count).values()
    assert got.generated_text.tolist() == serial.generated_text.tolist() and got.llm_error.isna().all()
    assert max(shared) >= 2, f"no step served two partitions: {shared}"
    assert loads == 1


@pytest.mark.slow
def test_a_one_thread_worker_keeps_partitions_in_the_engine_up_to_a_full_batch(tiny_llama):
    """A task whose rows leave the engine short of a full batch leaves the worker's thread pool
    while it waits (Dask's secede), so even a worker of one thread starts its next partitions
    and their rows share steps (one after another, no step could serve two). Once the engine
    holds ``max_num_seqs`` rows, the worker starts no more partitions than it has threads:
    with 1-row partitions and ``max_num_seqs=2`` the engine never holds more than 2 of them
    (and does hold 2: one that seceded, one in the thread). Every row comes out once, as
    serially."""
    from distributed import Client, LocalCluster

    df = pd.DataFrame({"q": [f"Question {i}: {GOOD[i % 3]}" for i in range(12)]})
    # rows that take 40 steps (~0.1 s on the tiny model): the next partition's rows arrive while
    # the engine still holds the last one's (with 8 tokens a fast machine could finish them first)
    sp = dict(SP, max_tokens=40)
    for max_num_seqs, npartitions in ((256, 4), (2, 12)):
        kw = dict(model=str(tiny_llama), max_num_seqs=max_num_seqs, **ENGINE)
        serial = df.llm.generate("q", sampling_params=sp, **kw)
        with (
            LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
            Client(cluster) as client,
        ):
            got = dd.from_pandas(df, npartitions=npartitions).llm.generate("q", sampling_params=sp, **kw).compute()
            (shared,) = client.run(driver.partitions_per_step).values()
            (held,) = client.run(driver.partitions_held_per_step).values()
        assert got.generated_text.tolist() == serial.generated_text.tolist() and got.llm_error.isna().all()
        if max_num_seqs == 256:
            assert max(shared) >= 2, f"no step served two partitions: {shared}"
        else:
            assert max(held) == 2, f"partitions held by the engine per step: {held}"
