"""Pooling models: embed, classify, score and encode against sentence-transformers and transformers."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModel

from dfllm import LLM, PoolingParams, SamplingParams
from dfllm.models.bundled import resolve_model

from helpers import build_tiny_model, tiny_bert

WORDS = (
    "data engineers run batch jobs over parquet files on object storage while dask schedules "
    "partitions across workers and the dashboard shows progress"
).split()


def texts_of_mixed_length(n: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 400, (n,), generator=g).tolist()
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(L)) for i, L in enumerate(lengths)]


@pytest.fixture(scope="module")
def minilm_dir():
    return resolve_model("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return LLM("all-minilm-l6-v2", max_num_batched_tokens=2048)


@pytest.mark.slow
def test_minilm_matches_sentence_transformers(minilm, minilm_dir):
    from sentence_transformers import SentenceTransformer

    texts = texts_of_mixed_length(40) + ["", " ", "Paris is the capital of France.", "x" * 3000]
    texts = [t for t in texts if t.strip()]
    assert minilm.runner_type == "pooling"
    mine = torch.tensor([o.outputs.embedding for o in minilm.embed(texts, use_tqdm=False)])
    ref = SentenceTransformer(str(minilm_dir), device="cpu").encode(texts, convert_to_tensor=True)
    cos = torch.nn.functional.cosine_similarity(mine, ref.float())
    assert cos.min().item() >= 0.9999
    assert any(len(t.split()) > 256 for t in texts)  # some texts were truncated
    assert mine.norm(dim=1).sub(1).abs().max() < 1e-5


def test_bi_encoder_score_is_cosine(minilm, minilm_dir):
    from sentence_transformers import SentenceTransformer, util

    q = "Which city is the capital of France?"
    docs = ["Paris is the capital of France.", "Trains run on rails.", "Berlin is in Germany."]
    scores = [o.outputs.score for o in minilm.score(q, docs, use_tqdm=False)]
    st = SentenceTransformer(str(minilm_dir), device="cpu")
    ref = util.cos_sim(st.encode([q], convert_to_tensor=True), st.encode(docs, convert_to_tensor=True))[0]
    assert scores == pytest.approx(ref.tolist(), abs=1e-4)
    assert scores[0] == max(scores)
    pairwise = minilm.score(docs, docs, use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)
    with pytest.raises(ValueError, match=r"^Input lengths must be either 1:1, 1:N or N:N \(score takes 1 to 1"):
        minilm.score(docs[:2], docs, use_tqdm=False)


@pytest.mark.slow
def test_batching_under_a_small_budget_keeps_order(minilm):
    texts = texts_of_mixed_length(12)
    small = LLM("all-minilm-l6-v2", max_num_batched_tokens=300, max_num_seqs=3)
    a = [o.outputs.embedding for o in minilm.embed(texts, use_tqdm=False)]
    b = [o.outputs.embedding for o in small.embed(texts, use_tqdm=False)]
    assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_pooling_params(minilm):
    text = "one two three four five six seven eight nine ten"
    raw = minilm.embed([text], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    normed = minilm.embed([text], use_tqdm=False)[0].outputs.embedding
    assert abs(torch.tensor(raw).norm().item() - 1) > 1e-3
    assert torch.allclose(torch.nn.functional.normalize(torch.tensor(raw), dim=0), torch.tensor(normed), atol=1e-6)
    cut = minilm.embed([text], PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 5 and cut.prompt_token_ids[-1] == 102  # [SEP] kept
    assert len(minilm.embed([text], truncate_prompt_tokens=4, use_tqdm=False)[0].prompt_token_ids) == 4
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)


def test_encode_needs_a_task_and_gives_tensors(minilm):
    with pytest.raises(ValueError, match="pooling_task must be one of"):
        minilm.encode(["hi"], use_tqdm=False)
    out = minilm.encode(["hi there"], pooling_task="embed", use_tqdm=False)[0]
    assert isinstance(out.outputs.data, torch.Tensor) and out.outputs.data.shape == (384,)
    tokens = minilm.encode(["hi there"], pooling_task="token_embed", use_tqdm=False)[0]
    assert tokens.outputs.data.shape == (len(tokens.prompt_token_ids), 384)


def test_wrong_runner_errors(minilm, tiny_llama):
    with pytest.raises(ValueError, match="pooling model; use embed"):
        minilm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling model"):
        minilm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="classify is not supported"):
        minilm.classify(["hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="cannot generate text"):
        LLM("all-minilm-l6-v2", runner="generate")
    gen = LLM(tiny_llama, max_model_len=64, kv_cache_memory_bytes=2**20)
    with pytest.raises(ValueError, match="generative model"):
        gen.embed(["hi"], use_tqdm=False)


# ---- classifiers and cross-encoders on small random BERTs ---------------------------------------


def test_classify_matches_transformers(tmp_path, minilm_dir):
    path, ref_model = tiny_bert(tmp_path, minilm_dir, 3)
    llm = LLM(path)
    texts = ["good movie", "a terrible, boring film that went on far too long", "okay"]
    outs = llm.classify(texts, use_tqdm=False)
    tok = llm.get_tokenizer()
    with torch.inference_mode():
        for text, out in zip(texts, outs):
            probs = torch.softmax(ref_model(**tok(text, return_tensors="pt")).logits[0], dim=-1)
            assert out.outputs.probs == pytest.approx(probs.tolist(), abs=1e-5)
            assert out.outputs.label == f"label_{int(probs.argmax())}" and out.outputs.num_classes == 3
    raw = llm.classify(texts[:1], PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.probs
    assert torch.softmax(torch.tensor(raw), 0).tolist() == pytest.approx(outs[0].outputs.probs, abs=1e-6)
    with pytest.raises(ValueError, match="embed is not supported"):
        llm.embed(texts, use_tqdm=False)
    with pytest.raises(ValueError, match="3 labels"):
        llm.score("a", "b", use_tqdm=False)


def test_cross_encoder_score_matches_transformers(tmp_path, minilm_dir):
    path, ref_model = tiny_bert(tmp_path, minilm_dir, 1)
    llm = LLM(path)
    query, docs = "capital of France", ["Paris is the capital of France.", "Trains run on rails."]
    outs = llm.score(query, docs, use_tqdm=False)
    tok = llm.get_tokenizer()
    with torch.inference_mode():
        for doc, out in zip(docs, outs):
            logit = ref_model(**tok(query, doc, return_tensors="pt")).logits[0, 0]
            assert out.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
    many = llm.score(docs, list(reversed(docs)), use_tqdm=False)
    assert len(many) == 2 and many[0].outputs.score != outs[0].outputs.score


# ---- decoder embedders ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_pooling_matches_transformers(tmp_path, smollm2_dir, pooling):
    path = build_tiny_model(tmp_path, smollm2_dir, arch="qwen2", heads=6, kv_heads=2, hidden=48)
    if pooling == "mean":
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
        (path / "modules.json").write_text(
            json.dumps(
                [
                    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                ]
            )
        )
    llm = LLM(path, runner="pooling", max_num_batched_tokens=64)
    assert llm.runner_type == "pooling"
    texts = ["short", "a somewhat longer text about dataframes and engines", "mid length text here"]
    outs = llm.embed(texts, use_tqdm=False)
    ref_model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    with torch.inference_mode():
        for text, out in zip(texts, outs):
            hidden = ref_model(**tok(text, return_tensors="pt")).last_hidden_state[0]
            if pooling == "last":
                ref = torch.nn.functional.normalize(hidden[-1], dim=0)
            else:
                ref = hidden.mean(dim=0)
            assert torch.allclose(torch.tensor(out.outputs.embedding), ref, atol=1e-5)
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate(["x"], use_tqdm=False)
