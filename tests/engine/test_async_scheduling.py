"""Asynchronous scheduling (vLLM's ``async_scheduling``): each step is scheduled and launched
before the last step's tokens reach the host, the runner reading those tokens on the device.
It must give the synchronous loop's tokens, text, log-probabilities and finish reasons through
everything that touches a step's order: preemption, the prefix cache, chunked prefill, stop
strings and token ids, penalties, seeded sampling with ``n`` > 1, structured outputs, LoRA, the
static buffers of CUDA graphs, and a step that raises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dfllm import LLM, LoRARequest, SamplingParams
from dfllm.engine import step_inputs
from dfllm.structured_outputs import StructuredOutputsParams

from helpers import faulty_detokenizer, make_adapter, random_prompts

# a KV cache of 24 blocks of 16 tokens for 6 sequences of up to ~110 tokens: preemption; a
# token budget of 48: long prompts are prefilled in chunks beside the decodes
TIGHT = dict(
    max_model_len=256,
    max_num_seqs=6,
    max_num_batched_tokens=48,
    block_size=16,
    kv_cache_memory_bytes=24 * 16 * 512,  # 512 bytes a token: 2 layers x keys and values x 2 heads of 16 floats
    seed=7,
)


def _pair(model, **kw) -> dict[bool, LLM]:
    return {mode: LLM(str(model), async_scheduling=mode, **kw) for mode in (False, True)}


@pytest.fixture(scope="module")
def pair(tiny_llama):
    llms = _pair(tiny_llama, **TIGHT)
    assert llms[True].engine.async_scheduling and not llms[False].engine.async_scheduling
    return llms


def _view(outputs, approx: bool = False) -> list:
    """Everything a request's output says, but its timings, how much of its prompt the prefix
    cache held (which depends on what ran before it, in either mode), and the last bits of its
    log-probabilities (kept to 1e-4: the steps' batches differ, and with them the rounding of
    the LM head's products: ``approx`` on one side); which tokens, their ranks and text exactly."""

    def close(x: float | None):
        return pytest.approx(x, abs=1e-4) if approx and x is not None else x

    def lp(dicts):
        return (
            None
            if dicts is None
            else [
                None if d is None else {t: (close(v.rank), v.decoded_token, close(v.logprob)) for t, v in d.items()}
                for d in dicts
            ]
        )

    return [
        [
            (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, lp(c.logprobs), close(c.cumulative_logprob))
            for c in o.outputs
        ]
        + [o.prompt_token_ids, lp(o.prompt_logprobs)]
        for o in outputs
    ]


@pytest.fixture
def fills(monkeypatch) -> list[int]:
    """How many input rows each step took from the device (the tokens in flight)."""
    counts: list[int] = []
    real = step_inputs.fill_pending

    def count(input_ids, rows, source, prev):
        counts.append(rows.numel())
        return real(input_ids, rows, source, prev)

    monkeypatch.setattr(step_inputs, "fill_pending", count)
    return counts


params_st = st.builds(
    dict,
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
    seed=st.integers(0, 5),
    max_tokens=st.integers(1, 40),
    min_tokens=st.sampled_from([0, 0, 1]),
    n=st.sampled_from([1, 1, 2]),
    stop=st.sampled_from([None, ["e"], [" the", "a"]]),
    stop_token_ids=st.sampled_from([None, [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]),
    ignore_eos=st.booleans(),
    logprobs=st.sampled_from([None, 0, 3]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    shared=st.integers(0, 40),
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=14),
    params=st.lists(params_st, min_size=1, max_size=14),
)
def test_async_steps_give_the_synchronous_outputs(pair, fills, shared, lengths, params):
    """Prompts sharing a prefix (the prefix cache), long ones prefilled in chunks, more of them
    than the KV cache holds at once (preemption), greedy and seeded requests with stops,
    penalties, log-probabilities and ``n`` > 1: the same outputs either way."""
    prefix = random_prompts(1, shared, shared, seed=shared)[0][:shared] if shared else []
    prompts = [
        {"prompt_token_ids": prefix + p[:n]} for p, n in zip(random_prompts(len(lengths), 61, 61, seed=3), lengths)
    ]
    sps = [
        SamplingParams(
            **(
                params[i % len(params)]
                | {"n": 1 if params[i % len(params)]["temperature"] == 0 else params[i % len(params)]["n"]}
            )
        )
        for i in range(len(prompts))
    ]
    fills.clear()
    got = _view(pair[True].generate(prompts, sps, use_tqdm=False), approx=True)
    assert sum(fills) > 0 or all(sp.max_tokens == 1 for sp in sps)  # tokens were read on the device
    assert got == _view(pair[False].generate(prompts, sps, use_tqdm=False))
    for llm in pair.values():
        assert not llm.engine.has_unfinished_requests() and llm.engine.in_flight is None


def test_preemption_and_prefix_hits_happen_under_async_steps(pair, fills):
    """The workload above does exercise preemption and the prefix cache, with tokens in flight."""
    prompts = [{"prompt_token_ids": random_prompts(1, 40, 40, seed=1)[0] + p} for p in random_prompts(12, 3, 9, seed=2)]
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    before = {m: llm.engine.scheduler.num_preemptions for m, llm in pair.items()}
    got = pair[True].generate(prompts, sp, use_tqdm=False)
    want = pair[False].generate(prompts, sp, use_tqdm=False)
    assert _view(got, approx=True) == _view(want)
    assert pair[True].engine.scheduler.num_preemptions > before[True]
    assert any(o.num_cached_tokens > 0 for o in got) and sum(fills) > 0


def test_outputs_come_one_step_later_and_every_request_finishes(pair):
    """``step()`` returns a step's finished requests on the call after it; nothing is lost."""
    engine = pair[True].engine
    ids = pair[True].enqueue(
        [{"prompt_token_ids": p} for p in random_prompts(5, 3, 9, seed=4)],
        SamplingParams(max_tokens=3, ignore_eos=True),
    )
    seen = []
    calls = 0
    while engine.has_unfinished_requests():
        seen += [o.request_id for o in engine.step()]
        calls += 1
    assert sorted(seen) == sorted(ids) and engine.in_flight is None
    assert calls == 4  # prefill, two decodes (each also finishing the step before), then the last tokens


def test_structured_outputs_and_logprobs_match(tiny_llama):
    llms = _pair(tiny_llama, max_model_len=256, max_num_seqs=4, seed=1)
    so = StructuredOutputsParams(regex="(yes|no)-[0-9]{2,5}!")
    sps = [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=so, logprobs=2),
        SamplingParams(temperature=1.0, seed=4, max_tokens=20, structured_outputs=so),
        SamplingParams(temperature=0, max_tokens=12, logprobs=1, prompt_logprobs=2),
    ]
    prompts = ["Answer:", "Is it?", "Say something"] * 2
    outs = {m: llm.generate(prompts, sps * 2, use_tqdm=False) for m, llm in llms.items()}
    assert _view(outs[True], approx=True) == _view(outs[False])
    assert all(o.outputs[0].text.endswith("!") for o in outs[True][:2])


@pytest.mark.slow
def test_lora_steps_match(tmp_path, tiny_llama):
    adapters = {
        name: LoRARequest(name, i + 1, str(make_adapter(tiny_llama, tmp_path / name, i + 1, 8, ["q_proj", "v_proj"])))
        for i, name in enumerate(["a", "b"])
    }
    llms = _pair(tiny_llama, enable_lora=True, max_loras=2, max_model_len=128, max_num_seqs=4, seed=2)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 5, 20, seed=9)]
    loras = [adapters["a"], None, adapters["b"], adapters["a"], None, adapters["b"]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    got = {m: llm.generate(prompts, sp, lora_request=loras, use_tqdm=False) for m, llm in llms.items()}
    assert _view(got[True], approx=True) == _view(got[False])


def test_a_failing_step_reruns_as_the_synchronous_loop_does(tiny_llama):
    """A detokenizer that raises on one request's fourth token: under async scheduling the error
    surfaces while the next step is launched; the engine drops the step in flight, re-runs
    each call's requests on their own, and the good requests come back as without the fault."""
    marker = 777

    def fault(seq):
        if seq.num_output_tokens >= 4 and marker in seq.token_ids[: seq.num_prompt_tokens]:
            return RuntimeError("cannot decode")
        return None

    got = {}
    for mode, llm in _pair(tiny_llama, max_model_len=128, max_num_seqs=4, seed=3).items():
        llm.engine.output_processor.detokenizer = faulty_detokenizer(llm.tokenizer, fault)
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        good = llm.enqueue([{"prompt_token_ids": p} for p in random_prompts(3, 5, 9, seed=5)], sp)
        with pytest.raises(RuntimeError, match="cannot decode"):
            llm.generate([{"prompt_token_ids": [marker, 40, 41]}], sp, use_tqdm=False)
        got[mode] = _view(llm.wait_for_completion(use_tqdm=False), approx=mode)
        assert len(got[mode]) == len(good) and llm.engine.in_flight is None
    assert got[True] == got[False]


@pytest.mark.slow
def test_static_buffers_read_the_tokens_in_flight(tiny_llama):
    """The CUDA graphs' static buffers (set up without capture on a CPU, the padded path run
    eagerly through Triton's interpreter) take the tokens in flight as the eager step does."""
    kw = dict(
        dtype=torch.float32,
        attention_backend="triton",
        max_model_len=64,
        max_num_seqs=4,
        kv_cache_memory_bytes=1 << 20,
        compilation_config={"cudagraph_capture_sizes": [2, 4]},
        enforce_eager=True,
    )
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, 5, 9, seed=7)]
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]
    want = LLM(str(tiny_llama), **kw).generate(prompts, sp, use_tqdm=False)
    llm = LLM(str(tiny_llama), async_scheduling=True, **kw)
    graphs = llm.engine.runner.setup_decode_graphs(capture=False)
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert graphs is not None and graphs.replays > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_async_scheduling_defaults_and_refusals(tiny_llama, llava_dir):
    assert not LLM(str(tiny_llama), max_model_len=64).engine.async_scheduling  # a CPU: nothing to overlap
    with pytest.raises(ValueError, match="async_scheduling=True.*several ranks"):
        LLM(str(tiny_llama), async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling=True.*vision-language"):
        LLM(str(llava_dir), async_scheduling=True)
