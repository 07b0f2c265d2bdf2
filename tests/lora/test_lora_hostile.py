"""LoRA adapters under hostile conditions: files that change between jobs, files that break
after they were checked, colliding ids, tensors that are not finite or not floating point, a
row's adapter that is no text, and a non-finite adapter in a kernel slot no row uses.

Every input row comes out exactly once, with its output or its error naming the adapter
(or the column); an answer served from the response cache is the one the adapter whose
files are in the folder now gives. Real parts: the tiny random Llama, PEFT adapters.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import dfllm
import dfllm.lora.manager as manager_module
from dfllm.kernels.lora import lora_apply, lora_metadata, lora_reference
from dfllm.lora.adapter import LoRAAdapterError, load_adapter
from dfllm.lora.request import LoRARequest
from dfllm.lora.resolve import adapter_identity
from dfllm.models.spec import ModelSpec

from helpers import make_adapter

pytestmark = pytest.mark.timeout(600)

SP = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
ENGINE = {"max_model_len": 64, "kv_cache_memory_bytes": 1 << 22}
Q = ["hello there", "the sky is", "one two three"]
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-adapters")
    return {
        "a1": make_adapter(tiny_llama, root / "a1", 11, 4, ["q_proj", "v_proj"]),
        "a2": make_adapter(tiny_llama, root / "a2", 12, 4, ["q_proj", "v_proj"]),
        "a3": make_adapter(tiny_llama, root / "a3", 13, 4, ["o_proj"]),
    }


def generate(df: pd.DataFrame, model: Path, **kwargs) -> pd.DataFrame:
    return df.llm.generate("{q}", model=str(model), sampling_params=SP, **ENGINE, **kwargs)


@pytest.fixture(scope="module")
def want(adapters, tiny_llama) -> dict:
    """Each adapter's (and the base model's: None) greedy text for each prompt, each run from
    its own folder."""
    df = pd.DataFrame({"q": Q})
    out = {None: list(generate(df, tiny_llama).generated_text)}
    for name, path in adapters.items():
        out[name] = list(generate(df, tiny_llama, lora=str(path)).generated_text)
    assert len({tuple(v) for v in out.values()}) == len(out)  # every adapter changes the output
    return out


def copy_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG, WEIGHTS):
        shutil.copy(src / name, dst / name)


# ---- L1: the files an adapter runs from are the files the cache key names --------------------------------
def test_changed_files_are_another_adapter_for_engine_and_cache(adapters, want, tiny_llama, tmp_path):
    """Job 1 runs a folder holding a1 with a response cache; a2's files are copied over the
    folder; job 2 (same process, same engine) runs a2, not the a1 the engine read before,
    and stores a2's answers: job 3 is served a2's answers from the cache."""
    folder = tmp_path / "adapter"
    copy_files(adapters["a1"], folder)
    df = pd.DataFrame({"q": Q, "ad": [str(folder)] * len(Q)})
    cache = str(tmp_path / "cache")
    one = generate(df, tiny_llama, lora="ad", cache=cache, engine_columns="from_cache")
    assert list(one.generated_text) == want["a1"]
    copy_files(adapters["a2"], folder)
    two = generate(df, tiny_llama, lora="ad", cache=cache, engine_columns="from_cache")
    assert list(two.generated_text) == want["a2"] and not two.from_cache.any()
    three = generate(df, tiny_llama, lora="ad", cache=cache, engine_columns="from_cache")
    assert list(three.generated_text) == want["a2"] and three.from_cache.all()
    copy_files(adapters["a1"], folder)  # back to a1: its entries answer again
    four = generate(df, tiny_llama, lora="ad", cache=cache, engine_columns="from_cache")
    assert list(four.generated_text) == want["a1"] and four.from_cache.all()


def test_an_adapter_whose_files_changed_since_it_was_resolved_is_not_run(adapters, tiny_llama, tmp_path):
    """A request carries the identity of the files its cache key names: files that hold
    something else by the time the engine reads them are that adapter's error."""
    folder = tmp_path / "adapter"
    copy_files(adapters["a1"], folder)
    request = LoRARequest.for_path(str(folder), identity=adapter_identity(str(folder)))
    copy_files(adapters["a2"], folder)
    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(tiny_llama))
    with pytest.raises(LoRAAdapterError, match="files changed"):
        load_adapter(request, spec, 8)
    fresh = LoRARequest.for_path(str(folder), identity=adapter_identity(str(folder)))
    assert fresh.lora_int_id != request.lora_int_id
    assert load_adapter(fresh, spec, 8).identity == fresh.identity == adapter_identity(str(adapters["a2"]))


