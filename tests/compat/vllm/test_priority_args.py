"""vLLM's ``scheduling_policy`` and ``priority=``: the arguments, as vLLM V1 takes them.

``LLM(scheduling_policy="priority")`` is accepted and carried in ``EngineConfig``; the
``priority=`` of ``generate``/``chat``/``enqueue``/``enqueue_chat`` (an int for all, or a
list with one per prompt) reaches each request in the engine. Under the default "fcfs" any
priority is accepted and changes nothing, as in vLLM's current ``LLM``. The order the
scheduler then gives them is tested with the scheduler.
"""

from __future__ import annotations

import pytest

from dfllm import LLM, InvalidRequestError, SamplingParams
from dfllm.config import EngineConfig
from dfllm.engine_args import EngineArgs

ENGINE = dict(max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=2**22)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "Numbers: 1 2 3"]
CONV = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fcfs(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


@pytest.fixture(scope="module")
def prio(tiny_llama):
    return LLM(tiny_llama, scheduling_policy="priority", **ENGINE)


def test_policy_is_in_the_engine_config(tiny_llama, fcfs, prio):
    assert fcfs.config.scheduling_policy == "fcfs" and prio.config.scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy='lottery'"):
        LLM(tiny_llama, scheduling_policy="lottery")
    with pytest.raises(ValueError, match="scheduling_policy='lottery'"):
        EngineConfig.create(EngineArgs(tiny_llama, scheduling_policy="lottery"))


@pytest.mark.parametrize("call", ["generate", "chat", "enqueue", "enqueue_chat"])
def test_fcfs_accepts_any_priority(fcfs, call):
    args = {
        "generate": (PROMPTS,),
        "chat": ([CONV, CONV, CONV],),
        "enqueue": (PROMPTS,),
        "enqueue_chat": ([CONV, CONV, CONV],),
    }[call]
    kw = {"use_tqdm": False} if call in ("generate", "chat") else {}
    for priority in ([0, 2, 0], -1, 0):
        assert len(getattr(fcfs, call)(*args, GREEDY, priority=priority, **kw)) == 3
    fcfs.wait_for_completion(use_tqdm=False)
    assert fcfs.engine.get_num_unfinished_requests() == 0


def test_priority_list_must_match_the_prompts(prio):
    for bad in ([1, 2], [1, 2, 3, 4], []):
        with pytest.raises(InvalidRequestError, match="got .* priorities for 3 prompts"):
            prio.generate(PROMPTS, GREEDY, priority=bad, use_tqdm=False)
    for bad in (["1", 2, 3], 1.5, [True, 0, 0]):
        with pytest.raises(InvalidRequestError, match="priority"):
            prio.generate(PROMPTS, GREEDY, priority=bad, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="got 2 priorities for 1 prompts"):
        prio.enqueue(PROMPTS[0], GREEDY, priority=[1, 2])
    assert prio.engine.get_num_unfinished_requests() == 0


def test_priorities_reach_the_engines_requests(prio):
    low = prio.enqueue(PROMPTS[:2], GREEDY, priority=[5, -3])
    same = prio.enqueue(PROMPTS[2], GREEDY, priority=7)
    chat = prio.enqueue_chat([CONV], GREEDY, priority=[2])
    plain = prio.enqueue("Yet another prompt", GREEDY)  # distinct prompts: identical ones may be deduplicated
    got = {rid: prio.engine.requests[rid].priority for rid in low + same + chat + plain}
    assert got == {low[0]: 5, low[1]: -3, same[0]: 7, chat[0]: 2, plain[0]: 0}
    outs = prio.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == low + same + chat + plain  # enqueue order, whatever ran first


def test_priority_scheduling_gives_the_same_greedy_outputs(fcfs, prio):
    want = [o.outputs[0].token_ids for o in fcfs.generate(PROMPTS, GREEDY, use_tqdm=False)]
    got = prio.generate(PROMPTS, GREEDY, priority=[3, 1, 2], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want  # in input order
    chats = prio.chat([CONV, CONV], GREEDY, priority=[1, 0], use_tqdm=False)
    assert chats[0].outputs[0].token_ids == chats[1].outputs[0].token_ids


def test_lower_priority_values_run_first(tiny_llama):
    """One sequence at a time: the queued requests start in (priority, arrival) order."""
    one = LLM(tiny_llama, max_model_len=128, max_num_seqs=1, scheduling_policy="priority")
    prompts = [f"Request number {i} says" for i in range(5)]
    priorities = [3, 0, 2, 0, -1]
    ids = one.enqueue(prompts, GREEDY, priority=priorities)
    outs = {o.request_id: o for o in one.wait_for_completion(use_tqdm=False)}
    started = sorted(ids, key=lambda rid: outs[rid].metrics.first_scheduled_time)
    assert [priorities[ids.index(rid)] for rid in started] == [-1, 0, 0, 2, 3]
    assert started[1:3] == [ids[1], ids[3]]  # equal priorities in arrival order
