"""``LLM.enqueue``/``wait_for_completion`` on pooling models (vLLM's queue APIs take pooling
requests too): checked at enqueue time, run batched, returned in enqueue order, each once,
with the generative queue's error contract. The bundled MiniLM embedder and a tiny random
BERT classifier; a fault is injected by wrapping the real encoder, as tests/tasks/test_isolation.py
wraps the real detokenizer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dfllm import LLM, InvalidRequestError, PoolingParams, PoolingRequestOutput, RequestFailedError

from helpers import build_tiny_classifier

TEXTS = [
    "Paris is the capital of France.",
    "Trains run on rails.",
    "Berlin is in Germany.",
    "A short one.",
    "Data engineers run batch jobs over parquet files on object storage.",
]


@pytest.fixture(scope="module")
def embedder():
    return LLM("all-minilm-l6-v2")


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    return LLM(build_tiny_classifier(tmp_path_factory.mktemp("clf")))


def data(outs) -> list[torch.Tensor]:
    return [o.outputs.data for o in outs]


def test_embedder_queue_matches_embed(embedder):
    first = embedder.enqueue(TEXTS[:2])
    second = embedder.enqueue(TEXTS[2:], PoolingParams(normalize=False))
    assert len(set(first + second)) == len(TEXTS)
    outs = embedder.wait_for_completion(use_tqdm=False)
    assert all(type(o) is PoolingRequestOutput and o.finished for o in outs)
    assert [o.request_id for o in outs] == first + second  # enqueue order, each once
    want = embedder.embed(TEXTS[:2], use_tqdm=False) + embedder.embed(
        TEXTS[2:], PoolingParams(normalize=False), use_tqdm=False
    )
    for got, ref in zip(outs, want):
        assert torch.allclose(got.outputs.data, torch.tensor(ref.outputs.embedding), atol=1e-5)
        assert got.prompt_token_ids == ref.prompt_token_ids
    assert embedder.wait_for_completion(use_tqdm=False) == []  # nothing is returned twice


def test_task_per_request_and_token_ids(embedder):
    tok = embedder.get_tokenizer()
    ids = tok(TEXTS[0])["input_ids"]
    rids = embedder.enqueue(
        [TEXTS[1], {"prompt_token_ids": ids}, TEXTS[3]],
        [PoolingParams(), PoolingParams(task="token_embed"), PoolingParams(task="embed")],
    )
    outs = embedder.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == rids
    per_token = embedder.encode({"prompt_token_ids": ids}, pooling_task="token_embed", use_tqdm=False)[0]
    assert outs[1].outputs.data.shape == (len(ids), per_token.outputs.data.shape[1])
    assert torch.allclose(outs[1].outputs.data, per_token.outputs.data, atol=1e-5)
    assert outs[0].outputs.data.dim() == 1 and outs[2].outputs.data.dim() == 1


def test_classifier_queue_matches_classify(classifier):
    rids = classifier.enqueue(TEXTS[:3]) + classifier.enqueue(TEXTS[3], PoolingParams(use_activation=False))
    outs = classifier.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == rids
    want = classifier.classify(TEXTS[:3], use_tqdm=False)
    for got, ref in zip(outs, want):
        assert got.outputs.data.tolist() == pytest.approx(ref.outputs.probs, abs=1e-6)
    raw = classifier.classify(TEXTS[3], PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert outs[3].outputs.data.tolist() == pytest.approx(raw.outputs.probs, abs=1e-6)


def test_bad_requests_are_refused_at_enqueue(embedder, classifier):
    kept = embedder.enqueue(TEXTS[0])
    with pytest.raises(InvalidRequestError, match="prompt 1 is empty"):
        embedder.enqueue([TEXTS[1], {"prompt_token_ids": []}])
    with pytest.raises(InvalidRequestError, match="Token id 100000000 is out of vocabulary"):
        embedder.enqueue({"prompt_token_ids": [101, 10**8]})
    with pytest.raises(InvalidRequestError, match="Unsupported task: 'classify'"):
        embedder.enqueue(TEXTS[1], PoolingParams(task="classify"))
    with pytest.raises(InvalidRequestError, match="Unsupported task: 'embed'"):
        classifier.enqueue(TEXTS[1], PoolingParams(task="embed"))
    with pytest.raises(InvalidRequestError, match=r"The lengths of prompts \(1\) and priority \(2\) must be the same"):
        embedder.enqueue(TEXTS[1], priority=[1, 2])  # any priority is accepted, as in vLLM; a wrong length is not
    with pytest.raises(ValueError, match="task must be None or one of"):
        PoolingParams(task="score")
    with pytest.raises(ValueError, match="enqueue_chat: .* is loaded as a pooling model"):
        embedder.enqueue_chat([{"role": "user", "content": "hi"}])
    assert [o.request_id for o in embedder.wait_for_completion(use_tqdm=False)] == kept  # only the good one


class MarkerFault(RuntimeError):
    pass


class FaultyEncoder(nn.Module):
    """The real encoder, raising ``error`` for any batch holding ``marker``."""

    def __init__(self, inner: nn.Module, marker: int, error: type[BaseException] = MarkerFault):
        super().__init__()
        self.inner, self.marker, self.error = inner, marker, error

    def forward(self, ids, types, valid):
        if bool((ids == self.marker).any()):
            raise self.error(f"cannot encode token {self.marker}")
        return self.inner(ids, types, valid)


def test_a_failing_request_fails_alone():
    llm = LLM("all-minilm-l6-v2")
    want = data(llm.encode(TEXTS, pooling_task="embed", use_tqdm=False))
    marker = llm.get_tokenizer().convert_tokens_to_ids("zebra")
    real = llm.pooling_engine.model
    llm.pooling_engine.model = FaultyEncoder(real, marker)
    good = llm.enqueue(TEXTS[:2])
    bad = llm.enqueue({"prompt_token_ids": [101, marker, 102]})
    more = llm.enqueue(TEXTS[2:])
    with pytest.raises(RequestFailedError, match=rf"1 of 6 requests failed .*request {bad[0]}: MarkerFault") as info:
        llm.wait_for_completion(use_tqdm=False)
    outs = info.value.outputs
    assert [o.request_id for o in outs] == good + bad + more and info.value.failed == [2]
    assert not outs[2].finished and outs[2].outputs.data.numel() == 0
    for got, ref in zip(outs[:2] + outs[3:], want):
        assert got.finished and torch.allclose(got.outputs.data, ref, atol=1e-5)
    assert llm.wait_for_completion(use_tqdm=False) == []  # the failed one is not queued again

    # interrupted: nothing is lost, the requests stay queued for the next call
    llm.pooling_engine.model = FaultyEncoder(real, marker, KeyboardInterrupt)
    again = llm.enqueue([TEXTS[0], {"prompt_token_ids": [101, marker, 102]}])
    with pytest.raises(KeyboardInterrupt):
        llm.wait_for_completion(use_tqdm=False)
    llm.pooling_engine.model = real
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == again and all(o.finished for o in outs)
    assert torch.allclose(outs[0].outputs.data, want[0], atol=1e-5)
