"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers, and the
fused-MoE kernels: the grouped PyTorch path against a naive per-token loop, the Triton kernel
against the PyTorch one (through Triton's interpreter on a CPU)."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from decoder_builders import GREEDY, build_decoder, greedy
from fidelity import (
    check_logprobs_close,
    dfllm_greedy_logprobs,
    hf_greedy_logprobs,
    token_ids,
)
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from dfllm import LLM, SamplingParams
from dfllm.distributed.communication import GroupComm
from dfllm.distributed.parallel_state import ParallelConfig, ParallelContext
from dfllm.kernels.backend import TORCH_OPS, select_ops
from dfllm.kernels.fused_moe import fused_moe_torch, route_topk
from dfllm.models.loader import load_config, load_weights, update_weights
from dfllm.models.moe import SparseMoeBlock
from dfllm.models.moe_models import MixtralForCausalLM
from dfllm.models.spec import ModelSpec

from helpers import random_prompts

# 4 experts, top-2, 2 layers; each family with its own routing normalisation and layer plan
FAMILIES = {
    # every layer sparse, top-k renormalised; experts of intermediate_size
    "mixtral": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    # top-k not renormalised (norm_topk_prob False), shared expert; layer 0 dense (sparse step 2)
    "qwen2_moe": (
        Qwen2MoeConfig,
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
        ),
    ),
    # q/k norms, head_dim 24, top-k renormalised; layer 1 dense (mlp_only_layers)
    "qwen3_moe": (
        Qwen3MoeConfig,
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            head_dim=24,
            mlp_only_layers=[1],
        ),
    ),
}
MAX_TOKENS = [8, 3, 12, 6]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 5, 40, seed=3)


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("moe")
    return {name: build_decoder(root, smollm2_dir, cls, name, **kw) for name, (cls, kw) in FAMILIES.items()}


@pytest.fixture(scope="module")
def references(models, prompts):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # transformers' experts scatter-add tiny rows: threads only cost here
    try:
        return {name: hf_greedy_logprobs(path, prompts, MAX_TOKENS) for name, path in models.items()}
    finally:
        torch.set_num_threads(threads)


def layer_plan(llm: LLM) -> list[tuple[bool, bool, bool] | None]:
    """Per layer: None for a dense MLP, else ``(renormalize, has a shared expert, experts' w13 rows)``."""
    plan = []
    for layer in llm.engine.runner.model.model.layers:
        block = layer.mlp
        sparse = isinstance(block, SparseMoeBlock)
        plan.append(
            (block.renormalize, block.shared_expert is not None, block.experts.w13_weight.shape[1]) if sparse else None
        )
    return plan


