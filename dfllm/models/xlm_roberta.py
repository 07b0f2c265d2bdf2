"""RoBERTa and XLM-RoBERTa encoders: ``XLMRobertaModel``/``RobertaModel`` (embedders such as
bge-m3 and multilingual-e5) and ``XLMRobertaForSequenceClassification``/
``RobertaForSequenceClassification`` (classifiers and cross-encoder rerankers such as
bge-reranker).

The layers are BERT's (:mod:`dfllm.models.bert`); RoBERTa differs in four places:

- position ids count only non-pad tokens and start at ``pad_token_id + 1`` (Hugging Face's
  ``create_position_ids_from_input_ids``), so a model reads at most
  ``max_position_embeddings - pad_token_id - 1`` tokens;
- one token type (``type_vocab_size`` is 1 in XLM-R checkpoints);
- checkpoint tensors of the task models carry a ``roberta.`` prefix;
- the classifier head is ``dense -> tanh -> out_proj`` on the first (``<s>``) token, with no
  BERT pooler.

bge-m3's multi-vector (ColBERT) head ships as ``colbert_linear.pt``, a pickle: dfllm never
unpickles, so that file is ignored. Converted to ``colbert_linear.safetensors`` (tensors
``weight`` and ``bias``, or ``colbert_linear.weight``/``colbert_linear.bias``) next to the
checkpoint, it is loaded (:meth:`XLMRobertaModel.attach_token_head`) and ``token_embed``
returns bge-m3's ColBERT vectors: the head applied to every token but the first, normalised.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dfllm.models.bert import BertEmbeddings, BertModel, _modern_norm_names
from dfllm.models.spec import ModelSpec

logger = logging.getLogger("dfllm")

COLBERT_FILE = "colbert_linear.safetensors"
_SECONDARY_HEADS = ("colbert_linear.", "sparse_linear.")  # bge-m3's extra heads, never in the encoder


class RobertaEmbeddings(BertEmbeddings):
    """BERT's embeddings with RoBERTa's position ids (padding-aware, offset by ``pad_token_id``)."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec)
        if spec.pad_token_id is None:
            raise ValueError("RoBERTa config has no pad_token_id (its position ids start after it)")
        self.padding_idx = spec.pad_token_id

    def position_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``padding_idx + 1, + 2, ...`` over the non-pad tokens; pad tokens get ``padding_idx``."""
        mask = (input_ids != self.padding_idx).long()
        return torch.cumsum(mask, dim=1) * mask + self.padding_idx


def max_input_tokens(spec: ModelSpec) -> int | None:
    """The longest input a RoBERTa model reads: its positions run up to ``max_position_embeddings - 1``."""
    if spec.max_position_embeddings is None or spec.pad_token_id is None:
        return None
    return spec.max_position_embeddings - spec.pad_token_id - 1


class XLMRobertaModel(BertModel):
    """The XLM-R (or RoBERTa) encoder; ``forward`` returns per-token hidden states.

    ``token_head`` is None unless :meth:`attach_token_head` found bge-m3's ColBERT head
    converted to safetensors (see the module docstring)."""

    embeddings_class = RobertaEmbeddings

    def __init__(self, spec: ModelSpec, with_pooler: bool = False):
        super().__init__(spec, with_pooler)
        self.max_input_tokens = max_input_tokens(spec)
        self.token_head: nn.Module | None = None

    def checkpoint_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name: strips ``roberta.``; skips the pooler (unused
        by embedders), a masked-LM head and bge-m3's separate heads (loaded on their own)."""
        name = name.removeprefix("roberta.")
        if name.startswith(("pooler.", "lm_head.")) or name.startswith(_SECONDARY_HEADS) or "." not in name:
            return None
        return _modern_norm_names(name)

    def attach_token_head(self, path: Path) -> bool:
        """Load bge-m3's ColBERT head from ``colbert_linear.safetensors`` in ``path`` if it is
        there (a ``colbert_linear.pt`` pickle is never read); True when attached."""
        file = path / COLBERT_FILE
        if not file.is_file():
            if (path / "colbert_linear.pt").is_file():
                logger.info(
                    "%s: colbert_linear.pt is a pickle, which dfllm never loads; convert it to %s "
                    "for bge-m3's multi-vector (token_embed) output",
                    path,
                    COLBERT_FILE,
                )
            return False
        with safe_open(str(file), framework="pt") as f:
            tensors = {k.removeprefix("colbert_linear."): f.get_tensor(k) for k in f.keys()}
        weight = tensors.get("weight")
        if weight is None or weight.dim() != 2 or weight.shape[1] != self.embeddings.word_embeddings.embedding_dim:
            raise ValueError(
                f"{file}: expected a 'weight' tensor of shape [dim, hidden_size], found "
                f"{ {k: tuple(v.shape) for k, v in tensors.items()} }"
            )
        bias = tensors.get("bias")
        dev, dtype = weight.device, self.embeddings.word_embeddings.weight.dtype
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=dev, dtype=dtype)
        with torch.no_grad():
            head.weight.copy_(weight)
            if bias is not None:
                head.bias.copy_(bias)
        self.token_head = head.to(self.embeddings.word_embeddings.weight.device)
        self.token_skip = 1  # bge-m3's colbert vectors leave out the first token
        return True


class RobertaClassificationHead(nn.Module):
    """``out_proj(tanh(dense(hidden[:, 0])))``, Hugging Face's ``RobertaClassificationHead``."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.out_proj = nn.Linear(spec.hidden_size, spec.num_labels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(hidden[:, 0])))


class XLMRobertaForSequenceClassification(nn.Module):
    """XLM-R (or RoBERTa) with its classification head; ``classify`` returns logits ``[batch, num_labels]``."""

    packed_modules_mapping = BertModel.packed_modules_mapping

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.roberta = XLMRobertaModel(spec)
        self.classifier = RobertaClassificationHead(spec)
        self.max_input_tokens = max_input_tokens(spec)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self.roberta(input_ids, token_type_ids, valid)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden)

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        if name.startswith(("roberta.pooler.", "lm_head.")):
            return None
        return _modern_norm_names(name)
