"""BERT-family encoders run unpadded (:mod:`dfllm.models.bert`) against transformers' padded
forward, on small random models: a batch of mixed lengths with token types, a batch of equal
lengths, RoBERTa's padding-aware position ids; through the compiled CPU attention kernel
(its call counter proves it ran) and through the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel, XLMRobertaConfig, XLMRobertaModel

from dfllm import LLM
from dfllm.kernels import _cpu
from dfllm.kernels.backend import encoder_attention_op
from dfllm.kernels.encoder_attention import encoder_attention_torch
from dfllm.models.bert import BertModel as DfllmBert
from dfllm.models.bert import use_encoder_attention
from dfllm.models.loader import load_weights
from dfllm.models.spec import ModelSpec
from dfllm.models.xlm_roberta import XLMRobertaModel as DfllmXLMR

SIZES = dict(
    vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96
)  # head size 32, as MiniLM's


def _load(tmp_path, ref: torch.nn.Module, cls: type[DfllmBert]) -> DfllmBert:
    ref.save_pretrained(tmp_path)
    model = cls(ModelSpec.from_hf(ref.config))
    load_weights(model, tmp_path)
    return model.eval()


def _batch(lengths: list[int], pad_id: int, seed: int, first_id: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), pad_id)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(first_id, 120, (n,), generator=g)
    valid = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    return ids, valid


KERNELS = {"cpu": "auto", "torch": "torch"}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("lengths", [[9, 30, 1, 17], [12, 12, 12]], ids=["mixed", "equal"])
def test_unpadded_bert_matches_transformers(tmp_path, kernel, lengths):
    torch.manual_seed(0)
    ref = BertModel(BertConfig(**SIZES, max_position_embeddings=64, type_vocab_size=2), add_pooling_layer=False)
    model = _load(tmp_path, ref.eval(), DfllmBert)
    attend = encoder_attention_op(KERNELS[kernel], torch.device("cpu"))
    assert (attend is _cpu.encoder_attention_cpu) == (kernel == "cpu")
    use_encoder_attention(model, attend)
    ids, valid = _batch(lengths, 0, seed=len(lengths))
    types = (torch.arange(ids.shape[1])[None, :] >= 4).long() * valid  # a second segment after 4 tokens
    before = _cpu.encoder_attention_count()
    with torch.inference_mode():
        got = model(ids, types, valid)
        want = ref(input_ids=ids, token_type_ids=types, attention_mask=valid.long()).last_hidden_state
    ran = _cpu.encoder_attention_count() - before
    assert ran == (SIZES["num_hidden_layers"] if kernel == "cpu" else 0)
    assert got.shape == want.shape
    assert torch.allclose(got[valid], want[valid], atol=2e-5, rtol=1e-5)
    assert not got[~valid].any()  # padding comes back as zeros


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_unpadded_roberta_positions_match_transformers(tmp_path, kernel):
    """RoBERTa's position ids count the non-pad tokens from ``pad_token_id + 1``."""
    torch.manual_seed(1)
    cfg = XLMRobertaConfig(**SIZES, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1)
    ref = XLMRobertaModel(cfg, add_pooling_layer=False).eval()
    model = _load(tmp_path, ref, DfllmXLMR)
    use_encoder_attention(model, encoder_attention_op(KERNELS[kernel], torch.device("cpu")))
    ids, valid = _batch([7, 40, 2, 23], 1, seed=3)
    with torch.inference_mode():
        got = model(ids, torch.zeros_like(ids), valid)
        want = ref(input_ids=ids, attention_mask=valid.long()).last_hidden_state
    assert torch.allclose(got[valid], want[valid], atol=2e-5, rtol=1e-5)


def test_the_engine_embeds_through_the_kernel_and_torch_forces_the_reference():
    texts = ["short", "a somewhat longer text about engines " * 5, "mid length text here", "x"]
    before = _cpu.encoder_attention_count()
    fast = LLM("all-minilm-l6-v2").embed(texts, use_tqdm=False)
    assert _cpu.encoder_attention_count() > before
    model_layers = 6
    assert _cpu.encoder_attention_count() - before == model_layers  # one batch, one call per layer
    before = _cpu.encoder_attention_count()
    slow = LLM("all-minilm-l6-v2", attention_backend="torch").embed(texts, use_tqdm=False)
    assert _cpu.encoder_attention_count() == before
    a = torch.tensor([o.outputs.embedding for o in fast])
    b = torch.tensor([o.outputs.embedding for o in slow])
    assert torch.allclose(a, b, atol=1e-5)
    assert encoder_attention_op("torch", torch.device("cpu")) is encoder_attention_torch
