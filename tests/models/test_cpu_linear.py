"""The decoders' packed linear layers (dfllm.models.cpu_linear.PackableLinear): equal to
``F.linear`` up to float rounding, and never stale after the weight changes; the encoders'
(PackedLinear) apply a GELU once, fused or after the GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dfllm import LLM, SamplingParams
from dfllm.kernels.gemm import bf16_linear_torch
from dfllm.models import cpu_linear
from dfllm.models.cpu_linear import PackableLinear, bf16_gemm_isa, own_gemm_applies, pack_linears, repack_linears

from helpers import build_tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")


@pytest.mark.parametrize("rows", [1, 3, 64, 200, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = PackableLinear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    plain = F.linear(x, layer.weight, layer.bias)
    assert layer.pack() and layer._packed is not None
    out = layer(x)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)


def test_in_place_writes_and_replacements_repack():
    torch.manual_seed(0)
    layer = PackableLinear(32, 48)
    x = torch.randn(5, 32)
    layer.pack()
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place write the version counter sees
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(48, 32))  # a new tensor: its storage moved
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_not_packed_where_onednn_cannot_take_it():
    layer = PackableLinear(16, 16).to(torch.float16)
    assert not layer.pack() and layer._packed is None
    x = torch.randn(2, 16, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.skipif(bf16_gemm_isa() is None, reason="this CPU has no bfloat16 matrix instructions")
@pytest.mark.parametrize("rows", [1, 64, 300, 1024])
def test_bfloat16_packed_at_every_size_where_the_cpu_has_bf16_instructions(rows, monkeypatch):
    """bfloat16 layers go through the packed oneDNN GEMM at any batch (prefill chunks too),
    equal to F.linear's bfloat16 result up to bfloat16 rounding."""
    torch.manual_seed(rows)
    layer = PackableLinear(96, 160, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    assert layer.pack() and layer._packed is not None
    calls = []
    real = cpu_linear._packed_linear
    monkeypatch.setattr(cpu_linear, "_packed_linear", lambda *a: calls.append(1) or real(*a))
    out = layer(x)
    assert calls, "the packed GEMM did not run"
    torch.testing.assert_close(
        out.float(), F.linear(x.float(), layer.weight.float(), layer.bias.float()), rtol=2e-2, atol=2e-2
    )


@pytest.mark.skipif(
    not own_gemm_applies(torch.zeros(1, dtype=torch.bfloat16)), reason="dfllm's bfloat16 GEMM is not used on this CPU"
)
def test_bfloat16_layers_take_dfllms_gemm_when_asked_and_never_go_stale():
    """On a CPU with AVX512-BF16 and no AMX, ``pack_linears(own_gemm=True)`` (what the engine
    does with its CPU kernels) lays bfloat16 weights out for dfllm's GEMM: float32 and float16
    layers keep theirs, the results equal the float32 products rounded once (up to the order
    of additions), and a written or replaced weight is laid out again."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        PackableLinear(96, 160, bias=True).to(torch.bfloat16),
        PackableLinear(160, 33).to(torch.bfloat16),
        PackableLinear(32, 32),
    )
    assert pack_linears(model, own_gemm=True) == 3
    assert [m._gemm for m in model] == ["dfllm", "dfllm", "onednn"]
    x = torch.randn(2, 7, 96, dtype=torch.bfloat16)

    def close(layer, x):
        want = bf16_linear_torch(x, layer.weight, layer.bias).float()
        assert (layer(x).float() - want).abs().max().item() <= 2**-7 * want.abs().max().item()

    close(model[0], x)
    with torch.no_grad():
        model[1].weight.mul_(-2)  # seen by the version counter: laid out again
    close(model[1], torch.randn(5, 160, dtype=torch.bfloat16))
    model[1].weight = torch.nn.Parameter(torch.randn(33, 160, dtype=torch.bfloat16))
    close(model[1], torch.randn(5, 160, dtype=torch.bfloat16))
    assert model[1]._gemm == "dfllm"
    model[1].float()  # no longer bfloat16: oneDNN's float32 GEMM again
    x32 = torch.randn(4, 160)
    torch.testing.assert_close(model[1](x32), F.linear(x32, model[1].weight, model[1].bias), rtol=1e-5, atol=1e-5)
    assert model[1]._gemm == "onednn"
    assert pack_linears(torch.nn.Sequential(PackableLinear(8, 8).to(torch.bfloat16))) == 1  # not asked: oneDNN


def test_a_model_whose_copies_exceed_the_memory_budget_is_not_packed():
    model = torch.nn.Sequential(PackableLinear(64, 64), PackableLinear(64, 32))
    size = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("weight"))
    assert pack_linears(model, budget_bytes=size - 1) == 0
    assert all(m._packed is None for m in model)
    repack_linears(model)  # packs only what was packed: nothing
    assert all(m._packed is None for m in model)
    assert pack_linears(model, budget_bytes=size) == 2
    with torch.no_grad():
        model[0].weight.data.mul_(2)  # through .data: invisible to the version counter
    repack_linears(model)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)


def test_weights_written_through_data_by_an_rpc_callable_are_served(tmp_path, smollm2_dir):
    """vLLM's RLHF recipes write ``param.data`` in a ``collective_rpc`` callable; ``.data``
    has its own version counter, so only the refresh after the callable keeps this right."""
    a = build_tiny_model(tmp_path, smollm2_dir, seed=1)
    llm = LLM(a, max_model_len=64, kv_cache_memory_bytes=2**21)
    assert llm.collective_rpc(lambda w: pack_linears(w.model)) != [0]  # the decoder's linears are packed here
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    prompt = {"prompt_token_ids": [5, 9, 200, 31, 7]}

    def logprob():
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, out.cumulative_logprob

    before = logprob()

    def scale_mlp(worker):
        for name, p in worker.model.named_parameters():
            if "layers.0.mlp" in name:
                p.data.mul_(3.0)

    llm.collective_rpc(scale_mlp)
    after = logprob()

    def stale(worker) -> float:  # runs before this callable's own refresh
        return max(
            (m(torch.ones(2, m.in_features)) - F.linear(torch.ones(2, m.in_features), m.weight, m.bias))
            .abs()
            .max()
            .item()
            for m in worker.model.modules()
            if isinstance(m, PackableLinear)
        )

    assert after != before
    assert llm.collective_rpc(stale)[0] < 1e-4  # every packed copy matches its updated weight


@pytest.mark.parametrize("fused", [True, False])
def test_an_encoders_gelu_is_applied_once_fused_into_the_gemm_or_after_it(fused, monkeypatch):
    """A BERT MLP's first layer, packed (as the pooling engine packs encoders): where
    ``gelu_fusion_pays`` oneDNN applies the exact GELU (``fused_activation == "gelu"``),
    elsewhere the layer applies it after the GEMM; either way GELU(x W^T + b), once."""
    from transformers import BertConfig

    from dfllm.models.bert import BertIntermediate
    from dfllm.models.spec import ModelSpec

    monkeypatch.setattr(cpu_linear, "gelu_fusion_pays", lambda: fused)
    spec = ModelSpec.from_hf(
        BertConfig(vocab_size=50, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=96)
    )
    torch.manual_seed(0)
    mlp = BertIntermediate(spec).eval()
    x = torch.randn(37, 64)
    with torch.inference_mode():
        want = F.gelu(F.linear(x, mlp.dense.weight, mlp.dense.bias))
        cpu_linear.prepack_linears(mlp)
        assert isinstance(mlp.dense, cpu_linear.PackedLinear)
        assert mlp.dense.fused_activation == ("gelu" if fused else None)
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
