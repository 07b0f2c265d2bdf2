"""The engine on its Triton kernels gives the same greedy tokens as on the PyTorch references.

Without a GPU the kernels run in Triton's interpreter, so the model and prompts are tiny.
"""

from __future__ import annotations

import pytest
import torch

from dfllm import LLM, SamplingParams

from helpers import build_tiny_model, random_prompts

pytestmark = pytest.mark.slow


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _session(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """A chunked-prefill batch mixed with decodes, then a prompt that hits the prefix cache."""
    first = _greedy(llm, prompts, [6, 3, 8])
    shared = prompts[0][:40] + [77, 78, 79]
    return first + _greedy(llm, [shared], [5])


@pytest.mark.parametrize("device", ["cuda"] if torch.cuda.is_available() else ["cpu"])
def test_triton_backend_matches_torch_backend(tmp_path, smollm2_dir, device):
    path = build_tiny_model(tmp_path, smollm2_dir, heads=6, kv_heads=2, hidden=48)
    prompts = random_prompts(3, 9, 45, seed=3)
    kwargs = dict(
        device=device, dtype=torch.float32, max_num_seqs=4, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 22
    )
    triton_llm = LLM(path, attention_backend="triton", **kwargs)
    assert triton_llm.engine.runner.ops.name == "triton"
    got = _session(triton_llm, prompts)
    want = _session(LLM(path, attention_backend="torch", **kwargs), prompts)
    assert got == want
