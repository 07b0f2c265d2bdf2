"""Identical deterministic requests are computed once; prefix-aware admission changes no output.

The engine is the real one on the tiny Llama; a faulty detokenizer (as in
``test_isolation``) makes a step raise where recovery is tested.
"""

from __future__ import annotations

import random

import pytest

from dfllm import LLM, SamplingParams

from helpers import faulty_detokenizer, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def as_prompts(ids: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in ids]


def dedup_count(llm: LLM) -> int:
    return int(llm.engine.metrics.deduplicated._value.get())


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, max_model_len=128)


@pytest.mark.slow
def test_identical_greedy_requests_are_computed_once(llm, tiny_llama):
    prompts = random_prompts(3, 10, 20, seed=31)
    rows = [prompts[0], prompts[1], prompts[0], prompts[2], prompts[0], prompts[1]]
    before = dedup_count(llm)
    got = llm.generate(as_prompts(rows), GREEDY, use_tqdm=False)
    assert dedup_count(llm) - before == 3
    assert [o.request_id for o in got] == sorted({o.request_id for o in got}, key=[o.request_id for o in got].index)
    plain = LLM(tiny_llama, max_model_len=128, deduplicate_requests=False, enable_prefix_caching=False)
    want = plain.generate(as_prompts(rows), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.prompt_token_ids for o in got] == rows
    for i in (2, 4, 5):  # the copies: everything but the last prompt token came for free
        assert got[i].num_cached_tokens == len(rows[i]) - 1
    got[2].outputs[0].token_ids.append(-1)  # each row owns its output
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_seeded_requests_merge_and_unseeded_sampled_never_do(llm):
    prompt = random_prompts(1, 12, 12, seed=32)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    before = dedup_count(llm)
    a, b = llm.generate(as_prompts(prompt * 2), seeded, use_tqdm=False)
    assert dedup_count(llm) - before == 1 and a.outputs[0].token_ids == b.outputs[0].token_ids
    free = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(as_prompts(prompt * 4), free, use_tqdm=False)
    assert dedup_count(llm) - before == 1  # no merge
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1
    other = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)  # any parameter differs: no merge
    llm.generate(as_prompts(prompt * 2), [GREEDY, other], use_tqdm=False)
    assert dedup_count(llm) - before == 1


def test_aborting_the_leader_hands_its_place_to_a_follower(llm):
    prompt = random_prompts(1, 12, 12, seed=33)[0]
    engine = llm.llm_engine
    request = engine.input_processor.process({"prompt_token_ids": prompt}, GREEDY, "prompt 0")
    for rid in ("lead", "f1", "f2"):
        engine.add_request(rid, request)
    assert engine.get_num_unfinished_requests() == 3
    engine.abort_request(["lead", "f2"])
    assert engine.get_num_unfinished_requests() == 1
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["f1"] and len(outs[0].outputs[0].token_ids) == 6
    assert engine.get_num_unfinished_requests() == 0


class FailOnce:
    """Fails the first sequence that detokenizes a third output token, then works."""

    failed = False

    def __call__(self, seq):
        if seq.num_output_tokens >= 3 and not self.failed:
            self.failed = True
            return RuntimeError("a transient fault")
        return None


def test_followers_survive_a_step_that_raises(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=128)
    fault = FailOnce()
    llm.engine.output_processor.detokenizer = faulty_detokenizer(llm.tokenizer, fault)
    prompts = random_prompts(2, 10, 14, seed=34)
    rows = [prompts[0], prompts[0], prompts[1], prompts[0]]
    got = llm.generate(as_prompts(rows), GREEDY, use_tqdm=False)
    assert fault.failed
    want = LLM(tiny_llama, max_model_len=128, deduplicate_requests=False).generate(
        as_prompts(rows), GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.outputs[0].finish_reason == "length" for o in got)


@pytest.mark.slow
def test_prefix_aware_admission_and_dedupe_change_no_output(tiny_llama):
    """Documents x questions, shuffled, with duplicates, through a KV cache that holds a few
    documents only: the same outputs with ordering and dedupe on as with both off, and prompt
    tokens computed within 15% of the ideal (each document once, each duplicate its last
    token), where first come, first served computes more."""
    rng = random.Random(35)
    docs = random_prompts(6, 48, 48, seed=36)  # three blocks of 16 each
    questions = random_prompts(4, 4, 6, seed=37)
    distinct = [d + q for d in docs for q in questions]
    rows = distinct + rng.sample(distinct, 4)
    rng.shuffle(rows)
    ideal = 48 * len(docs) + sum(len(r) - 48 for r in distinct) + (len(rows) - len(distinct))
    engine = dict(max_model_len=128, block_size=16, max_num_seqs=8, max_num_batched_tokens=128)
    off = LLM(tiny_llama, deduplicate_requests=False, enable_prefix_caching=False, **engine)
    want = [o.outputs[0].token_ids for o in off.generate(as_prompts(rows), GREEDY, use_tqdm=False)]
    cache = dict(kv_cache_memory_bytes=24 * off.llm_engine.runner.block_bytes, **engine)

    def computed(llm):
        outs = llm.generate(as_prompts(rows), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        return sum(len(r) - o.num_cached_tokens for r, o in zip(rows, outs))

    assert computed(LLM(tiny_llama, **cache)) <= 1.15 * ideal
    assert computed(LLM(tiny_llama, prefix_aware_scheduling=False, deduplicate_requests=False, **cache)) > 1.15 * ideal
