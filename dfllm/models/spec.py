"""One typed description of a checkpoint: what the model code reads from its ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelSpec:
    """Every field of a Hugging Face config that dfllm reads, with each default decided once
    (in :meth:`from_hf`). A size the config lacks is 0 (such a config is rejected as an
    unsupported architecture before any model is built).

    ``rope_parameters`` holds ``rope_theta`` and ``rope_type`` and, for scaled rope types,
    their parameters (transformers v4 ``rope_scaling`` and v5 ``rope_parameters`` alike).
    ``quantization`` is the ``quant_method`` of a quantized checkpoint ("?" when unnamed).
    """

    architectures: tuple[str, ...]
    dtype: torch.dtype  # the dtype the checkpoint was saved in
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int | None
    hidden_act: str | None
    # decoders
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    rope_parameters: dict
    sliding_window: int | None
    use_sliding_window: bool
    quantization: str | None
    # BERT encoders and classifiers
    type_vocab_size: int
    layer_norm_eps: float
    position_embedding_type: str | None
    num_labels: int
    id2label: dict[int, str]
    # RoBERTa/XLM-R position ids start after pad_token_id; ColBERT projection size
    pad_token_id: int | None = None
    colbert_dim: int | None = None
    model_type: str | None = None  # config.json's model_type (which base an HF_ColBERT checkpoint has)
    # multi-head latent attention (DeepSeek-V2/V3; 0/None elsewhere); ``rope_interleave``: the
    # rope part rotates interleaved pairs (DeepSeek-V2 always, V3 unless its config says not)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    first_k_dense_replace: int = 0  # DeepSeek: the first layers have dense MLPs, the rest MoE
    # DeepSeek's MoE routing: ``topk_method`` (V2: "greedy" or "group_limited_greedy"), expert
    # groups, routed weights' scale, and ``n_shared_experts`` always-on experts
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str | None = None
    n_group: int | None = None
    topk_group: int | None = None
    # mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; 0 experts elsewhere): ``num_experts``
    # (Mixtral's ``num_local_experts``) experts of ``moe_intermediate_size`` (Mixtral: the
    # ``intermediate_size``), ``num_experts_per_tok`` per token; a layer ``i`` is sparse unless
    # listed in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    qkv_bias: bool | None = None  # Qwen2-MoE's own switch for the q/k/v biases (None: not in the config)
    # Gemma 2/3 (and any config with ``layer_types``): each layer's attention kind
    # ("sliding_attention" or "full_attention"); the query scale's base; tanh soft-caps of the
    # attention scores and of the final logits; the MLP activation
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str | None = None
    # a decoder as a classifier from LM-head rows (vLLM's hf_overrides ``classifier_from_token``,
    # resolved to token ids, and ``method``; see ``seq_cls``)
    classifier_token_ids: tuple[int, ...] = ()
    classifier_method: str | None = None
    # vision-language models (LLaVA): the whole config as a dict (vision tower, image token...);
    # every other field describes the text model (``text_config``)
    multimodal: dict | None = None

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> ModelSpec:
        """The spec of a Hugging Face config (never raises for an unknown model family)."""
        if set(getattr(config, "architectures", None) or ()) & VISION_LANGUAGE_ARCHITECTURES:
            return _vision_language_spec(cls, config)
        heads = getattr(config, "num_attention_heads", 0)
        hidden = getattr(config, "hidden_size", 0)
        dtype = config_dtype(config) or torch.float32
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
        window = getattr(config, "sliding_window", None)
        quantization = getattr(config, "quantization_config", None)
        text = getattr(config, "text_config", None)  # a nested config (CLIP, SigLIP): its text tower's sizes
        return cls(
            architectures=tuple(getattr(config, "architectures", None) or ()),
            dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
            vocab_size=getattr(config, "vocab_size", 0) or getattr(text, "vocab_size", 0),
            hidden_size=hidden,
            num_hidden_layers=getattr(config, "num_hidden_layers", 0),
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or (hidden // heads if heads else 0),
            intermediate_size=getattr(config, "intermediate_size", 0),
            max_position_embeddings=(
                getattr(config, "max_position_embeddings", None) or getattr(text, "max_position_embeddings", None)
            ),
            hidden_act=getattr(config, "hidden_act", None),
            rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_parameters=rope,
            sliding_window=window,
            use_sliding_window=bool(getattr(config, "use_sliding_window", window is not None)),
            quantization=quantization.get("quant_method", "?") if quantization else None,
            type_vocab_size=getattr(config, "type_vocab_size", 2),
            layer_norm_eps=getattr(config, "layer_norm_eps", 1e-12),
            position_embedding_type=getattr(config, "position_embedding_type", "absolute"),
            num_labels=getattr(config, "num_labels", 0),
            id2label=dict(getattr(config, "id2label", None) or {}),
            pad_token_id=getattr(config, "pad_token_id", None),
            colbert_dim=(
                getattr(config, "colbert_dim", None)
                or getattr(config, "dim", None)
                or getattr(config, "projection_dim", None)
            ),
            model_type=getattr(config, "model_type", None),
            q_lora_rank=getattr(config, "q_lora_rank", None),
            kv_lora_rank=getattr(config, "kv_lora_rank", None) or 0,
            qk_nope_head_dim=getattr(config, "qk_nope_head_dim", None) or 0,
            qk_rope_head_dim=getattr(config, "qk_rope_head_dim", None) or 0,
            v_head_dim=getattr(config, "v_head_dim", None) or 0,
            rope_interleave=bool(getattr(config, "rope_interleave", True)),
            first_k_dense_replace=getattr(config, "first_k_dense_replace", None) or 0,
            n_shared_experts=getattr(config, "n_shared_experts", None) or 0,
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
            topk_method=getattr(config, "topk_method", None),
            n_group=getattr(config, "n_group", None),
            topk_group=getattr(config, "topk_group", None),
            num_experts=getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0,
            num_experts_per_tok=getattr(config, "num_experts_per_tok", None) or 0,
            moe_intermediate_size=getattr(config, "moe_intermediate_size", None) or 0,
            shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", None) or 0,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
            decoder_sparse_step=getattr(config, "decoder_sparse_step", None) or 1,
            mlp_only_layers=tuple(getattr(config, "mlp_only_layers", None) or ()),
            qkv_bias=getattr(config, "qkv_bias", None),
            layer_types=tuple(getattr(config, "layer_types", None) or ()),
            query_pre_attn_scalar=getattr(config, "query_pre_attn_scalar", None),
            attn_logit_softcapping=getattr(config, "attn_logit_softcapping", None),
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
            hidden_activation=getattr(config, "hidden_activation", None),
            classifier_token_ids=tuple(getattr(config, "classifier_token_ids", None) or ()),
            classifier_method=(
                getattr(config, "method", None) if getattr(config, "classifier_token_ids", None) else None
            ),
        )


def check_parallel_config(spec: ModelSpec, tp: int, pp: int) -> None:
    """Reject sizes the model cannot be split by (each an int >= 1, checked with the engine's
    arguments), naming the count that does not divide."""
    if tp == 1 and pp == 1:
        return
    for what, n in (
        ("attention heads", spec.num_attention_heads),
        ("key/value heads", spec.num_key_value_heads),
        ("MLP intermediate size", spec.intermediate_size),
    ):
        if n % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {n} {what}")
    if pp > spec.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {spec.num_hidden_layers} layers")


# image-text generators: the spec is their text model's, plus the whole config (dfllm.models.llava)
VISION_LANGUAGE_ARCHITECTURES = {
    "LlavaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
}


def config_dtype(config: PretrainedConfig):
    """The checkpoint's dtype as a config holds it (None if unset): ``dtype`` since
    transformers 4.56, whose ``torch_dtype`` alias warns on every read; ``torch_dtype`` before."""
    if hasattr(config, "dtype"):
        return config.dtype
    return getattr(config, "torch_dtype", None)


def _vision_language_spec(cls: type[ModelSpec], config: PretrainedConfig) -> ModelSpec:
    """A vision-language config's spec: its ``text_config``'s, under the top-level architecture,
    dtype and word-embedding tying, with the whole config in ``multimodal``."""
    from dataclasses import replace

    text = cls.from_hf(config.text_config)
    dtype = config_dtype(config) or text.dtype
    return replace(
        text,
        architectures=tuple(config.architectures or ()),
        model_type=config.model_type,
        dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings)),
        multimodal=config.to_dict(),
    )
