"""Multi-vector token embeddings and late-interaction (ColBERT MaxSim) scores against a direct
computation from transformers' hidden states: an ``HF_ColBERT`` checkpoint (BERT plus a linear
projection without bias to ``dim``) and a bge-m3-style XLM-R with its ColBERT head converted to
``colbert_linear.safetensors`` (the ``colbert_linear.pt`` pickle is never read)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModel, BertConfig, XLMRobertaConfig, XLMRobertaModel

from dfllm import LLM
from dfllm.models.bundled import resolve_model

QUERY = "which city is the capital of france"
DOCS = ["paris is the capital of france.", "trains run on rails across the country", "berlin"]


def maxsim(q: torch.Tensor, d: torch.Tensor) -> float:
    return float((q @ d.T).max(dim=1).values.sum())


def copy_minilm_tokenizer(path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(resolve_model("all-minilm-l6-v2") / name, path / name)


def hf_states(model, tok, text: str) -> torch.Tensor:
    with torch.inference_mode():
        return model(**tok(text, return_tensors="pt")).last_hidden_state[0]


@pytest.fixture(scope="module")
def colbert(tmp_path_factory):
    """A tiny ``HF_ColBERT`` directory (``bert.*`` tensors plus ``linear.weight`` [16, 32]),
    its transformers encoder and the projection."""
    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        architectures=["HF_ColBERT"],
        dim=16,
    )
    torch.manual_seed(3)
    model = AutoModel.from_config(cfg, add_pooling_layer=False).eval()
    linear = torch.randn(16, 32) / 32**0.5
    path = tmp_path_factory.mktemp("colbert") / "colbert"
    path.mkdir()
    cfg.save_pretrained(path)
    tensors = {f"bert.{k}": v.contiguous() for k, v in model.state_dict().items() if "position_ids" not in k}
    save_file({**tensors, "linear.weight": linear}, str(path / "model.safetensors"))
    copy_minilm_tokenizer(path)
    return path, model, linear


@pytest.fixture(scope="module")
def colbert_llm(colbert):
    return LLM(colbert[0])


def test_colbert_token_vectors_and_maxsim(colbert, colbert_llm):
    _, model, linear = colbert
    tok = colbert_llm.get_tokenizer()
    ref = {t: F.normalize(hf_states(model, tok, t) @ linear.T, dim=-1) for t in [QUERY, *DOCS]}
    outs = colbert_llm.encode([QUERY, *DOCS], pooling_task="token_embed", use_tqdm=False)
    for text, o in zip([QUERY, *DOCS], outs):
        assert o.outputs.data.shape == (len(o.prompt_token_ids), 16)  # one vector per token, projected
        assert F.cosine_similarity(o.outputs.data, ref[text]).min().item() >= 0.9999
        assert o.outputs.data.norm(dim=-1).sub(1).abs().max() < 1e-5

    scores = [o.outputs.score for o in colbert_llm.score(QUERY, DOCS, use_tqdm=False)]
    assert scores == pytest.approx([maxsim(ref[QUERY], ref[d]) for d in DOCS], abs=1e-4)
    pairwise = [o.outputs.score for o in colbert_llm.score(DOCS, list(reversed(DOCS)), use_tqdm=False)]
    assert pairwise == pytest.approx([maxsim(ref[a], ref[b]) for a, b in zip(DOCS, reversed(DOCS))], abs=1e-4)
    assert maxsim(ref[DOCS[0]], ref[DOCS[2]]) != pytest.approx(maxsim(ref[DOCS[2]], ref[DOCS[0]]), abs=1e-3)


def test_colbert_serves_token_embed_and_score_only(colbert, colbert_llm, tmp_path):
    with pytest.raises(ValueError, match="embed is not supported.*late-interaction"):
        colbert_llm.embed([QUERY], use_tqdm=False)
    colbert_llm.enqueue([QUERY])  # the model's own task: token vectors
    assert colbert_llm.wait_for_completion(use_tqdm=False)[0].outputs.data.shape[1] == 16
    no_dim = tmp_path / "no-dim"
    shutil.copytree(colbert[0], no_dim)
    cfg = BertConfig.from_pretrained(no_dim)
    del cfg.dim
    cfg.save_pretrained(no_dim)
    with pytest.raises(ValueError, match="'colbert_dim', 'dim' or 'projection_dim'"):
        LLM(no_dim)
    roberta_base = tmp_path / "roberta-base"
    shutil.copytree(colbert[0], roberta_base)
    raw = json.loads((roberta_base / "config.json").read_text())
    (roberta_base / "config.json").write_text(json.dumps({**raw, "model_type": "xlm-roberta"}))
    with pytest.raises(ValueError, match="HF_ColBERT on a 'xlm-roberta' base is not supported"):
        LLM(roberta_base)


@pytest.fixture(scope="module")
def bge_m3_like(tmp_path_factory):
    """A tiny XLM-R with bge-m3's ColBERT head (hidden -> hidden, with bias) converted to safetensors;
    the original pickles are there too, as unreadable bytes."""
    cfg = XLMRobertaConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=66,
        type_vocab_size=1,
        pad_token_id=0,
        architectures=["XLMRobertaModel"],
    )
    torch.manual_seed(4)
    model = XLMRobertaModel(cfg).eval()
    head = torch.nn.Linear(32, 32)
    path = tmp_path_factory.mktemp("bge") / "bge-m3"
    model.save_pretrained(path)
    copy_minilm_tokenizer(path)
    for pickle in ("colbert_linear.pt", "sparse_linear.pt"):
        (path / pickle).write_bytes(b"not a pickle: dfllm must never load this")
    pt_only = path.parent / "pt-only"
    shutil.copytree(path, pt_only)
    save_file(
        {"weight": head.weight.detach().clone(), "bias": head.bias.detach().clone()},
        str(path / "colbert_linear.safetensors"),
    )
    return path, pt_only, model, head


def test_bge_m3_colbert_head_from_safetensors(bge_m3_like):
    path, pt_only, model, head = bge_m3_like
    llm = LLM(path)
    tok = llm.get_tokenizer()
    outs = llm.encode([QUERY, DOCS[0]], pooling_task="token_embed", use_tqdm=False)
    vecs = []
    with torch.inference_mode():
        for text, o in zip([QUERY, DOCS[0]], outs):
            want = F.normalize(head(hf_states(model, tok, text)[1:]), dim=-1)  # bge-m3 leaves out <s>
            assert o.outputs.data.shape == (len(o.prompt_token_ids) - 1, 32)
            assert F.cosine_similarity(o.outputs.data, want).min().item() >= 0.9999
            vecs.append(want)
    # dense embedding and score stay bge-m3's default: CLS, cosine
    dense = [torch.tensor(o.outputs.embedding) for o in llm.embed([QUERY, DOCS[0]], use_tqdm=False)]
    with torch.inference_mode():
        cls = [hf_states(model, tok, t)[0] for t in (QUERY, DOCS[0])]
    assert torch.allclose(dense[0], cls[0], atol=1e-5)
    score = llm.score(QUERY, DOCS[0], use_tqdm=False)[0].outputs.score
    assert score == pytest.approx(F.cosine_similarity(cls[0], cls[1], dim=0).item(), abs=1e-4)
    assert maxsim(vecs[0], vecs[1]) != pytest.approx(score, abs=1e-3)

    plain = LLM(pt_only)  # only the pickle: no head, per-token hidden states of every token
    o = plain.encode([QUERY], pooling_task="token_embed", use_tqdm=False)[0]
    assert o.outputs.data.shape == (len(o.prompt_token_ids), 32)
    assert F.cosine_similarity(o.outputs.data, hf_states(model, tok, QUERY)).min().item() >= 0.9999
