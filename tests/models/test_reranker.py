"""Qwen3 as vLLM runs its rerankers and embedders: the original Qwen3-Reranker through
``hf_overrides`` (a causal LM whose "yes"/"no" LM-head rows make a one-label head), a plain
``Qwen3ForSequenceClassification`` checkpoint, and Qwen3-Embedding-style last-token embeddings;
each against a direct computation with transformers."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from decoder_builders import build_decoder
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

import dfllm.accessors  # noqa: F401  (registers the .llm accessors)
from dfllm import LLM

RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}

# vLLM's example formats the pairs itself (examples/offline_inference/qwen3_reranker.py)
PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QUERIES = [
    f"{PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {q}\n" for q in ("What is the capital of China?", "Explain gravity")
]
DOCUMENTS = [
    f"<Document>: {d}{SUFFIX}"
    for d in (
        "The capital of China is Beijing.",
        "Gravity is a force that attracts two bodies towards each other. It gives weight to physical objects.",
    )
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("rerank")


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def causal(request, root, smollm2_dir):
    return build_decoder(
        root,
        smollm2_dir,
        Qwen3Config,
        f"qwen3-{request.param}",
        hidden=32,
        heads=4,
        kv_heads=2,
        head_dim=16,
        tie_word_embeddings=request.param,
        seed=3,
    )


def hf_yes_probability(path, texts: list[str]) -> list[float]:
    """transformers' Qwen3ForCausalLM: sigmoid(logit_yes - logit_no) at the last position."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    out = []
    with torch.inference_mode():
        for text in texts:
            logits = model(**tok(text, return_tensors="pt")).logits[0, -1]
            out.append(torch.sigmoid(logits[yes] - logits[no]).item())
    return out


@pytest.mark.slow
def test_original_qwen3_reranker_scores_as_vllm(causal):
    llm = LLM(causal, runner="pooling", hf_overrides=RERANKER)
    outs = llm.score(QUERIES, DOCUMENTS, use_tqdm=False)
    got = [o.outputs.score for o in outs]
    want = hf_yes_probability(causal, [q + d for q, d in zip(QUERIES, DOCUMENTS)])
    assert got == pytest.approx(want, abs=1e-4)
    assert not got == pytest.approx([0.5, 0.5], abs=1e-3)  # a real head, not a constant
    # one query against many documents broadcasts; the pair is the two texts joined
    one = llm.score(QUERIES[0], DOCUMENTS, use_tqdm=False)
    assert [o.outputs.score for o in one] == pytest.approx(
        hf_yes_probability(causal, [QUERIES[0] + d for d in DOCUMENTS]), abs=1e-4
    )
    assert one[0].prompt_token_ids == AutoTokenizer.from_pretrained(causal)(QUERIES[0] + DOCUMENTS[0]).input_ids


@pytest.mark.slow
def test_reranker_through_the_dataframe_accessor(root, smollm2_dir):
    path = build_decoder(
        root, smollm2_dir, Qwen3Config, "qwen3-frame", hidden=32, heads=4, kv_heads=2, head_dim=16, seed=4
    )
    df = pd.DataFrame({"query": QUERIES, "doc": DOCUMENTS})
    scored = df.llm.score("query", "doc", model=str(path), runner="pooling", hf_overrides=RERANKER)
    want = hf_yes_probability(path, [q + d for q, d in zip(QUERIES, DOCUMENTS)])
    assert scored.score.tolist() == pytest.approx(want, abs=1e-4)


def test_reranker_overrides_are_checked(causal):
    with pytest.raises(ValueError, match="classifier_from_token with two tokens"):
        LLM(causal, runner="pooling", hf_overrides={**RERANKER, "classifier_from_token": ["yes"]})
    with pytest.raises(ValueError, match=r"\['zz-not-a-token'\] are not tokens"):
        LLM(causal, runner="pooling", hf_overrides={**RERANKER, "classifier_from_token": ["no", "zz-not-a-token"]})


@pytest.mark.slow
@pytest.mark.parametrize("config_cls", [Qwen3Config, Qwen2Config, LlamaConfig])
def test_plain_sequence_classification_checkpoint(root, smollm2_dir, config_cls):
    """A ``*ForSequenceClassification`` checkpoint (``score.weight``, 3 labels): its class
    probabilities are transformers' softmax of the last token's logits."""
    arch = config_cls.__name__.replace("Config", "ForSequenceClassification")
    cfg = config_cls(
        vocab_size=AutoTokenizer.from_pretrained(smollm2_dir).vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=3,
        pad_token_id=0,
        initializer_range=0.2,
        architectures=[arch],
    )
    torch.manual_seed(5)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    path = root / arch
    model.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.save_pretrained(path)
    texts = ["a short text", "another, somewhat longer piece of text to classify"]
    with torch.inference_mode():
        want = [torch.softmax(model(**tok(t, return_tensors="pt")).logits[0], -1).tolist() for t in texts]
    llm = LLM(path)  # a classifier architecture runs as a pooling model
    got = [o.outputs.probs for o in llm.classify(texts, use_tqdm=False)]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("bare", [False, True], ids=["causal-lm", "bare-model"])
def test_qwen3_embedding_last_token_normalised(root, smollm2_dir, bare):
    """Qwen3-Embedding style: last-token pooling, normalised; also a checkpoint saved from the
    bare ``Qwen3Model`` (tensors without the ``model.`` prefix), as Qwen3-Embedding ships."""
    path = build_decoder(
        root,
        smollm2_dir,
        Qwen3Config,
        f"qwen3-embed-{bare}",
        hidden=32,
        heads=4,
        kv_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
        seed=6,
    )
    if bare:
        bare_path = root / "qwen3-embed-bare-model"
        AutoModel.from_pretrained(path, dtype=torch.float32).save_pretrained(bare_path)
        for f in path.glob("tokenizer*"):
            (bare_path / f.name).write_bytes(f.read_bytes())
        cfg = Qwen3Config.from_pretrained(bare_path)
        cfg.architectures = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's config.json says
        cfg.save_pretrained(bare_path)
        path = bare_path
    texts = ["The capital of China is Beijing.", "Gravity"]
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = [
            torch.nn.functional.normalize(base(**tok(t, return_tensors="pt")).last_hidden_state[0, -1], dim=-1)
            for t in texts
        ]
    got = LLM(path, runner="pooling").embed(texts, use_tqdm=False)
    for g, w in zip(got, want):
        assert torch.nn.functional.cosine_similarity(torch.tensor(g.outputs.embedding), w, dim=0) >= 0.9999