# ---- L2: an evicted adapter that cannot be read again fails its rows only ----------------------------------
def test_an_evicted_adapter_that_breaks_fails_only_its_rows(adapters, want, tiny_llama, tmp_path, monkeypatch):
    """Three adapters, max_cpu_loras=2: a1 is evicted after its rows were checked and read
    again when they are queued; its weights file is garbage by then. a1's rows get an error
    naming it; the other adapters' rows and the base model's rows complete."""
    for name in adapters:
        copy_files(adapters[name], tmp_path / name)
    broken = tmp_path / "a1"
    reads: dict[str, int] = {}
    real_load = manager_module.load_adapter

    def load_then_break(request, *args, **kwargs):  # the real loader; the file breaks after the first read
        reads[request.lora_path] = reads.get(request.lora_path, 0) + 1
        if request.lora_path == str(broken) and reads[request.lora_path] == 2:
            (broken / WEIGHTS).write_bytes(b"garbage")
        return real_load(request, *args, **kwargs)

    monkeypatch.setattr(manager_module, "load_adapter", load_then_break)
    names = ["a1", "a2", "a3", None, "a1", "a2"]
    df = pd.DataFrame({"q": [Q[i % len(Q)] for i in range(len(names))], "ad": [n and str(tmp_path / n) for n in names]})
    got = generate(df, tiny_llama, lora="ad", max_loras=2, max_cpu_loras=2)
    assert len(got) == len(df)
    for i, name in enumerate(names):
        if name == "a1":
            assert pd.isna(got.generated_text.iloc[i]) and str(broken) in got.llm_error.iloc[i]
        else:
            assert pd.isna(got.llm_error.iloc[i]) and got.generated_text.iloc[i] == want[name][i % len(Q)]


