"""A pooling model's inputs are checked and tokenized by its engine's input processor, the
one place generation's inputs are checked too: ``LLM.embed``/``classify``/``enqueue`` and
``InputProcessor.process_pooling`` refuse a bad prompt with the same error, naming it, and
the engine runs the requests the processor builds."""

from __future__ import annotations

import pytest
import torch

from dfllm import LLM, PoolingParams
from dfllm.engine.input_processor import InputProcessor, PoolingRequest


@pytest.fixture(scope="module")
def minilm():
    return LLM("all-minilm-l6-v2")


@pytest.mark.parametrize(
    "prompts, params, truncate, match",
    [
        (["fine", {"prompt_token_ids": [1, 10**9]}], None, None, "Token id 1000000000 is out of vocabulary (prompt 1:"),
        (["fine", {"prompt_token_ids": []}], None, None, "prompt 1 is empty"),
        (["fine", 3], None, None, "Prompt should be a string, list of tokens, or dictionary (prompt 1: expected a str"),
        (["fine", "bad \ud800"], None, None, "prompt 1 is not valid Unicode"),
        (["fine", {"prompt_token_ids": "12"}], None, None, "prompt 1: prompt_token_ids must be a list of ints"),
        ([{"multi_modal_data": {"image": "x.png"}}], None, None, "is a text-only model; image embeddings need"),
        (
            ["a", "b"],
            [PoolingParams()],
            None,
            "The lengths of prompts (2) and params (1) must be the same. (got 1 pooling_params",
        ),
        (["a"], {"normalize": True}, None, "pooling_params must be a PoolingParams or a list of them"),
        (
            ["a", "b"],
            [PoolingParams(), PoolingParams(task="classify")],
            None,
            "You cannot overwrite param.task='classify' with pooling_task='embed'! (pooling_params of prompt 1: "
            "task='classify' is not this call's 'embed')",
        ),
        (["a"], None, -5, "truncate_prompt_tokens must be a positive int or -1, got -5"),
    ],
)
def test_a_bad_prompt_is_refused_by_the_input_processor_as_by_embed(minilm, prompts, params, truncate, match):
    processor = minilm.pooling_engine.input_processor
    assert isinstance(processor, InputProcessor)
    with pytest.raises(ValueError) as direct:
        processor.process_pooling(prompts, params, truncate, "embed")
    with pytest.raises(ValueError) as called:
        minilm.embed(prompts, params, truncate_prompt_tokens=truncate, use_tqdm=False)
    assert type(called.value) is type(direct.value)
    assert str(called.value) == str(direct.value)
    assert match in str(direct.value)
    if "task=" not in match and truncate is None:  # enqueue: each request's own task, no truncate argument
        with pytest.raises(ValueError) as queued:
            minilm.enqueue(prompts, params)
        assert str(queued.value) == str(direct.value)
        assert minilm.wait_for_completion(use_tqdm=False) == []  # nothing of a refused call was queued


def test_the_engine_runs_the_requests_the_input_processor_builds(minilm, monkeypatch):
    processor = minilm.pooling_engine.input_processor
    texts = [
        "A cat sleeps.",
        "Data engineers run batch jobs over parquet files.",
        {"prompt_token_ids": [101, 7592, 102]},
    ]
    requests = processor.process_pooling(texts, None)
    assert all(isinstance(r, PoolingRequest) for r in requests)
    want = minilm.embed(texts, use_tqdm=False)
    assert [r.prompt_token_ids for r in requests] == [o.prompt_token_ids for o in want]
    got = minilm.pooling_engine.encode(requests, "embed")
    for g, w in zip(got, want):
        assert g.tolist() == pytest.approx(w.outputs.embedding, abs=1e-6)
    # LLM.embed truncates with this processor's limit: it tokenizes through it, not on its own
    monkeypatch.setattr(processor, "max_model_len", 4)
    assert [len(o.prompt_token_ids) for o in minilm.embed(texts, use_tqdm=False)] == [4, 4, 3]
    assert torch.equal(
        minilm.encode(texts[1], pooling_task="token_embed", use_tqdm=False)[0].outputs.data,
        minilm.pooling_engine.encode(processor.process_pooling(texts[1], None), "token_embed")[0],
    )
