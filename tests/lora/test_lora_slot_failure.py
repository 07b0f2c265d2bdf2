"""A LoRA adapter whose files break after its requests were queued, while the adapter is not
in the CPU cache (evicted: ``max_loras=1``, ``max_cpu_loras=1``), so that the step which puts
it into a slot must read it again.

Its requests, and only its, end with an error naming the adapter (name and path) and what is
wrong; the base model's requests and the other adapter's, in the same ``enqueue`` call, the
same ``generate`` call or the same dataframe partition, complete with exactly the tokens a run
without the broken adapter gives. A slot whose load failed never passes for that adapter's:
files repaired later are read again, not the weights that were in the slot before.
Real parts: the tiny random Llama, PEFT adapters written as safetensors folders.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from dfllm import LLM, LoRARequest, SamplingParams
from dfllm.engine.llm_engine import LLMEngine
from dfllm.lora.adapter import MODULES, LoRAAdapter
from dfllm.lora.manager import LoRAManager, LoRASlotError
from dfllm.models.spec import ModelSpec
from dfllm.outputs import RequestFailedError

from helpers import make_adapter, random_prompts

pytestmark = pytest.mark.timeout(300)

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
SP = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
ENGINE = dict(
    enable_lora=True,
    max_loras=1,  # one slot: every switch of adapter loads one
    max_cpu_loras=1,  # one adapter on the CPU: the others are read again from their folders
    max_lora_rank=8,
    max_model_len=64,
    kv_cache_memory_bytes=1 << 22,
    device="cpu",
)
# the broken adapter first: its rows are scheduled in the first step
NAMES = ["a1", "a2", None, "a1", None, "a1", "a2"]  # a2 checked last: a1 is not in the CPU cache
PROMPTS = random_prompts(len(NAMES), 5, 11, seed=3)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("slot-failure")
    return {
        "a1": make_adapter(tiny_llama, root / "a1", 21, 4, ["q_proj", "v_proj", "down_proj"]),
        "a2": make_adapter(tiny_llama, root / "a2", 22, 4, ["q_proj", "o_proj"]),
    }


def copy_adapters(pristine: dict[str, Path], root: Path) -> dict[str, Path]:
    out = {}
    for name, src in pristine.items():
        (root / name).mkdir(parents=True)
        for f in (CONFIG, WEIGHTS):
            shutil.copy(src / f, root / name / f)
        out[name] = root / name
    return out


def lora_requests(folders: dict[str, Path]) -> dict[str | None, LoRARequest | None]:
    return {None: None, "a1": LoRARequest("a1", 1, str(folders["a1"])), "a2": LoRARequest("a2", 2, str(folders["a2"]))}


def run(llm: LLM, loras, names: list, prompts: list[list[int]] = PROMPTS) -> list:
    """The prompts whose name is not ``"-"`` (one ``enqueue`` call) run to the end: their
    outputs, failed or not."""
    llm.enqueue(
        [{"prompt_token_ids": p} for p, n in zip(prompts, names) if n != "-"],
        SP,
        lora_request=[loras[n] for n in names if n != "-"],
    )
    try:
        return llm.wait_for_completion(use_tqdm=False)
    except RequestFailedError as exc:
        return exc.outputs


def without_a1(model: Path, loras, names: list, prompts: list[list[int]] = PROMPTS) -> dict[int, list[int]]:
    """The tokens of each prompt whose adapter is not a1, from a fresh engine that never sees a1."""
    kept = [n if n != "a1" else "-" for n in names]
    outs = iter(run(LLM(str(model), **ENGINE), loras, kept, prompts))
    return {i: next(outs).outputs[0].token_ids for i, n in enumerate(kept) if n != "-"}


@pytest.fixture(scope="module")
def want(pristine, tiny_llama, tmp_path_factory) -> dict[int, list[int]]:
    """The tokens of every prompt of ``NAMES`` whose adapter is not a1, from a run without a1's
    requests, and those of a1's prompts from a run of a1 alone (which differ from a2's and the
    base model's on the same prompts)."""
    folders = copy_adapters(pristine, tmp_path_factory.mktemp("want"))
    loras = lora_requests(folders)
    got = without_a1(tiny_llama, loras, NAMES)
    mine = [i for i, n in enumerate(NAMES) if n == "a1"]
    llm = LLM(str(tiny_llama), **ENGINE)
    for name in ("a1", "a2", None):
        outs = run(llm, loras, [name] * len(mine), [PROMPTS[i] for i in mine])
        tokens = [o.outputs[0].token_ids for o in outs]
        if name == "a1":
            got.update(zip(mine, tokens))
        else:
            assert tokens != [got[i] for i in mine]
    return got


