"""A decode step on a GPU makes no call that synchronises the host with the device, other than
waiting for its one copy of the sampled ids (issue #47: at most one device-to-host transfer a
step, so that the host's work can run while the device computes).

On CUDA, torch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns at every
synchronising call (``.item()``, ``.tolist()`` or ``.cpu()`` of a device tensor, a copy from
pageable host memory, ``nonzero``...), naming the Python line that made it; decode steps of
greedy and seeded sampling, with CUDA graphs and without, synchronously and under
asynchronous scheduling, must make none (the wait for the sampled ids' pinned copy is an
event's, allowed once a step if this torch counts it). On a CPU the same steps run, to keep
the stepping itself tested: every step measured is a decode of the whole batch.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dfllm import LLM, SamplingParams

CUDA = torch.cuda.is_available()
STEPS = 6
PROMPTS = [[5 + i, 17, 23, 99 + i, 42] for i in range(6)]


def _params() -> list[SamplingParams]:
    """Greedy rows and seeded sampled rows, one with log-probabilities."""
    return [
        SamplingParams(
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=None if i % 2 == 0 else 100 + i,
            max_tokens=40,
            ignore_eos=True,
            logprobs=2 if i == 3 else None,
        )
        for i in range(len(PROMPTS))
    ]


def decode_steps(llm: LLM, n: int, during=None) -> list:
    """Bring ``PROMPTS`` to their decodes, then run ``n`` steps inside ``during`` (a context
    manager factory, or none); each of those steps decodes every request. The requests are
    aborted after."""
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params())):
        engine.add_request(str(i), engine.input_processor.process({"prompt_token_ids": prompt}, params))
    while not (
        len(engine.scheduler.running) == len(PROMPTS)
        and all(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running)
    ):
        engine.step()
    engine.step()  # one decode step past the prompts: the graphs' and the sampler's first uses done
    schedules = []
    schedule = engine.scheduler.schedule

    def spy(*args, **kwargs):
        out = schedule(*args, **kwargs)
        schedules.append(list(out.num_new_tokens))
        return out

    engine.scheduler.schedule = spy
    try:
        if during is None:
            for _ in range(n):
                engine.step()
        else:
            with during():
                for _ in range(n):
                    engine.step()
    finally:
        del engine.scheduler.schedule
        engine.abort_request([str(i) for i in range(len(PROMPTS))])
    return schedules


def test_the_measured_steps_are_decodes_of_the_whole_batch(tiny_llama):
    """What the CUDA test below measures, stepped on this machine's device."""
    device = "cuda" if CUDA else "cpu"
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama, device=device, max_model_len=64, async_scheduling=async_scheduling)
        schedules = decode_steps(llm, STEPS)
        assert schedules == [[1] * len(PROMPTS)] * STEPS, schedules
        assert not llm.llm_engine.has_unfinished_requests()
        llm.shutdown()


class _SyncWarnings:
    """Sync debug mode "warn" inside the block; ``found`` the synchronising calls, by line."""

    def __enter__(self):
        torch.cuda.synchronize()
        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        self.found = [
            f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}"
            for w in self.caught
            if "synchroniz" in str(w.message).lower()
        ]


def _event_wait_counts() -> bool:
    """Whether this torch's sync debug mode warns at an event's ``synchronize``."""
    with _SyncWarnings() as w:
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    return bool(w.found)


@pytest.mark.skipif(not CUDA, reason="synchronisation with a CUDA device")
@pytest.mark.parametrize(
    "enforce_eager,async_scheduling", [(False, False), (False, True), (True, False)], ids=["graphs", "async", "eager"]
)
def test_decode_steps_make_no_synchronising_call(tiny_llama, enforce_eager, async_scheduling):
    llm = LLM(
        tiny_llama,
        device="cuda",
        max_model_len=64,
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
    )
    allowed = STEPS if _event_wait_counts() else 0
    box: dict = {}

    def during():
        box["w"] = _SyncWarnings()
        return box["w"]

    schedules = decode_steps(llm, STEPS, during)
    assert schedules == [[1] * len(PROMPTS)] * STEPS
    found = box["w"].found
    assert len(found) <= allowed, "\n".join(found)
    llm.shutdown()
