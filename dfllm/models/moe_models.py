"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Each is the Llama decoder stack (:mod:`dfllm.models.llama`) whose feed-forward block is a
:class:`~dfllm.models.moe.SparseMoeBlock` in its sparse layers:

- Mixtral: every layer sparse; routing softmax, top-k, renormalised to sum to one; the
  experts' width is ``intermediate_size``; no attention biases unless ``attention_bias``.
- Qwen2-MoE: experts of ``moe_intermediate_size``, top-k weights renormalised only when
  ``norm_topk_prob``, plus a shared expert gated by ``sigmoid(shared_expert_gate(x))``;
  q/k/v biases (``qkv_bias``, default on); a layer ``i`` listed in ``mlp_only_layers``, or
  with ``(i + 1) % decoder_sparse_step != 0``, has a dense MLP of ``intermediate_size``.
- Qwen3-MoE: as Qwen2-MoE without the shared expert, with Qwen3's per-head q/k RMSNorm and
  ``attention_bias`` on all four projections.
"""

from __future__ import annotations

import torch
from torch import nn

from dfllm.distributed.communication import GroupComm
from dfllm.kernels.backend import KernelOps
from dfllm.models.layers import GatedMLP
from dfllm.models.llama import DecoderLayer, LlamaForCausalLM
from dfllm.models.moe import Read, SparseMoeBlock, expert_weight_destination
from dfllm.models.spec import ModelSpec


class MoECausalLM(LlamaForCausalLM):
    """A Llama-style causal LM whose layers' MLPs come from :meth:`make_mlp`."""

    @classmethod
    def make_layer(cls, spec: ModelSpec, index: int, ops: KernelOps, tp: GroupComm | None) -> nn.Module:
        check_moe_spec(spec)
        return DecoderLayer(spec, *cls.biases(spec), ops, tp, cls.qk_norm, mlp=cls.make_mlp(spec, index, ops, tp))

    @classmethod
    def make_mlp(cls, spec: ModelSpec, index: int, ops: KernelOps, tp: GroupComm | None) -> nn.Module:
        """The feed-forward block of layer ``index``."""
        raise NotImplementedError

    def weight_destination(self, name: str, read: Read) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """The loader's hook for the experts' tensors (see :func:`expert_weight_destination`)."""
        return expert_weight_destination(self, name, read)


class MixtralForCausalLM(MoECausalLM):
    """Mixtral: every layer sparse, top-k weights always renormalised."""

    @classmethod
    def make_mlp(cls, spec: ModelSpec, index: int, ops: KernelOps, tp: GroupComm | None) -> nn.Module:
        return SparseMoeBlock(
            spec.hidden_size, spec.num_experts, spec.num_experts_per_tok, spec.intermediate_size, True, ops, tp
        )


def qwen_moe_mlp(spec: ModelSpec, index: int, ops: KernelOps, tp: GroupComm | None) -> nn.Module:
    """Qwen2-MoE/Qwen3-MoE layer ``index``'s MLP: sparse, or dense in ``mlp_only_layers`` and
    off the ``decoder_sparse_step``."""
    sparse = index not in spec.mlp_only_layers and (index + 1) % spec.decoder_sparse_step == 0
    if not sparse:
        return GatedMLP(spec.hidden_size, spec.intermediate_size, False, ops, tp)
    return SparseMoeBlock(
        spec.hidden_size,
        spec.num_experts,
        spec.num_experts_per_tok,
        spec.moe_intermediate_size,
        spec.norm_topk_prob,
        ops,
        tp,
        shared_intermediate=spec.shared_expert_intermediate_size,
    )


class Qwen2MoeForCausalLM(MoECausalLM):
    """Qwen2-MoE: q/k/v biases (``qkv_bias``), a gated shared expert, optional dense layers."""

    @staticmethod
    def biases(spec: ModelSpec) -> tuple[bool, bool]:
        return (True if spec.qkv_bias is None else spec.qkv_bias), False

    @classmethod
    def make_mlp(cls, spec: ModelSpec, index: int, ops: KernelOps, tp: GroupComm | None) -> nn.Module:
        return qwen_moe_mlp(spec, index, ops, tp)


class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k norms, ``attention_bias``) and Qwen2-MoE's sparse
    blocks without a shared expert."""

    qk_norm = True

    @classmethod
    def make_mlp(cls, spec: ModelSpec, index: int, ops: KernelOps, tp: GroupComm | None) -> nn.Module:
        return qwen_moe_mlp(spec, index, ops, tp)


def check_moe_spec(spec: ModelSpec) -> None:
    """Raise ``ValueError`` naming the config field a mixture-of-experts model lacks."""
    if spec.num_experts <= 0:
        raise ValueError("a mixture-of-experts config needs num_experts (Mixtral: num_local_experts) > 0")
    if spec.num_experts_per_tok <= 0:
        raise ValueError("a mixture-of-experts config needs num_experts_per_tok > 0")
    if spec.decoder_sparse_step <= 0:
        raise ValueError(f"decoder_sparse_step must be positive, got {spec.decoder_sparse_step}")
