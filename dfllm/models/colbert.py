"""ColBERT late-interaction models (``HF_ColBERT`` checkpoints such as colbert-ir/colbertv2.0
and answerdotai/answerai-colbert-small-v1), and MaxSim scoring.

A ColBERT model is a BERT encoder plus a linear projection without bias (``linear.weight``,
hidden size -> ``dim``) applied to every token; its output is one normalised vector per
token (``token_embed``). It has no single-vector embedding: as in vLLM, it serves
``token_embed`` and ``score``, where the score of a query and a document is MaxSim, the sum
over query tokens of the largest dot product with any document token.

Only BERT-based checkpoints (``model_type`` "bert") are implemented, as in vLLM's
``ColBERTModel``. The projection size is read from the config as ``colbert_dim``, ``dim`` or ``projection_dim``
(vLLM's names); a config without any of them is refused, naming them.
"""

from __future__ import annotations

import torch
from torch import nn

from dfllm.models.bert import BertModel
from dfllm.models.spec import ModelSpec


class ColBERTModel(BertModel):
    """BERT with ColBERT's token projection (``token_head``); ``forward`` returns hidden states."""

    late_interaction = True

    def __init__(self, spec: ModelSpec):
        if spec.model_type not in (None, "bert"):
            raise ValueError(
                f"HF_ColBERT on a {spec.model_type!r} base is not supported (config.json's model_type must be 'bert')"
            )
        if not spec.colbert_dim:
            raise ValueError(
                "ColBERT config names no projection size: set one of 'colbert_dim', 'dim' or "
                "'projection_dim' in config.json (colbert-ir checkpoints use 128)"
            )
        super().__init__(spec)
        self.token_head = nn.Linear(spec.hidden_size, spec.colbert_dim, bias=False)

    def checkpoint_name(self, name: str) -> str | None:
        """``bert.``/``model.`` prefixes stripped; ``linear.*``/``colbert_linear.*`` fill the projection."""
        for prefix in ("bert.", "model."):
            name = name.removeprefix(prefix)
        for head in ("linear.", "colbert_linear."):
            if name.startswith(head):
                return "token_head." + name.removeprefix(head)
        return super().checkpoint_name(name)


def maxsim(query: torch.Tensor, doc: torch.Tensor) -> float:
    """ColBERT's late-interaction score of token vectors ``query [q, d]`` and ``doc [n, d]``:
    the sum over query tokens of the largest dot product with any document token."""
    return float((query.float() @ doc.float().T).amax(dim=1).sum())
