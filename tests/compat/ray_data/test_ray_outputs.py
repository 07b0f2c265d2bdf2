"""What a Ray Data LLM user's ``postprocess`` reads: the vLLM engine stage's columns
(``generated_text``, ``prompt``, ``prompt_token_ids``, ``generated_tokens``,
``num_input_tokens``, ``num_generated_tokens``, ``time_taken_llm``) and, for the pooling
tasks, ``embeddings``; and ``model_source=None`` as the task's default model."""

from __future__ import annotations

import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest

import dfllm
from dfllm import build_processor, vLLMEngineProcessorConfig

ITEMS = ["Name a colour.", "Say hello.", "Count to three."]
SP = dict(temperature=0.0, max_tokens=6)


def ray_postprocess(row):
    """Ray's docs' postprocess, reading the engine stage's columns."""
    return dict(
        answer=row["generated_text"],
        prompt=row["prompt"],
        tokens=list(row["generated_tokens"]),
        prompt_ids=list(row["prompt_token_ids"]),
        n_in=row["num_input_tokens"],
        n_out=row["num_generated_tokens"],
        seconds=row["time_taken_llm"],
        item=row["item"],
    )


@pytest.fixture(scope="module")
def items():
    return pd.DataFrame({"item": ITEMS})


@pytest.mark.slow
@pytest.mark.parametrize("chat", [True, False])
def test_generation_columns_as_in_ray(tiny_llama, items, chat):
    def preprocess(row):
        if chat:
            return dict(messages=[{"role": "user", "content": row["item"]}], sampling_params=SP)
        return dict(prompt=row["item"], sampling_params=SP)

    config = vLLMEngineProcessorConfig(model_source=str(tiny_llama), engine_kwargs={"max_model_len": 256}, batch_size=2)
    processor = build_processor(config, preprocess=preprocess, postprocess=ray_postprocess)
    got = processor(dd.from_pandas(items, npartitions=2)).compute().sort_index()
    assert "llm_error" not in got.columns  # Ray's default: a failed row fails the job, no error column
    llm = dfllm.LLM(str(tiny_llama), max_model_len=256)
    params = dfllm.SamplingParams(**SP)
    if chat:
        refs = llm.chat([[{"role": "user", "content": i}] for i in ITEMS], params, use_tqdm=False)
    else:
        refs = llm.generate(ITEMS, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for (_, row), ref in zip(got.iterrows(), refs):
        assert row["answer"] == ref.outputs[0].text
        assert list(row["tokens"]) == list(ref.outputs[0].token_ids) and len(row["tokens"]) == row["n_out"]
        assert list(row["prompt_ids"]) == list(ref.prompt_token_ids) and len(row["prompt_ids"]) == row["n_in"]
        if chat:  # the prompt after the chat template, as Ray's ChatTemplateStage writes it
            assert row["prompt"] != row["item"] and row["item"] in row["prompt"]
            assert tokenizer.encode(row["prompt"], add_special_tokens=False) == list(row["prompt_ids"])
        else:
            assert row["prompt"] == row["item"]
        assert isinstance(row["seconds"], float) and row["seconds"] > 0
    assert str(got["tokens"].dtype).startswith("list<item: int64>")
    pd.testing.assert_frame_equal(got.drop(columns="seconds"), processor(items).drop(columns="seconds"))


def test_no_postprocess_carries_the_engine_columns(tiny_llama, items):
    config = vLLMEngineProcessorConfig(model_source=str(tiny_llama), engine_kwargs={"max_model_len": 256})
    got = build_processor(config, preprocess=lambda r: dict(prompt=r["item"], sampling_params=SP))(items)
    assert {
        "generated_text",
        "prompt",
        "prompt_token_ids",
        "generated_tokens",
        "num_input_tokens",
        "num_generated_tokens",
        "finish_reason",
        "time_taken_llm",
    } <= set(got.columns)
    assert (got["generated_tokens"].list.len() == got["num_generated_tokens"]).all()


def test_embed_default_model_reads_embeddings(items):
    """``model_source=None``: the embed task's default model, the bundled MiniLM."""

    def postprocess(row):
        return dict(item=row["item"], vector=list(row["embeddings"]), seconds=row["time_taken_llm"])

    config = vLLMEngineProcessorConfig(model_source=None, task_type="embed", batch_size=2)
    processor = build_processor(config, preprocess=lambda r: dict(prompt=r["item"]), postprocess=postprocess)
    got = processor(dd.from_pandas(items, npartitions=2)).compute().sort_index()
    refs = dfllm.LLM("all-minilm-l6-v2").embed(ITEMS, use_tqdm=False)
    for vector, ref in zip(got["vector"], refs):
        np.testing.assert_allclose(np.asarray(vector), np.asarray(ref.outputs.embedding), rtol=1e-5, atol=1e-6)
    assert (got["seconds"] > 0).all()
    plain = build_processor(config, preprocess=lambda r: dict(prompt=r["item"]))(items)  # dfllm's key kept
    for a, b in zip(plain["embedding"], plain["embeddings"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_score_default_model_embeddings_is_the_score():
    frame = pd.DataFrame({"q": ["a cat", "a car"], "d": ["a kitten", "a kitten"]})
    config = vLLMEngineProcessorConfig(model_source=None, task_type="score")
    got = build_processor(config, preprocess=lambda r: dict(text_1=r["q"], text_2=r["d"]))(frame)
    assert "llm_error" not in got.columns
    assert [list(e) for e in got["embeddings"]] == [[s] for s in got["score"]]


def test_classify_embeddings_are_the_probabilities(tmp_path, items):
    from dfllm.models.bundled import resolve_model

    from helpers import tiny_bert

    path, _ = tiny_bert(tmp_path, resolve_model("all-minilm-l6-v2"), 3)
    config = vLLMEngineProcessorConfig(model_source=str(path), task_type="classify")
    got = build_processor(
        config,
        preprocess=lambda r: dict(prompt=r["item"]),
        postprocess=lambda r: dict(probs=r["probs"], embeddings=r["embeddings"]),
    )(items)
    for probs, embeddings in zip(got["probs"], got["embeddings"]):
        assert len(embeddings) == 3 and list(embeddings) == list(probs)


def test_classify_without_a_model_is_refused():
    with pytest.raises(ValueError, match="classifier model"):
        vLLMEngineProcessorConfig(model_source=None, task_type="classify")


@pytest.mark.slow
def test_generate_default_model_is_the_bundled_chat_model():
    """``model_source=None`` for generate: dfllm's bundled chat model, its template rendered."""
    config = vLLMEngineProcessorConfig(model_source=None, engine_kwargs={"max_model_len": 256})
    got = build_processor(
        config,
        preprocess=lambda r: dict(
            messages=[{"role": "user", "content": r["q"]}], sampling_params=dict(temperature=0.0, max_tokens=2)
        ),
        postprocess=lambda r: dict(prompt=r["prompt"], n=r["num_generated_tokens"], tokens=list(r["generated_tokens"])),
    )(pd.DataFrame({"q": ["hi"]}))
    assert "llm_error" not in got.columns and got.loc[0, "prompt"].endswith("assistant\n")
    assert len(got.loc[0, "tokens"]) == got.loc[0, "n"] == 2
