"""Decoders as sequence classifiers and cross-encoders (rerankers), as vLLM loads them.

Two kinds of checkpoint:

- a ``*ForSequenceClassification`` checkpoint: the decoder and a ``score.weight`` head of
  ``num_labels`` rows, applied to the last token's hidden state;
- a causal LM used as a reranker through ``hf_overrides`` (vLLM's recipe for the original
  Qwen3-Reranker): ``classifier_from_token`` names tokens of the vocabulary, and the head is
  built from the LM head's rows of those tokens. With ``method="from_2_way_softmax"`` (set by
  ``is_original_qwen3_reranker``) two tokens ``[false, true]`` give one label whose weight is
  ``lm_head[true] - lm_head[false]`` (float32), so the score ``sigmoid`` of its logit is
  ``softmax([logit_false, logit_true])[true]``; with ``method="no_post_processing"`` each
  token's LM-head row is one label.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig

from dfllm.distributed.parallel_state import ParallelContext
from dfllm.kernels.backend import KernelOps
from dfllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from dfllm.models.pooler import pool
from dfllm.models.qwen3 import Qwen3ForCausalLM
from dfllm.models.spec import ModelSpec

METHODS = ("from_2_way_softmax", "no_post_processing")


def adapt_seq_cls_config(hf_config: PretrainedConfig, path: Path) -> PretrainedConfig:
    """vLLM's config update for a decoder loaded as a classifier: ``is_original_qwen3_reranker``
    sets ``method="from_2_way_softmax"``; a ``method`` with ``classifier_from_token`` sets
    ``num_labels`` (1 for the 2-way softmax) and ``classifier_token_ids`` (the tokens' ids in
    the model directory's tokenizer). Other configs are returned unchanged."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        if not isinstance(tokens, list | tuple) or len(tokens) != 2:
            raise ValueError(
                "is_original_qwen3_reranker needs hf_overrides classifier_from_token with two tokens "
                f"(e.g. ['no', 'yes']), got {tokens!r}"
            )
        hf_config.method = "from_2_way_softmax"
    method = getattr(hf_config, "method", None)
    if method is None:
        return hf_config
    if method not in METHODS:
        raise ValueError(f"hf_overrides method {method!r} is not supported (supported: {', '.join(METHODS)})")
    if not isinstance(tokens, list | tuple) or not tokens or (method == METHODS[0] and len(tokens) != 2):
        raise ValueError(
            f"method {method!r} needs classifier_from_token "
            f"({'two tokens' if method == METHODS[0] else 'a list of tokens'}), got {tokens!r}"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"classifier_from_token {unknown} are not tokens of {path.name}'s vocabulary")
    hf_config.num_labels = 1 if method == METHODS[0] else len(tokens)
    hf_config.classifier_token_ids = ids
    return hf_config


class DecoderClassifierMixin(LlamaForCausalLM):
    """A decoder whose ``classify`` maps the last token's hidden state to label logits; listed
    first among the bases of a classifier, before the decoder family it classifies with."""

    score: nn.Module | None

    def __init__(self, spec: ModelSpec, ops: KernelOps, max_positions: int, parallel: ParallelContext | None = None):
        super().__init__(spec, ops, max_positions, parallel)
        self.token_ids, self.method = spec.classifier_token_ids, spec.classifier_method
        if self.token_ids and spec.tie_word_embeddings:
            self.score = None  # the head's rows are read from the (tied) embedding when classifying
        else:
            self.lm_head = None
            self.score = nn.Linear(spec.hidden_size, spec.num_labels, bias=False)

    def _token_head(self, rows: torch.Tensor) -> torch.Tensor:
        """The classifier weight from the LM head's ``rows`` of the classifier tokens (float32)."""
        picked = rows[list(self.token_ids)].float()
        return picked[1:2] - picked[0:1] if self.method == METHODS[0] else picked

    def weight_destination(self, name: str, read) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """An untied LM head fills the classifier head with its token rows (the loader's hook)."""
        if self.token_ids and self.score is not None and name == "lm_head.weight":
            weight = cast(torch.Tensor, self.score.weight)
            return "score.weight", weight.data, self._token_head(read(None)).to(weight.dtype)
        return None

    def classify(self, hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Label logits (float32) of right-padded ``hidden`` ``[batch, length, h]`` at each row's
        last ``valid`` token."""
        last = pool(hidden, valid, "LAST").float()
        if self.score is None:
            assert self.lm_head is not None
            return last @ self._token_head(cast(torch.Tensor, self.lm_head.weight)).T
        return last @ cast(torch.Tensor, self.score.weight).float().T


class Qwen3ForSequenceClassification(DecoderClassifierMixin, Qwen3ForCausalLM):
    """Qwen3 as a sequence classifier or (Qwen3-Reranker through ``hf_overrides``) a cross-encoder."""


class Qwen2ForSequenceClassification(DecoderClassifierMixin, Qwen2ForCausalLM):
    """Qwen2 as a sequence classifier or cross-encoder."""


class LlamaForSequenceClassification(DecoderClassifierMixin, LlamaForCausalLM):
    """Llama (and Mistral) as a sequence classifier or cross-encoder."""
