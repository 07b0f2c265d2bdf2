"""A LoRA adapter whose files break between the check of a pooling call's requests and the
batch that puts it into a slot (it is not in the CPU cache then: ``max_cpu_loras=1`` and
another adapter was checked after it), on a tiny random Llama run with ``runner="pooling"``.

Only that adapter's prompts fail: the call raises ``RequestFailedError`` naming them, each
with ``finished=False`` and the adapter's error (its name and path) in the message, and every
other prompt's output is exactly what a call without the broken adapter's prompts gives (the
rest of the call is batched again without them). The engine goes on: repaired files are read
again. As the generation engine's contract (tests/lora/test_lora_slot_failure.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dfllm import LLM, LoRARequest, RequestFailedError

from helpers import make_adapter

pytestmark = pytest.mark.timeout(300)

ENGINE = dict(runner="pooling", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
TEXTS = [
    "a longer text about dataframes, engines and object storage",
    "short",
    "mid length text here",
    "parquet partitions",
    "one",
    "batch inference over many rows of a table",
    "two words",
]
NAMES = ["a2", None, "a1", "a1", None, "a2", "a1"]  # a1 is checked first, then evicted by a2's check


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool-lora")
    return {
        "a1": make_adapter(tiny_llama, root / "a1", 21, 4, ["q_proj", "v_proj", "down_proj"]),
        "a2": make_adapter(tiny_llama, root / "a2", 22, 4, ["q_proj", "o_proj"]),
    }


def copy_adapters(pristine: dict[str, Path], root: Path) -> dict[str, Path]:
    for name, src in pristine.items():
        shutil.copytree(src, root / name)
    return {name: root / name for name in pristine}


def loras(folders: dict[str, Path], names: list) -> list[LoRARequest | None]:
    ids = {"a1": 1, "a2": 2}
    return [None if n is None else LoRARequest(n, ids[n], str(folders[n])) for n in names]


def break_after_check(llm: LLM, folder: Path, evict: int | None = None) -> None:
    """Make ``folder``'s adapter unreadable once the call's requests are checked, before its
    batches; ``evict``: drop that adapter id from the CPU cache then too (as another adapter's
    load would)."""
    engine = llm.pooling_engine
    real = engine.encode

    def encode(*args, **kwargs):
        engine.encode = real  # type: ignore[method-assign]
        (folder / "adapter_model.safetensors").write_text("this is not a safetensors file")
        if evict is not None:
            engine.lora.cpu.pop(evict)
        return real(*args, **kwargs)

    engine.encode = encode  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def want(pristine, tiny_llama, tmp_path_factory) -> dict[int, list[float]]:
    """Each non-a1 prompt's embedding from a call without a1's prompts (a fresh engine)."""
    folders = copy_adapters(pristine, tmp_path_factory.mktemp("want"))
    kept = [i for i, n in enumerate(NAMES) if n != "a1"]
    outs = LLM(str(tiny_llama), **ENGINE).embed(
        [TEXTS[i] for i in kept], lora_request=loras(folders, [NAMES[i] for i in kept]), use_tqdm=False
    )
    return {i: o.outputs.embedding for i, o in zip(kept, outs)}


def test_broken_adapter_fails_only_its_embed_prompts(pristine, want, tiny_llama, tmp_path):
    folders = copy_adapters(pristine, tmp_path)
    llm = LLM(str(tiny_llama), **ENGINE)
    break_after_check(llm, folders["a1"])
    with pytest.raises(RequestFailedError) as failed:
        llm.embed(TEXTS, lora_request=loras(folders, NAMES), use_tqdm=False)
    mine = [i for i, n in enumerate(NAMES) if n == "a1"]
    assert failed.value.failed == mine
    assert "'a1'" in str(failed.value) and str(folders["a1"]) in str(failed.value)
    outs = failed.value.outputs
    assert len(outs) == len(TEXTS)
    for i, out in enumerate(outs):
        if i in mine:
            assert not out.finished and out.outputs.embedding == [], i
        else:
            assert out.finished and out.outputs.embedding == want[i], i  # exactly, not approximately
    # the engine goes on: a1 repaired is read again and every prompt runs
    shutil.rmtree(folders["a1"])
    shutil.copytree(pristine["a1"], folders["a1"])
    again = llm.embed(TEXTS, lora_request=loras(folders, NAMES), use_tqdm=False)
    assert all(again[i].outputs.embedding == want[i] for i in want)
    base = llm.embed([TEXTS[i] for i in mine], use_tqdm=False)
    assert all(again[i].outputs.embedding != b.outputs.embedding for i, b in zip(mine, base))


def test_broken_adapter_fails_the_pairs_it_scores_and_encode(pristine, tiny_llama, tmp_path):
    folders = copy_adapters(pristine, tmp_path)
    llm = LLM(str(tiny_llama), **ENGINE)
    a1, a2 = loras(folders, ["a1", "a2"])
    # score: one adapter for every text; checked (cached), then dropped from the cache and broken
    break_after_check(llm, folders["a1"], evict=1)
    with pytest.raises(RequestFailedError) as failed:
        llm.score("query", ["doc one", "doc two"], lora_request=a1, use_tqdm=False)
    assert failed.value.failed == [0, 1] and "'a1'" in str(failed.value)
    assert all(not o.finished for o in failed.value.outputs)
    shutil.rmtree(folders["a1"])
    shutil.copytree(pristine["a1"], folders["a1"])
    # encode: a1 checked, then evicted from the CPU cache by a2's check
    break_after_check(llm, folders["a1"])
    with pytest.raises(RequestFailedError) as failed:
        llm.encode(TEXTS[:3], pooling_task="embed", lora_request=[None, a1, a2], use_tqdm=False)
    assert failed.value.failed == [1]
    outs = failed.value.outputs
    assert outs[0].finished and outs[2].finished and not outs[1].finished
    assert outs[1].outputs.data.numel() == 0
    alone = LLM(str(tiny_llama), **ENGINE).encode(
        [TEXTS[0], TEXTS[2]], pooling_task="embed", lora_request=[None, a2], use_tqdm=False
    )
    assert torch.equal(outs[0].outputs.data, alone[0].outputs.data)
    assert torch.equal(outs[2].outputs.data, alone[1].outputs.data)
