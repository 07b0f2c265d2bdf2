"""Llama-family decoder (Llama 2/3, SmolLM/SmolLM2, Mistral-style) and Qwen2 (qkv bias).

The two architectures share one implementation: they differ in which projections carry a
bias. The module tree mirrors Hugging Face's names, except that the q/k/v projections and
the gate/up projections are fused into ``qkv_proj`` and ``gate_up_proj``.

Given a :class:`ParallelContext`, a model holds one rank's share: its pipeline stage's
layers (others are empty placeholders, so parameter names keep their layer index) and,
under tensor parallelism, its slice of every layer (see ``parallel_layers``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from dfllm.distributed.communication import GroupComm
from dfllm.distributed.parallel_state import ParallelContext, layer_range
from dfllm.kernels.backend import KernelOps
from dfllm.kernels.kv_cache import KVCacheLayout
from dfllm.kernels.metadata import AttentionMetadata
from dfllm.models.layers import GatedMLP, PagedAttention, RMSNorm, RotaryEmbedding
from dfllm.models.parallel_layers import lm_head, vocab_embedding
from dfllm.models.rope import rope_inv_freq
from dfllm.models.sliding_window import WindowSupport, uniform_window
from dfllm.models.spec import ModelSpec

if TYPE_CHECKING:
    from dfllm.multimodal.processor import ImageTokens

# tensor names of a checkpoint saved from the bare decoder (no ``model.`` prefix)
BARE_PREFIXES = ("embed_tokens.", "layers.", "norm.")

# builds decoder layer ``index`` of a model, given the tensor-parallel group (or None)
LayerFactory = Callable[[int, GroupComm | None], nn.Module]


class StackedLayers(Protocol):
    """A decoder's layers as one call (:class:`dfllm.models.decode_stack.DecodeStack`)."""

    def run(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layers' ``(hidden, residual)`` for the first layer's input, or None where this
        step must take the modules' forward."""
        ...


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals. By default the attention is
    :class:`PagedAttention` (``qk_norm`` adds Qwen3's per-head q/k RMSNorm) and the MLP a
    :class:`GatedMLP`; a family passes its own ``attn`` (DeepSeek's latent attention) or ``mlp``
    (a mixture of experts) instead."""

    def __init__(
        self,
        spec: ModelSpec,
        qkv_bias: bool,
        o_bias: bool,
        ops: KernelOps,
        tp=None,
        qk_norm: bool = False,
        *,
        attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, ops)
        # another attention (MLAttention) has PagedAttention's call and cache attributes
        self.self_attn = (
            cast(PagedAttention, attn)
            if attn is not None
            else PagedAttention(
                h,
                spec.num_attention_heads,
                spec.num_key_value_heads,
                spec.head_dim,
                qkv_bias,
                o_bias,
                ops,
                tp,
                qk_norm_eps=eps if qk_norm else None,
            )
        )
        self.post_attention_layernorm = RMSNorm(h, eps, ops)
        self.mlp = mlp if mlp is not None else GatedMLP(h, spec.intermediate_size, spec.mlp_bias, ops, tp)

    def forward(self, x, residual, cos_sin, meta):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        if meta.lora is not None and isinstance(self.mlp, GatedMLP):  # LoRA adapters of this step
            return self.mlp(x, meta.lora), residual
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """The decoder stack, or one pipeline stage of it: ``stage_layers`` are the layers it runs.

    A first stage embeds the tokens; a later one takes ``intermediate`` (hidden states and
    residual) from the stage before. A last stage returns normed hidden states, the others
    ``(hidden, residual)`` for the next stage. ``make_layer(index, tp)``, when given, builds
    each layer of the stage (a family whose layers differ from :class:`DecoderLayer`).
    """

    def __init__(
        self,
        spec: ModelSpec,
        qkv_bias: bool,
        o_bias: bool,
        ops: KernelOps,
        max_positions: int,
        parallel: ParallelContext | None = None,
        make_layer: LayerFactory | None = None,
    ):
        super().__init__()
        tp = parallel.tp if parallel is not None else None
        n = spec.num_hidden_layers
        self.start, self.end = (0, n) if parallel is None else layer_range(n, parallel.pp_rank, parallel.pp_size)
        first = self.start == 0
        last = self.end == n
        self.embed_tokens = vocab_embedding(spec.vocab_size, spec.hidden_size, tp) if first else None
        self.layers = nn.ModuleList(
            (make_layer(i, tp) if make_layer is not None else DecoderLayer(spec, qkv_bias, o_bias, ops, tp))
            if self.start <= i < self.end
            else nn.Identity()
            for i in range(n)
        )
        # this stage's DecoderLayers (nn.ModuleList's stubs know its items only as Modules)
        self.stage_layers = cast(list[DecoderLayer], list(self.layers)[self.start : self.end])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops) if last else None
        inv_freq, scaling = rope_inv_freq(spec, max_positions)
        self.rotary_emb = RotaryEmbedding(inv_freq, scaling, max_positions)

    # the layers as one kernel call in decode-only steps (dfllm.models.decode_stack), set by the
    # engine on CPU where they allow it
    decode_stack: StackedLayers | None = None

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None):
        if intermediate is None:
            assert self.embed_tokens is not None  # only a first stage runs without intermediate states
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate
        cos_sin = self.rotary_emb(positions)
        # a decode-only step on the CPU kernels: every layer in one call where it applies
        stack = self.decode_stack if residual is None else None
        stacked = stack.run(x, cos_sin, meta) if stack is not None else None
        if stacked is not None:
            x, residual = stacked
        else:
            for layer in self.stage_layers:
                x, residual = layer(x, residual, cos_sin, meta)
        if self.norm is None:
            return x, residual
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Causal LM: ``forward`` gives hidden states, ``compute_logits`` the chosen rows' logits."""

    def __init__(self, spec: ModelSpec, ops: KernelOps, max_positions: int, parallel: ParallelContext | None = None):
        super().__init__()
        qkv_bias, o_bias = self.biases(spec)
        self.model = DecoderModel(
            spec, qkv_bias, o_bias, ops, max_positions, parallel, lambda i, tp: self.make_layer(spec, i, ops, tp)
        )
        tp = parallel.tp if parallel is not None else None
        last = self.model.norm is not None
        self.lm_head = lm_head(spec.vocab_size, spec.hidden_size, tp) if last else None
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.sliding_window = uniform_window(spec)  # Mistral: every layer attends within it
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the loader's hook: checkpoint tensor name -> parameter key (None: not this rank's)
        self.checkpoint_name: Callable[[str], str | None] = self._bare_checkpoint_name
        if parallel is not None and parallel.pp_size > 1:
            self.checkpoint_name = self._stage_checkpoint_name

    @staticmethod
    def biases(spec: ModelSpec) -> tuple[bool, bool]:
        """``(qkv_bias, o_proj_bias)``: Llama puts ``attention_bias`` on all four."""
        return spec.attention_bias, spec.attention_bias

    # Qwen3 and Qwen3-MoE: per-head RMSNorm of q and k before rotary
    qk_norm: bool = False
    # the window of every layer (Mistral), set in __init__ from the spec
    sliding_window: int | None = None

    # ---- capabilities: what the config and the engine read off the class (a family overrides them)
    window_support: WindowSupport = "uniform"  # one window on every layer, handed to the kernels by forward
    supports_cuda_graphs: bool = True  # plain paged attention on every layer (dfllm.engine.cuda_graphs)

    @classmethod
    def kv_cache_layout(cls, spec: ModelSpec, tp_size: int = 1) -> KVCacheLayout:
        """What each layer caches per token on one of ``tp_size`` ranks: its KV heads, keys and values."""
        return KVCacheLayout(spec.num_key_value_heads // tp_size, spec.head_dim)

    @classmethod
    def image_tokens(cls, spec: ModelSpec, tokenizer=None) -> ImageTokens | None:
        """How a prompt holds images (declared by the vision-language classes); None: text only."""
        return None

    @classmethod
    def make_layer(cls, spec: ModelSpec, index: int, ops: KernelOps, tp: GroupComm | None) -> nn.Module:
        """Decoder layer ``index`` (a hook: a family overrides it to change the MLP or attention)."""
        return DecoderLayer(spec, *cls.biases(spec), ops, tp, qk_norm=cls.qk_norm)

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None):
        if self.sliding_window is not None:
            meta = replace(meta, sliding_window=self.sliding_window)
        return self.model(input_ids, positions, meta, intermediate)

    def _bare_checkpoint_name(self, name: str) -> str | None:
        """The parameter key of a checkpoint tensor: a bare decoder's checkpoint (saved from
        ``*Model``, as Qwen3-Embedding is) names its tensors without the ``model.`` prefix."""
        return "model." + name if name.startswith(BARE_PREFIXES) else name

    def _stage_checkpoint_name(self, name: str) -> str | None:
        """A pipeline stage loads only its own tensors (None skips one); a last stage with tied
        embeddings but no embedding layer fills its LM head from the embedding tensor."""
        name = "model." + name if name.startswith(BARE_PREFIXES) else name
        m = self.model
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return name if m.start <= index < m.end else None
        if name.startswith("model.embed_tokens."):
            if m.embed_tokens is not None:
                return name
            tied_head = self.tie_word_embeddings and self.lm_head is not None
            return name.replace("model.embed_tokens.", "lm_head.") if tied_head else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if m.norm is not None else None
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None  # only a last stage computes logits
        return self.lm_head(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on the q, k and v projections only."""

    @staticmethod
    def biases(spec: ModelSpec) -> tuple[bool, bool]:
        return True, False
