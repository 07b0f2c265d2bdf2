"""``dfllm run-batch``'s output lines are strict JSON: no bare ``NaN``, ``Infinity`` or
``-Infinity``, which Python's ``json`` writes by default and strict readers (``jq``, Go,
JavaScript's ``JSON.parse``, Spark) refuse.

- A log-probability of -inf (a token the sampling ruled out, with
  ``logprobs_mode="processed_logprobs"``: top-k and top-p set the others to -inf) is written
  ``-9999.0``, as vLLM's server writes it, in chat and in completions.
- A non-finite score (a cross-encoder whose weights make NaN), in ``/v1/score`` and
  ``/v1/rerank``, and a non-finite embedding value are null, as vLLM's server (pydantic)
  writes them.
- Any value with non-finite floats, at any depth, becomes strict JSON with those as null.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from dfllm.jobs.batch_job import run_batch
from dfllm.jobs.openai_batch import BatchRequestOutput, BatchResponse
from dfllm.models.bundled import resolve_model

from helpers import tiny_bert
from run_batch_data import ENGINE, chat, check_line, line, write_jsonl

pytestmark = pytest.mark.timeout(600)
NAN_TEXT = "zebra"  # a word of one token, whose embedding the NaN embedder has as NaN


def refuse(constant: str):
    raise ValueError(f"not strict JSON: {constant}")


def strict_lines(path: Path) -> list[dict]:
    """The file's lines read as strict JSON readers read them (``NaN``, ``Infinity`` refused)."""
    return [json.loads(t, parse_constant=refuse) for t in path.read_text(encoding="utf-8").split("\n") if t]


def test_logprobs_of_tokens_the_sampling_ruled_out_are_minus_9999(tiny_llama, tmp_path):
    """Before: ``"logprob": -Infinity`` in ``top_logprobs``."""
    sampled = dict(temperature=1.0, top_k=1, seed=3)
    rows = [
        chat("chat", "Hi", logprobs=True, top_logprobs=3, **sampled),
        line("completion", "/v1/completions", prompt="Hi", max_tokens=2, logprobs=3, **sampled),
    ]
    out = tmp_path / "out.jsonl"
    run_batch(
        str(write_jsonl(tmp_path / "in.jsonl", rows)),
        str(out),
        model=str(tiny_llama),
        progress=False,
        logprobs_mode="processed_logprobs",
        **ENGINE,
    )
    got = {r["custom_id"]: r for r in strict_lines(out)}
    for r in got.values():
        check_line(r)
    for step in got["chat"]["response"]["body"]["choices"][0]["logprobs"]["content"]:
        assert step["logprob"] == 0.0  # the one token top-k leaves
        assert [t["logprob"] for t in step["top_logprobs"]] == [0.0, -9999.0, -9999.0]
    logprobs = got["completion"]["response"]["body"]["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [0.0, 0.0]
    assert [sorted(top.values()) for top in logprobs["top_logprobs"]] == [[-9999.0, -9999.0, 0.0]] * 2


@pytest.fixture(scope="module")
def nan_cross_encoder(tmp_path_factory) -> Path:
    """A tiny BERT cross-encoder (one label) whose classifier's bias is NaN: every score is NaN."""
    path, _ = tiny_bert(tmp_path_factory.mktemp("bert"), resolve_model("all-minilm-l6-v2"), 1)
    weights = load_file(path / "model.safetensors")
    weights["classifier.bias"][:] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def nan_embedder(tmp_path_factory) -> Path:
    """The bundled MiniLM with the embedding of NAN_TEXT's token NaN: its vectors are NaN."""
    source = resolve_model("all-minilm-l6-v2")
    path = tmp_path_factory.mktemp("minilm") / "nan-minilm"
    shutil.copytree(source, path)
    vocab = (source / "vocab.txt").read_text(encoding="utf-8").split("\n")
    weights = load_file(path / "model.safetensors")
    name = next(k for k in weights if k.endswith("word_embeddings.weight"))
    weights[name][vocab.index(NAN_TEXT)] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.slow
def test_non_finite_scores_and_embeddings_are_null(nan_cross_encoder, nan_embedder, tmp_path):
    """Before: ``"score": NaN``, ``"relevance_score": NaN`` and ``"embedding": [NaN, ...]``."""
    scores = [
        line("score", "/v1/score", text_1="a cat", text_2=["a kitten", "tax law"]),
        line("rerank", "/v1/rerank", query="a cat", documents=["tax law", "a kitten"]),
    ]
    embeddings = [line("embedding", "/v1/embeddings", input=[NAN_TEXT, "a cat"])]
    got = {}
    for model, rows in ((nan_cross_encoder, scores), (nan_embedder, embeddings)):
        out = tmp_path / f"{model.name}.jsonl"
        run_batch(
            str(write_jsonl(tmp_path / f"{model.name}-in.jsonl", rows)), str(out), model=str(model), progress=False
        )
        got.update({r["custom_id"]: r for r in strict_lines(out)})
    for r in got.values():
        if r["custom_id"] != "embedding":  # openai's type has no null in a vector (vLLM writes it so too)
            check_line(r)
    assert got["embedding"]["error"] is None and got["embedding"]["response"]["status_code"] == 200
    assert [d["score"] for d in got["score"]["response"]["body"]["data"]] == [None, None]
    assert [d["relevance_score"] for d in got["rerank"]["response"]["body"]["results"]] == [None, None]
    nan_vector, vector = (d["embedding"] for d in got["embedding"]["response"]["body"]["data"])
    assert nan_vector == [None] * len(nan_vector) and all(isinstance(x, float) for x in vector)


# ---- any value --------------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


def finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


@settings(max_examples=300, deadline=None)
@given(value=json_values)
def test_any_body_becomes_strict_json_with_non_finite_numbers_null(value):
    """An answer line (:meth:`BatchRequestOutput.to_json`, e.g. of a body read back) is strict
    JSON whatever it holds; finite values are kept as they are."""
    line_out = BatchRequestOutput("batch_req_k", "c", BatchResponse(200, "req_k", {"v": value}))
    back = json.loads(line_out.to_json(), parse_constant=refuse)
    assert back["response"]["body"] == {"v": finite(value)}
