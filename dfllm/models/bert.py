"""BERT encoders: ``BertModel`` (sentence-transformers embedders) and
``BertForSequenceClassification`` (classifiers and cross-encoders).

A batch comes in right-padded (``input_ids`` ``[batch, length]`` and the ``valid`` mask) and
runs unpadded: its real tokens back to back, ``[tokens, hidden]``, through the embeddings,
every linear layer, LayerNorm, GELU and residual add, and through attention too, which takes
the sequences' offsets (``cu_seqlens``) rather than a mask
(:mod:`dfllm.kernels.encoder_attention`); only the per-token hidden states returned are padded
again, ``[batch, length, hidden]``, zeros at the padding. The module tree mirrors Hugging Face's
names, except that query, key and value are fused into ``qkv_proj``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dfllm.kernels.encoder_attention import encoder_attention_torch
from dfllm.models.spec import ModelSpec

# (qkv [tokens, 3 * hidden], cu_seqlens [sequences + 1], num_heads) -> [tokens, hidden]
EncoderAttention = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def check_bert_config(spec: ModelSpec) -> None:
    """Raise ``ValueError`` for BERT variants dfllm does not implement."""
    kind = spec.position_embedding_type
    if kind != "absolute":
        raise ValueError(f"BERT position_embedding_type {kind!r} is not supported (only 'absolute')")
    if spec.hidden_act not in ACTIVATIONS:
        raise ValueError(f"BERT hidden_act {spec.hidden_act!r} is not supported ({sorted(ACTIVATIONS)})")


class BertEmbeddings(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.hidden_size
        assert spec.max_position_embeddings is not None  # every BERT config names it
        self.word_embeddings = nn.Embedding(spec.vocab_size, h)
        self.position_embeddings = nn.Embedding(spec.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(spec.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=spec.layer_norm_eps)

    def position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Positions of right-padded ``input_ids``: 0, 1, 2, ... (RoBERTa overrides this)."""
        return torch.arange(input_ids.shape[1], device=input_ids.device)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[tokens, hidden]`` of the ``valid`` tokens of right-padded ``input_ids``
        (in row order): the padding is never embedded."""
        positions = self.position_ids(input_ids).expand_as(input_ids)[valid]
        x = self.word_embeddings(input_ids[valid]) + self.token_type_embeddings(token_type_ids[valid])
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.hidden_size
        self.num_heads, self.head_dim = spec.num_attention_heads, h // spec.num_attention_heads
        self.qkv_proj = nn.Linear(h, 3 * h)
        # torch's stubs type nn.Module.__setattr__'s value as Tensor | Module (it takes any value)
        self.qkv_proj.output_sizes = [h, h, h]  # type: ignore[assignment]
        # the attention kernel: the PyTorch reference until the engine picks its backend's
        # (:func:`~dfllm.kernels.backend.encoder_attention_op`)
        self.attend: EncoderAttention = encoder_attention_torch

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), cu_seqlens, self.num_heads)


class BertDenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: the output block after attention and after the MLP."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.self = BertSelfAttention(spec)
        self.output = BertDenseNorm(spec.hidden_size, spec.hidden_size, spec.layer_norm_eps)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, cu_seqlens), x)


class BertIntermediate(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.intermediate_size)
        assert spec.hidden_act is not None  # check_bert_config accepted it
        self.act = ACTIVATIONS[spec.hidden_act]
        # torch's stubs type nn.Module.__setattr__'s value as Tensor | Module (it takes any value)
        self.dense.fusable_activation = "gelu" if spec.hidden_act == "gelu" else None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.dense, "fused_activation", None):
            return self.dense(x)
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attention = BertAttention(spec)
        self.intermediate = BertIntermediate(spec)
        self.output = BertDenseNorm(spec.intermediate_size, spec.hidden_size, spec.layer_norm_eps)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, cu_seqlens)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(spec) for _ in range(spec.num_hidden_layers))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Unpadded hidden states ``[tokens, hidden]`` of sequences at offsets ``cu_seqlens``."""
        for layer in self.layer:
            x = layer(x, cu_seqlens)
        return x


class BertPooler(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    """The encoder; ``forward`` returns per-token hidden states ``[batch, length, hidden]``
    (right-padded, zeros at the padding), computed unpadded (see the module docstring)."""

    packed_modules_mapping = {"query": ("qkv_proj", 0), "key": ("qkv_proj", 1), "value": ("qkv_proj", 2)}
    embeddings_class: type[BertEmbeddings] = BertEmbeddings
    # token_embed: how many leading tokens a model's token head (``token_head``, a ColBERT
    # projection, set by subclasses that have one) drops; bge-m3 drops its CLS token
    token_skip: int = 0

    def __init__(self, spec: ModelSpec, with_pooler: bool = False):
        super().__init__()
        check_bert_config(spec)
        self.embeddings = self.embeddings_class(spec)
        self.encoder = BertEncoder(spec)
        self.pooler = BertPooler(spec) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[batch, length, hidden]`` of right-padded ``input_ids`` whose real
        tokens are ``valid`` (each row's a prefix)."""
        cu_seqlens = F.pad(valid.sum(dim=1).cumsum(dim=0), (1, 0))
        flat = self.encoder(self.embeddings(input_ids, token_type_ids, valid), cu_seqlens)
        hidden = flat.new_zeros(*valid.shape, flat.shape[-1])
        hidden[valid] = flat
        return hidden

    def checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name (``bert.`` prefix, old gamma/beta names);
        None skips it (the pooler of an embedder, which does not use it)."""
        name = name.removeprefix("bert.")
        if name.startswith("pooler.") and self.pooler is None:
            return None
        return _modern_norm_names(name)


class BertForSequenceClassification(nn.Module):
    """BERT with its pooler and a linear head; ``classify`` returns logits ``[batch, num_labels]``."""

    packed_modules_mapping = BertModel.packed_modules_mapping

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.bert = BertModel(spec, with_pooler=True)
        self.classifier = nn.Linear(spec.hidden_size, spec.num_labels)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids, token_type_ids, valid)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        pooler = self.bert.pooler
        assert pooler is not None  # built with_pooler=True
        return self.classifier(pooler(hidden))

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return _modern_norm_names(name)


def use_encoder_attention(model: nn.Module, attend: EncoderAttention) -> None:
    """Run every BERT attention layer of ``model`` through ``attend`` (the engine's kernel)."""
    for module in model.modules():
        if isinstance(module, BertSelfAttention):
            module.attend = attend


def _modern_norm_names(name: str) -> str:
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
