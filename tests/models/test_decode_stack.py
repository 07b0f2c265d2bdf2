"""A decode step's layers as one kernel call (dfllm.models.decode_stack): the same bits as the
modules' forward, with each GEMM it takes (dfllm's bfloat16 GEMM on AVX512-BF16, oneDNN's in
bfloat16 on AMX and in float32 everywhere), taken only where it applies, never with a stale
packed weight."""

from __future__ import annotations

import pytest
import torch
from decoder_builders import build_decoder
from transformers import MixtralConfig, Qwen2Config, Qwen3Config

from dfllm import LLM, SamplingParams
from dfllm.models.cpu_linear import packing_available
from dfllm.models.decode_stack import DecodeStack
from dfllm.models.llama import DecoderModel

from helpers import build_tiny_model, random_prompts

# float32 (oneDNN's packed GEMM) on every CPU; bfloat16 where the CPU has bfloat16 matrix
# instructions (dfllm's GEMM on AVX512-BF16, oneDNN's on AMX; elsewhere nothing is packed)
CPU = torch.device("cpu")
DTYPES = [
    pytest.param(dtype, marks=pytest.mark.skipif(not packing_available(CPU, dtype), reason="not packed here"))
    for dtype in (torch.float32, torch.bfloat16)
]


def decoder_models(worker) -> list[DecoderModel]:
    return [m for m in worker.model.modules() if isinstance(m, DecoderModel)]