PLANS = {
    "mixtral": [(True, False, 96)] * 2,
    "qwen2_moe": [None, (False, True, 64)],
    "qwen3_moe": [(True, False, 64), None],
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(models, prompts, references, family):
    """Each family's dense and sparse layers and routing normalisation; a 16-token budget
    chunks every prompt beside running decodes (log-prob close to transformers); a repeated
    prompt then hits the prefix cache and gives exactly the same tokens."""
    llm = LLM(models[family], max_num_batched_tokens=16, max_num_seqs=3)
    assert layer_plan(llm) == PLANS[family]
    got = dfllm_greedy_logprobs(llm, prompts, MAX_TOKENS)
    check_logprobs_close(got, references[family], "dfllm", "transformers")
    again = llm.generate(
        [{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=MAX_TOKENS[1], **GREEDY), use_tqdm=False
    )[0]  # 37 tokens: two full blocks cached
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == got[1].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_preemption_keeps_outputs(models, prompts, references, family):
    """A KV cache of 16 four-token blocks cannot hold the batch: sequences are preempted and
    recomputed, and every output equals exactly the roomy engine's (itself log-prob close to
    transformers')."""
    roomy = LLM(models[family], block_size=4, max_model_len=64)
    max_tokens = [20] * len(prompts)
    roomy_out = dfllm_greedy_logprobs(roomy, prompts, max_tokens)
    expected = token_ids(roomy_out)
    head = [o._replace(token_ids=o.token_ids[:n], logprobs=o.logprobs[:n]) for o, n in zip(roomy_out, MAX_TOKENS)]
    check_logprobs_close(head, references[family], "dfllm", "transformers")
    llm = LLM(
        models[family], block_size=4, max_model_len=64, kv_cache_memory_bytes=16 * roomy.engine.runner.block_bytes
    )
    llm.engine.scheduler.reserve_growth = False  # admit as vLLM does, so that the small cache preempts
    assert greedy(llm, prompts, max_tokens) == expected
    assert llm.engine.stats().num_preemptions > 0


def fused_copy(src, dst):
    """A copy of the Mixtral checkpoint ``src`` with its experts fused as transformers v5 holds
    them in memory: ``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)."""
    tensors = load_file(src / "model.safetensors")
    fused = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}.block_sparse_moe"
        w = {
            p: torch.stack([tensors.pop(f"{prefix}.experts.{e}.{p}.weight") for e in range(4)])
            for p in ("w1", "w2", "w3")
        }
        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = w["w2"]
        fused[f"model.layers.{layer}.mlp.gate.weight"] = tensors.pop(f"{prefix}.gate.weight")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({**tensors, **fused}, dst / "model.safetensors")
    return dst


def test_fused_expert_checkpoint_layout(models, prompts, references, tmp_path):
    assert not any(
        ".experts.0." in k for k in load_file(fused_copy(models["mixtral"], tmp_path / "f") / "model.safetensors")
    )
    check_logprobs_close(
        dfllm_greedy_logprobs(LLM(tmp_path / "f"), prompts[:2], MAX_TOKENS[:2]),
        references["mixtral"][:2],
        "dfllm",
        "transformers",
    )


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_expert_weights_split_over_ranks(models, tmp_path, layout):
    """Each of two ranks loads its half of every expert's intermediate features (gate rows, up
    rows, down columns) from either layout; the ranks' partial outputs sum to one rank's."""
    path = models["mixtral"] if layout == "per_expert" else fused_copy(models["mixtral"], tmp_path / "f")
    spec = ModelSpec.from_hf(load_config(path))

    def load(rank):
        parallel = None
        if rank is not None:  # a rank's share, loaded without a process group (no forward runs)
            parallel = ParallelContext(
                rank, ParallelConfig(tensor_parallel_size=2), GroupComm(None, rank, 2, True), None
            )
        model = MixtralForCausalLM(spec, TORCH_OPS, 64, parallel)
        load_weights(model, path)
        return model

    built = [load(None), load(0), load(1)]
    full, *ranks = (m.model.layers[1].mlp.experts for m in built)
    inter = 48
    for r, part in enumerate(ranks):
        cols = slice(r * inter // 2, (r + 1) * inter // 2)
        assert torch.equal(
            part.w13_weight,
            torch.cat([full.w13_weight[:, :inter][:, cols], full.w13_weight[:, inter:][:, cols]], dim=1),
        )
        assert torch.equal(part.w2_weight, full.w2_weight[:, :, cols])
    x = torch.randn(5, 64)
    weights, ids = route_topk(torch.randn(5, 4), 2, True)
    want = fused_moe_torch(x, full.w13_weight, full.w2_weight, weights, ids)
    got = sum(fused_moe_torch(x, p.w13_weight, p.w2_weight, weights, ids) for p in ranks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # an in-memory weight update of one expert reaches rank 1's slice only
    new = torch.randn(64, inter)
    assert update_weights(built[2], [("model.layers.1.block_sparse_moe.experts.2.w2.weight", new)]) == [
        "model.layers.1.mlp.experts.w2_weight"
    ]
    assert torch.equal(ranks[1].w2_weight[2], new[:, inter // 2 :])


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("num_experts_per_tok", 0, "num_experts_per_tok > 0"),
        ("num_experts_per_tok", 5, r"num_experts_per_tok must be in \[1, num_experts=4\], got 5"),
        ("num_experts", 0, "num_local_experts"),
    ],
)
def test_bad_moe_config_names_the_field(models, field, value, match):
    spec = dataclasses.replace(ModelSpec.from_hf(load_config(models["mixtral"])), **{field: value})
    with pytest.raises(ValueError, match=match):
        MixtralForCausalLM(spec, TORCH_OPS, 64)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs a GPU or Triton's interpreter",
)
def test_triton_backend_matches_transformers(models, prompts, references):
    """The whole model on the Triton kernels (fused MoE included): shared expert, dense and sparse layers."""
    llm = LLM(models["qwen2_moe"], attention_backend="triton")
    check_logprobs_close(
        dfllm_greedy_logprobs(llm, prompts[3:], MAX_TOKENS[3:]),
        references["qwen2_moe"][3:],
        "dfllm-triton",
        "transformers",
    )


@pytest.mark.slow
def test_tensor_parallel_matches_one_rank(models, prompts):
    """Two ranks, each with half of every expert's (and the shared expert's) intermediate
    features, give exactly one rank's tokens."""
    one_rank = greedy(LLM(models["qwen2_moe"], max_num_batched_tokens=16), prompts, MAX_TOKENS)
    llm = LLM(models["qwen2_moe"], tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        assert greedy(llm, prompts, MAX_TOKENS) == one_rank
        shapes = llm.apply_model(
            lambda m: (
                tuple(m.model.layers[1].mlp.experts.w13_weight.shape),
                tuple(m.model.layers[1].mlp.experts.w2_weight.shape),
            )
        )
        assert shapes == [((4, 32, 64), (4, 64, 16))] * 2
    finally:
        llm.shutdown()


# ---- kernels ------------------------------------------------------------------------------------------
def naive_moe(x, w13, w2, weights, ids):
    """The definition, one token and one chosen expert at a time (float64)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, k]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def random_moe(tokens, experts, top_k, hidden, inter, dtype, seed=0, skip_expert=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    if skip_expert is not None:  # an expert no token chooses
        logits[:, skip_expert] = -1e4
    return x, w13, w2, logits


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk(renormalize):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.0]])
    weights, ids = route_topk(logits, 2, renormalize)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[1, 2], [2, 3]]
    want = probs.gather(1, ids)
    want = want / want.sum(-1, keepdim=True) if renormalize else want
    torch.testing.assert_close(weights, want)


@pytest.mark.parametrize("tokens,experts,top_k", [(8, 4, 2), (37, 6, 3), (1, 4, 1)])
def test_grouped_path_equals_per_token_loop(tokens, experts, top_k):
    x, w13, w2, logits = random_moe(tokens, experts, top_k, 32, 24, torch.float32, seed=tokens, skip_expert=1)
    weights, ids = route_topk(logits, top_k, renormalize=True)
    assert not (ids == 1).any()
    got = fused_moe_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), naive_moe(x, w13, w2, weights, ids), rtol=0, atol=1e-5)
    assert fused_moe_torch(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs a GPU or Triton's interpreter",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k,inter", [(8, 4, 2, 32), (40, 5, 2, 24)])
def test_triton_fused_moe_equals_reference(dtype, tokens, experts, top_k, inter):
    """8 tokens fit one block per expert; 40 tokens span several blocks of one expert, with
    an unused expert and an intermediate width that is not a power of two."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ops = select_ops("triton", torch.device(device))
    x, w13, w2, logits = random_moe(tokens, experts, top_k, 32, inter, dtype, seed=7, skip_expert=experts - 1)
    weights, ids = route_topk(logits, top_k, renormalize=False)
    args = [t.to(device) for t in (x, w13, w2, weights, ids)]
    got = ops.fused_moe(*args).float().cpu()
    want = TORCH_OPS.fused_moe(*args).float().cpu()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got - want).abs().max() / want.abs().max()).item() < tol