def break_adapter(folder: Path, kind: str) -> str:
    """Break the adapter in ``folder``; what its error says."""
    if kind == "deleted":
        shutil.rmtree(folder)
        return "not a directory"
    if kind == "truncated":
        data = (folder / WEIGHTS).read_bytes()
        (folder / WEIGHTS).write_bytes(data[: len(data) // 2])
        return "cannot be read"
    if kind == "not_safetensors":
        (folder / WEIGHTS).write_text("this is not a safetensors file")
        return "cannot be read"
    assert kind == "bad_shapes"
    tensors = load_file(folder / WEIGHTS)
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = torch.randn(tensors[key].shape[0], tensors[key].shape[1] + 3)
    save_file(tensors, folder / WEIGHTS)
    return "do not fit"


def check(outs, want: dict[int, list[int]], names: list, folder: Path, why: str) -> None:
    """One output per request, in order: the broken adapter's each an error naming it and what
    is wrong, every other one the tokens of a run without it."""
    assert len(outs) == len(names)
    for i, (name, out) in enumerate(zip(names, outs)):
        done = out.outputs[0]
        if name == "a1":
            assert done.finish_reason == "error" and done.token_ids == [], (i, done)
            assert "'a1'" in done.error and str(folder) in done.error and why in done.error, done.error
        else:
            assert done.finish_reason != "error", (i, done.error)
            assert done.token_ids == want[i], (i, name)


@pytest.mark.parametrize("kind", ["deleted", "truncated", "not_safetensors", "bad_shapes"])
def test_adapter_broken_between_enqueue_and_step_fails_only_its_requests(pristine, want, tiny_llama, tmp_path, kind):
    """One ``enqueue`` call (one group) mixes a1, a2 and the base model; a1 was evicted from
    the CPU cache by a2's check and breaks before the first step, which schedules a1's rows."""
    folders = copy_adapters(pristine, tmp_path)
    loras = lora_requests(folders)
    llm = LLM(str(tiny_llama), **ENGINE)
    llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], SP, lora_request=[loras[n] for n in NAMES])
    assert llm.llm_engine.list_loras() == {2}  # a1 must be read again
    why = break_adapter(folders["a1"], kind)
    with pytest.raises(RequestFailedError) as failed:
        llm.wait_for_completion(use_tqdm=False)
    assert failed.value.failed == [i for i, n in enumerate(NAMES) if n == "a1"]
    check(failed.value.outputs, want, NAMES, folders["a1"], why)
    # the engine goes on: the same prompts again, a1 repaired, give every request its tokens
    # (a1's read anew, not whatever the slot held when its load failed)
    shutil.rmtree(folders["a1"], ignore_errors=True)
    shutil.copytree(pristine["a1"], folders["a1"])
    again = run(llm, loras, NAMES)
    assert [o.outputs[0].token_ids for o in again] == [want[i] for i in range(len(NAMES))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_adapter_broken_while_other_adapters_run_fails_only_its_requests(
    pristine, tiny_llama, tmp_path, async_scheduling
):
    """a1's rows wait (one slot) while a2's and the base model's run; a1 breaks between two
    steps of one ``generate`` call, before its rows are scheduled. A copy of an a1 request
    (deduplicated: it follows the first) fails with it; a copy of an a2 request completes."""
    folders = copy_adapters(pristine, tmp_path)
    loras = lora_requests(folders)
    llm = LLM(str(tiny_llama), **ENGINE, async_scheduling=async_scheduling)
    # a2 checked last: a1 is read again when its rows run
    names = ["a2", None, "a1", "a1", None, "a2", "a1", "a2"]
    prompts = PROMPTS[:6] + [PROMPTS[2], PROMPTS[0]]
    engine = llm.llm_engine
    real_step = engine.step
    steps = []

    def step(*args, **kwargs):
        if len(steps) == 1:  # after the first step (a2's and the base model's rows), before a1's
            assert engine.list_loras() == {2} and engine.lora.slots == [2]
            assert sorted(engine.following) == [ids[6], ids[7]]  # the two copies follow
            break_adapter(folders["a1"], "not_safetensors")
        steps.append(True)
        return real_step(*args, **kwargs)

    engine.step = step  # type: ignore[method-assign]
    real_add, ids = engine.add_request, []

    def add_request(request_id, *args, **kwargs):
        ids.append(request_id)
        return real_add(request_id, *args, **kwargs)

    engine.add_request = add_request  # type: ignore[method-assign]
    with pytest.raises(RequestFailedError) as failed:
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SP, lora_request=[loras[n] for n in names], use_tqdm=False
        )
    assert failed.value.failed == [2, 3, 6]
    want = without_a1(tiny_llama, loras, names, prompts)
    check(failed.value.outputs, want, names, folders["a1"], "cannot be read")
    assert len(steps) > 2 and not engine.has_unfinished_requests()