# ---- L3: adapter ids never clash ---------------------------------------------------------------------------
def _hashed(text: str) -> int:
    """A 31-bit id hashed from ``text``, as adapter ids are (before any collision is resolved)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "big") % (2**31 - 1) + 1


def _colliding_names(root: Path, prefix: str, key1, key2) -> tuple[str, str]:
    """Two folder names under ``root`` with ``_hashed(key1(first)) == _hashed(key2(second))``
    (about 2**16 tries: the birthday bound of 31-bit ids)."""
    ids: dict[int, str] = {}
    k = 0
    while True:
        name = str(root / f"{prefix}-{k}")
        other = ids.get(_hashed(key2(name)))
        if other is not None and other != name:
            return other, name
        ids[_hashed(key1(name))] = name
        k += 1


@pytest.mark.parametrize("hashed_from", ["name", "name and files"])
def test_colliding_ids_are_moved_apart(adapters, want, tiny_llama, tmp_path, hashed_from):
    """Two different adapters whose names (or names and contents) hash to the same 31-bit
    id: both run, each its own (on the same prompt too: their prefix-cache chains stay
    apart), and each keeps its id."""
    from dfllm.lora.resolve import resolve

    i1, i2 = adapter_identity(str(adapters["a1"])), adapter_identity(str(adapters["a2"]))
    if hashed_from == "name":
        first, second = _colliding_names(tmp_path, "n", lambda n: n, lambda n: n)
    else:
        first, second = _colliding_names(tmp_path, "f", lambda n: f"{n}\0{i1}", lambda n: f"{n}\0{i2}")
    copy_files(adapters["a1"], Path(first))
    copy_files(adapters["a2"], Path(second))
    df = pd.DataFrame({"q": [Q[0], Q[0], Q[1], Q[1]], "ad": [first, second, second, first]})
    got = generate(df, tiny_llama, lora="ad")
    assert got.llm_error.isna().all(), list(got.llm_error)
    assert list(got.generated_text) == [want["a1"][0], want["a2"][0], want["a2"][1], want["a1"][1]]
    r1, r2 = resolve(first), resolve(second)
    assert r1.lora_int_id != r2.lora_int_id and resolve(first) == r1  # the same adapter keeps its id


# ---- L5: tensors and configs that cannot serve, refused by name ----------------------------------------------
def _corrupt(src: Path, dst: Path, kind: str, pick: int) -> str:
    """A copy of adapter ``src`` at ``dst`` with one tensor (the ``pick``-th key) made
    ``kind``; the name the error must give (a tensor's key, or lora_alpha)."""
    copy_files(src, dst)
    tensors = load_file(dst / WEIGHTS)
    keys = sorted(tensors)
    key = keys[pick % len(keys)]
    t = tensors[key]
    if kind == "nan":
        t = t.clone()
        t.view(-1)[0] = float("nan")
    elif kind == "inf":
        t = t.clone()
        t.view(-1)[-1] = float("-inf")
    elif kind == "float64 overflow":
        t = t.double()
        t.view(-1)[0] = 1e300
    elif kind == "int32":
        t = t.to(torch.int32)
    elif kind == "bool":
        t = t != 0
    elif kind == "given twice":
        key = [k for k in keys if "lora_A" in k][pick % (len(keys) // 2)]
        tensors[key.replace(".weight", ".default.weight")] = tensors[key].clone()
        save_file(tensors, dst / WEIGHTS, metadata={"format": "pt"})
        return key.replace(".weight", ".default.weight").rsplit(".lora_A", 1)[0]
    elif kind == "huge alpha":
        cfg = json.loads((dst / CONFIG).read_text())
        cfg["lora_alpha"] = 1e300
        (dst / CONFIG).write_text(json.dumps(cfg))
        return "lora_alpha"
    tensors[key] = t.contiguous()
    save_file(tensors, dst / WEIGHTS, metadata={"format": "pt"})
    return key


KINDS = ["nan", "inf", "float64 overflow", "int32", "bool", "given twice", "huge alpha"]


@SETTINGS
@given(kind=st.sampled_from(KINDS), pick=st.integers(0, 63))
@example(kind="nan", pick=0)
@example(kind="int32", pick=1)
@example(kind="bool", pick=2)
@example(kind="given twice", pick=0)
@example(kind="huge alpha", pick=0)
def test_tensors_that_cannot_serve_are_refused_by_name(adapters, tiny_llama, tmp_path_factory, kind, pick):
    folder = tmp_path_factory.mktemp("bad") / "adapter"
    named = _corrupt(adapters["a1"], folder, kind, pick)
    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(tiny_llama))
    request = LoRARequest("bad", 1, str(folder))
    with pytest.raises(LoRAAdapterError) as info:
        load_adapter(request, spec, 8)
    assert named in str(info.value) and str(folder) in str(info.value)


def test_bad_adapters_and_undecodable_names_are_their_rows_errors(adapters, want, tiny_llama, tmp_path):
    """A column mixing good adapters, hostile ones and a lone surrogate: each row once,
    with its output or its error naming the tensor or the column."""
    nan_dir, int_dir = tmp_path / "nan", tmp_path / "int"
    nan_key = _corrupt(adapters["a2"], nan_dir, "nan", 0)
    int_key = _corrupt(adapters["a2"], int_dir, "int32", 1)
    column = [str(adapters["a1"]), str(nan_dir), "\ud800adapter", None, str(int_dir), str(adapters["a1"])]
    df = pd.DataFrame({"q": [Q[i % len(Q)] for i in range(len(column))], "my_adapter": pd.Series(column, dtype=object)})
    got = generate(df, tiny_llama, lora="my_adapter")
    assert len(got) == len(df)
    errors = list(got.llm_error)
    assert nan_key in errors[1] and int_key in errors[4] and "my_adapter" in errors[2]
    for i in (0, 3, 5):
        assert pd.isna(errors[i]) and got.generated_text.iloc[i] == want["a1" if column[i] else None][i % len(Q)]


# ---- L6: a non-finite adapter in an unused slot never reaches a row -------------------------------------------
SCATTERED = [0, 0, 2, -1, 3, 2, 0, 3, 3, 2, -1, 0]  # slots 0, 2, 3 scattered: batched, padding added to row 0
SORTED = [-1, 0, 0, 2, 2, 2, 3, 3, 3, 3]  # sorted by slot: batched, padding never read back


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    slots=st.lists(st.sampled_from([-1, 0, 2, 3]), min_size=3, max_size=24),
    poison=st.sampled_from(["a", "b", "both"]),
    value=st.sampled_from([float("nan"), float("inf")]),
)
@example(slots=SCATTERED, poison="a", value=float("nan"))
@example(slots=SCATTERED, poison="b", value=float("inf"))
@example(slots=SORTED, poison="both", value=float("nan"))
def test_non_finite_adapter_in_an_unused_slot_stays_there(slots, poison, value):
    g = torch.Generator().manual_seed(len(slots))
    t, k, n, r = len(slots), 24, 40, 8
    x = torch.randn(t, k, generator=g)
    a = torch.randn(4, r, k, generator=g)
    b = torch.randn(4, n, r, generator=g)
    if poison in ("a", "both"):
        a[1] = value  # slot 1: loaded once, used by no row of this step
    if poison in ("b", "both"):
        b[1] = value
    y = torch.randn(t, n, generator=g)
    meta = lora_metadata(slots, torch.device("cpu"))
    if meta is None:
        return
    ranks = [r, r, r, r]
    want = y + lora_reference(x, a, b, torch.tensor(slots))
    for reduce in (None, lambda s: s):
        got = lora_apply(x, y.clone(), a, b, meta, ranks, reduce=reduce)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_the_scattered_and_sorted_cases_take_the_batched_path():
    """The examples above reach the path with padding (the one that had the leak)."""
    for slots, unpadded in ((SCATTERED, False), (SORTED, True)):
        meta = lora_metadata(slots, torch.device("cpu"))
        assert meta is not None and meta.batched and (meta.unpad is not None) == unpadded


@pytest.fixture(autouse=True, scope="module")
def _release():
    yield
    dfllm.release_engines()