def stack_calls(worker) -> list[int | None]:
    return [None if m.decode_stack is None else m.decode_stack.calls for m in decoder_models(worker)]


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 10 * (i % 4), logprobs=5) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def with_and_without_stack(path, prompts: list[list[int]], **llm_kwargs) -> tuple[list[tuple], list[tuple]]:
    """``generate``'s outputs through the modules only, then with the stack, each from a fresh
    engine (the scheduler learns how long outputs run, so a second run in one engine may
    preempt other sequences, recomputed by the prefill kernel); the stack must be built and
    taken by some decode-only step."""

    def run(stack: bool) -> list[tuple]:
        llm = LLM(path, **llm_kwargs)
        (decoder,) = decoder_models(llm.engine.runner)
        assert isinstance(decoder.decode_stack, DecodeStack) and decoder.decode_stack.calls == 0
        if not stack:
            decoder.decode_stack = None
        out = generate(llm, prompts)
        if stack:
            assert decoder.decode_stack.calls > 0  # decode-only steps took it
        llm.shutdown()
        return out

    return run(stack=False), run(stack=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,hidden", [(4, 2, 64), (6, 2, 384), (2, 2, 256)])
def test_decode_steps_through_the_stack_equal_the_modules_bit_for_bit(
    tmp_path, smollm2_dir, heads, kv_heads, hidden, dtype
):
    """Greedy tokens and every logprob equal with and without the stack (head dims 16, 64 and
    128; groups of 2, 3 and 1), prefills and mixed steps through the modules, decode-only steps
    through the stack, over a cache too small for every prompt at once."""
    layers = 3
    path = build_tiny_model(tmp_path, smollm2_dir, heads=heads, kv_heads=kv_heads, hidden=hidden, layers=layers)
    token_bytes = 2 * layers * kv_heads * (hidden // heads) * dtype.itemsize  # keys and values
    prompts = random_prompts(12, 3, 60, seed=hidden)
    without, with_stack = with_and_without_stack(
        path, prompts, dtype=dtype, max_model_len=128, kv_cache_memory_bytes=160 * token_bytes
    )
    assert without == with_stack


def randomize_biases_and_qk_norms(model: torch.nn.Module) -> None:
    """transformers initialises biases to zero and norms to one: values that would hide an
    operand left out."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1.0, 0.2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [Qwen2Config, Qwen3Config])
def test_qwen_layers_through_the_stack_equal_the_modules_bit_for_bit(tmp_path, smollm2_dir, config, dtype):
    """Qwen2's qkv biases and Qwen3's per-head q/k RMSNorms (head_dim 32, not hidden / heads)
    in the one call: greedy tokens and every logprob equal with and without it."""
    path = build_decoder(
        tmp_path, smollm2_dir, config, config.model_type, hidden=96, heads=6, kv_heads=2, layers=3,
        head_dim=32, init=randomize_biases_and_qk_norms,
    )  # fmt: skip
    prompts = random_prompts(8, 3, 40, seed=7)
    without, with_stack = with_and_without_stack(path, prompts, dtype=dtype, max_model_len=96)
    assert without == with_stack


def test_models_whose_layers_differ_from_llamas_plain_layer_get_no_stack(tmp_path, smollm2_dir):
    """Mixtral's layers (a mixture of experts for an MLP): the modules' forward only."""
    path = build_decoder(
        tmp_path,
        smollm2_dir,
        MixtralConfig,
        "mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
    )
    llm = LLM(path, dtype="float32", max_model_len=64)
    assert llm.collective_rpc(stack_calls)[0] == [None]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_written_since_packing_sends_the_step_to_the_modules(tmp_path, smollm2_dir, dtype):
    """A packed copy gone stale is never multiplied: the stack declines until the layer is
    packed again (which the modules' forward does)."""
    llm = LLM(build_tiny_model(tmp_path, smollm2_dir), dtype=dtype, max_model_len=64)
    model = llm.engine.runner.model
    (decoder,) = [m for m in model.modules() if isinstance(m, DecoderModel)]
    stack = decoder.decode_stack
    assert isinstance(stack, DecodeStack) and stack._operands(dtype) is not None
    down = decoder.stage_layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight.mul_(2.0)
    assert stack._operands(dtype) is None
    down(torch.ones(1, down.in_features, dtype=dtype))  # the forward packs it again
    assert stack._operands(dtype) is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_stacks_weights_are_taken_once_and_again_whenever_a_layer_changes(tmp_path, smollm2_dir, dtype):
    """Step after step the stack reuses the weights it took (the modules are not walked
    again); a norm or bias replaced, or a KV cache freed and allocated again (sleep mode),
    is what the next step reads, and nothing of a freed cache is held."""
    llm = LLM(build_tiny_model(tmp_path, smollm2_dir), dtype=dtype, max_model_len=64)
    (decoder,) = decoder_models(llm.engine.runner)
    stack = decoder.decode_stack
    assert isinstance(stack, DecodeStack)
    first = stack._operands(dtype)
    assert first is not None
    again = stack._operands(dtype)
    assert again is not None and again.weights is first.weights  # taken once
    layer = decoder.stage_layers[1]
    norm = layer.post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 3, requires_grad=False)
    replaced = stack._operands(dtype)
    assert replaced is not None and replaced.weights[6 + 3] is norm.weight  # layer 1's post-attention norm
    kv_before = [c.data_ptr() for c in replaced.caches]
    llm.sleep(1)  # the KV cache freed: the stack declines and holds none of it
    assert stack._operands(dtype) is None
    assert stack._weights_cache is None or all(
        not isinstance(x, torch.Tensor) or x.data_ptr() not in kv_before for x in stack._weights_cache[2]
    )
    llm.wake_up()
    woken = stack._operands(dtype)
    assert woken is not None
    assert [c.data_ptr() for c in woken.caches] == [c.data_ptr() for c in decoder_caches(decoder)]
    prompts = random_prompts(3, 3, 20, seed=2)
    with_norm = generate(llm, prompts)
    calls = stack.calls
    assert calls > 0
    decoder.decode_stack = None  # the modules' forward, the replaced norm included
    llm.reset_prefix_cache()  # the same prefill computations as the first call's
    assert generate(llm, prompts) == with_norm


def decoder_caches(decoder: DecoderModel) -> list[torch.Tensor]:
    return [c for layer in decoder.stage_layers for c in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
