"""XLM-RoBERTa and RoBERTa encoders against transformers: bge-m3-style dense embeddings (CLS,
normalised) through ``LLM.embed``, the pandas and Dask accessors and ``dfllm run``; per-token
states; and XLM-R cross-encoder scores.

The tiny models reuse the bundled MiniLM (BERT) tokenizer with its pad token moved to id 1 and
no token types, as XLM-R's own tokenizer has: position ids then start at 2, and a pad id inside
a prompt restarts nothing (Hugging Face's ``create_position_ids_from_input_ids``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoTokenizer,
    RobertaConfig,
    RobertaModel,
    XLMRobertaConfig,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, PoolingParams
from dfllm.models.bundled import resolve_model

from helpers import local_client

TEXTS = [
    "short",
    "a somewhat longer text about dataframes, engines and the partitions they run",
    "mid length text here",
    "x",
    "the last one " * 30,
]  # the last is cut to the model's 64 tokens
SIZES = dict(
    vocab_size=30522,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=66,
    type_vocab_size=1,
    pad_token_id=1,
)


def save_tokenizer(path: Path) -> None:
    """The MiniLM tokenizer with XLM-R's pad id (1, ``[unused0]``) and no token types."""
    tok = AutoTokenizer.from_pretrained(
        resolve_model("all-minilm-l6-v2"), model_input_names=["input_ids", "attention_mask"]
    )
    tok.pad_token = "[unused0]"
    tok.save_pretrained(path)


def save_sentence_transformers_cls(path: Path) -> None:
    """bge-m3's pipeline: CLS pooling, then Normalize."""
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_cls_token": True})
    )
    (path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )


def build(root: Path, model_cls, config_cls, arch: str, seed: int, st_files: bool = False, **extra):
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SIZES, architectures=[arch], **extra)).eval()
    path = root / arch
    model.save_pretrained(path)
    save_tokenizer(path)
    if st_files:
        save_sentence_transformers_cls(path)
    return path, model


@pytest.fixture(scope="module")
def bge_like(tmp_path_factory):
    return build(
        tmp_path_factory.mktemp("xlmr"), XLMRobertaModel, XLMRobertaConfig, "XLMRobertaModel", 0, st_files=True
    )


@pytest.fixture(scope="module")
def bge_llm(bge_like):
    return LLM(bge_like[0], max_num_batched_tokens=128)


def hf_states(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)
        ).last_hidden_state[0]


def test_bge_m3_style_embeddings_match_transformers(bge_like, bge_llm):
    _, ref = bge_like
    assert bge_llm.runner_type == "pooling" and bge_llm.get_tokenizer().pad_token_id == 1
    pooler = bge_llm.pooling_engine.pooler
    assert (pooler.pooling_type, pooler.normalize) == ("CLS", True)
    with_pads = {"prompt_token_ids": [101, 2023, 1, 2003, 1, 102]}  # pad ids inside a prompt keep position 1
    prompts = [*TEXTS, with_pads]
    outs = bge_llm.embed(prompts, use_tqdm=False)
    assert len(outs[4].prompt_token_ids) == 64  # max_position_embeddings - pad_token_id - 1
    mine = torch.tensor([o.outputs.embedding for o in outs])
    want = torch.stack([F.normalize(hf_states(ref, o.prompt_token_ids)[0], dim=0) for o in outs])
    assert F.cosine_similarity(mine, want).min().item() >= 0.9999
    assert mine.norm(dim=1).sub(1).abs().max() < 1e-5
    # per-token states, one per token, unnormalised by default
    tokens = bge_llm.encode([*TEXTS[:3], with_pads], pooling_task="token_embed", use_tqdm=False)
    for o in tokens:
        states = hf_states(ref, o.prompt_token_ids)
        assert o.outputs.data.shape == states.shape
        assert F.cosine_similarity(o.outputs.data, states).min().item() >= 0.9999


def test_roberta_model_without_sentence_transformers_files(tmp_path):
    path, ref = build(tmp_path, RobertaModel, RobertaConfig, "RobertaModel", 1)
    llm = LLM(path)
    outs = llm.embed(TEXTS[:3], use_tqdm=False)  # CLS, not normalised (no modules.json)
    for o in outs:
        want = hf_states(ref, o.prompt_token_ids)[0]
        assert torch.allclose(torch.tensor(o.outputs.embedding), want, atol=1e-5)


def test_xlm_roberta_cross_encoder_scores(tmp_path):
    path, ref = build(
        tmp_path,
        XLMRobertaForSequenceClassification,
        XLMRobertaConfig,
        "XLMRobertaForSequenceClassification",
        2,
        num_labels=1,
    )
    llm = LLM(path)
    query, docs = "capital of France", ["Paris is the capital of France.", "Trains run on rails.", "x"]
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    raw = [
        o.outputs.score
        for o in llm.score(query, docs, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    ]
    tok = llm.get_tokenizer()
    with torch.inference_mode():
        logits = [ref(**tok(query, d, return_tensors="pt")).logits[0, 0].item() for d in docs]
    assert raw == pytest.approx(logits, abs=1e-4)
    assert scores == pytest.approx(torch.sigmoid(torch.tensor(logits)).tolist(), abs=1e-4)
    assert llm.classify([query], use_tqdm=False)[0].outputs.probs[0] == pytest.approx(
        torch.sigmoid(ref(**tok(query, return_tensors="pt")).logits[0, 0]).item(), abs=1e-4
    )


# ---- the same model through the accessors and the command line, on one small cluster ------------
@pytest.fixture(scope="module")
def client():
    with local_client(workers=1, threads=1) as c:
        yield c


@pytest.mark.slow
def test_accessors_and_cli_embed(bge_like, bge_llm, client, tmp_path):
    path = str(bge_like[0])
    frame = pd.DataFrame({"t": [TEXTS[0], None, TEXTS[1], TEXTS[2]]})
    want = [o.outputs.embedding for o in bge_llm.embed([TEXTS[0], TEXTS[1], TEXTS[2]], use_tqdm=False)]
    local = frame.llm.embed("t", model=path)
    assert local["embedding"].isna().tolist() == [False, True, False, False]
    np.testing.assert_allclose(np.stack(local["embedding"].dropna().tolist()), want, atol=1e-5)

    dask_out = dd.from_pandas(frame, npartitions=2).llm.embed("t", model=path).compute()
    np.testing.assert_allclose(np.stack(dask_out["embedding"].dropna().tolist()), want, atol=1e-5)

    src = tmp_path / "texts.csv"
    frame.dropna().rename(columns={"t": "text"}).to_csv(src, index=False)
    out = tmp_path / "out"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dfllm.jobs.cli",
            "run",
            str(src),
            str(out),
            "--task",
            "embed",
            "--model",
            path,
            "--scheduler",
            client.scheduler.address,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    np.testing.assert_allclose(np.stack(pd.read_parquet(out)["embedding"].tolist()), want, atol=1e-5)