def test_dataframe_rows_of_an_adapter_broken_before_the_step_fail_alone(pristine, tiny_llama, tmp_path, monkeypatch):
    """A dataframe partition (one group) with a1, a2 and base-model rows; a1's weights turn to
    garbage when the engine starts stepping: a1's rows carry an error naming it, every other row
    its text, as a run without a1's rows gives."""
    folders = copy_adapters(pristine, tmp_path)
    names = ["a1", "a2", None, "a1", "a2", None]
    q = ["hello there", "the sky is", "one two three", "four five", "a b c", "green"]
    kwargs = dict(
        model=str(tiny_llama),
        sampling_params={"temperature": 0.0, "max_tokens": 4, "ignore_eos": True},
        lora="ad",
        **{k: v for k, v in ENGINE.items() if k not in ("enable_lora", "device")},
    )
    keep = [i for i, n in enumerate(names) if n != "a1"]
    base = pd.DataFrame({"q": [q[i] for i in keep], "ad": [names[i] and str(folders[names[i]]) for i in keep]})
    want = list(base.llm.generate("{q}", **kwargs).generated_text)

    real_step = LLMEngine.step
    broke = []

    def step(self, *args, **kwargs):
        if not broke:
            broke.append(True)
            (folders["a1"] / WEIGHTS).write_bytes(b"garbage")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "step", step)
    df = pd.DataFrame({"q": q, "ad": [n and str(folders[n]) for n in names]})
    got = df.llm.generate("{q}", **kwargs)
    assert broke and len(got) == len(df)
    for i, name in enumerate(names):
        if name == "a1":
            assert pd.isna(got.generated_text.iloc[i]), i
            assert "a1" in got.llm_error.iloc[i] and str(folders["a1"]) in got.llm_error.iloc[i]
        else:
            assert pd.isna(got.llm_error.iloc[i]), (i, got.llm_error.iloc[i])
            assert got.generated_text.iloc[i] == want[keep.index(i)], i


def test_a_slot_whose_adapter_cannot_be_read_is_left_as_it_was(pristine, tiny_llama, tmp_path):
    """The manager reads every adapter a step needs before it touches a slot: two broken
    adapters of one step are both named, nothing is copied into a slot, and no slot passes
    for an adapter whose copy did not happen (repaired files are read and copied in then)."""
    folders = copy_adapters(pristine, tmp_path)
    for extra in ("a3", "a4"):  # two more adapters (a2's files under other names and ids)
        shutil.copytree(pristine["a2"], tmp_path / extra)
        folders[extra] = tmp_path / extra
    loaded: list[tuple[int, str | None]] = []

    def load_slot(slot: int, adapter: LoRAAdapter | None) -> None:
        loaded.append((slot, None if adapter is None else adapter.request.lora_name))

    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(tiny_llama))
    manager = LoRAManager(spec, 2, 8, 2, load_slot, set(MODULES))
    r1, r2, r3, r4 = (LoRARequest(f"a{i}", i, str(folders[f"a{i}"])) for i in (1, 2, 3, 4))
    assert manager.activate({1: r1, 2: r2}) == {1: 0, 2: 1}
    assert manager.activate({3: r3}) == {3: 0}  # a1's slot, the least recently used
    manager.cpu.clear()  # evicted from the CPU cache: read again when a step needs them
    why1 = break_adapter(folders["a1"], "not_safetensors")
    why4 = break_adapter(folders["a4"], "deleted")
    loaded.clear()
    with pytest.raises(LoRASlotError) as failed:
        manager.activate({1: r1, 4: r4})
    assert set(failed.value.errors) == {1, 4}
    for lid in (1, 4):
        msg, name = str(failed.value.errors[lid]), f"a{lid}"
        assert f"'{name}'" in msg and str(folders[name]) in msg and (why1 if lid == 1 else why4) in msg
    assert loaded == [] and manager.slots == [3, 2]  # nothing copied, nothing claimed
    shutil.copytree(pristine["a2"], folders["a4"])
    with pytest.raises(LoRASlotError) as failed:  # a1 alone still broken: the slots stay as they are
        manager.activate({1: r1, 4: r4})
    assert set(failed.value.errors) == {1} and loaded == [] and manager.slots == [3, 2]
    shutil.copy(pristine["a1"] / WEIGHTS, folders["a1"] / WEIGHTS)
    assert manager.activate({1: r1, 2: r2}) == {1: 0, 2: 1} and loaded == [(0, "a1")]
