"""LoRA adapter files written to break dfllm: configs whose rank disagrees with the tensors,
numbers too large for a float, strings and tensor names of megabytes, tensors of another
stack's layers (a vision tower's ``layers.N``), files far larger than any adapter, a named
pipe or ``/dev/zero`` in place of a file, weights that overflow the model's dtype, and a lone
surrogate in the folder's path.

Each is refused with a :class:`~dfllm.lora.adapter.LoRAAdapterError` naming the adapter and
the field, tensor or file; a file too large is refused before it is read. Adapters PEFT
writes, with ``rank_pattern`` or dotted ``target_modules``, still load with PEFT's weights.
Real parts: the tiny random Llama, PEFT, safetensors files.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

import dfllm
from dfllm import LLM, InvalidRequestError, LoRARequest, SamplingParams
from dfllm.lora.adapter import LoRAAdapterError, load_adapter, module_shapes
from dfllm.lora.resolve import adapter_identity, digest, read_files, resolve
from dfllm.models.spec import ModelSpec

from helpers import make_adapter

pytestmark = pytest.mark.timeout(300)

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
RANK = 8  # max_lora_rank of every load here


@pytest.fixture(scope="module")
def spec(tiny_llama) -> ModelSpec:
    return ModelSpec.from_hf(AutoConfig.from_pretrained(tiny_llama))


@pytest.fixture(scope="module")
def qv(tiny_llama, tmp_path_factory) -> Path:
    """A rank-4 PEFT adapter of q_proj and v_proj."""
    return make_adapter(tiny_llama, tmp_path_factory.mktemp("hostile-files") / "qv", 31, 4, ["q_proj", "v_proj"])


def copy_of(src: Path, dst: Path, **config) -> Path:
    """A copy of adapter ``src`` at ``dst``, its adapter_config.json's fields updated with ``config``."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / CONFIG).read_text())
    (dst / CONFIG).write_text(json.dumps({**cfg, **config}))
    return dst


def refused(folder: Path, spec: ModelSpec, **dtype) -> str:
    """The message of the error loading the adapter at ``folder`` raises (it names the folder)."""
    with pytest.raises(LoRAAdapterError) as info:
        load_adapter(LoRARequest("hostile", 1, str(folder)), spec, RANK, **dtype)
    message = str(info.value)
    assert "'hostile'" in message and str(folder) in message, message
    return message


def loaded(folder: Path, spec: ModelSpec):
    return load_adapter(LoRARequest("fine", 1, str(folder)), spec, RANK)


# ---- the config's rank is the tensors' rank -----------------------------------------------------------------
@pytest.mark.parametrize("r", [8, 2, 1])
def test_a_config_rank_other_than_the_tensors_is_refused(qv, spec, tmp_path, r):
    """PEFT cannot load rank-4 tensors under ``r=8`` (and vLLM would scale them by
    lora_alpha / 8): dfllm refuses rather than pick a scaling, naming r and the layer."""
    message = refused(copy_of(qv, tmp_path / "a", r=r), spec)
    assert f"r={r}" in message and "rank 4" in message and "layer 0" in message, message


@pytest.mark.parametrize("r", [4.5, 4.0, "4", True, -4, 0, None])
def test_a_rank_that_is_no_positive_whole_number_is_refused(qv, spec, tmp_path, r):
    message = refused(copy_of(qv, tmp_path / "a", r=r), spec)
    assert "r must be a positive" in message, message


def test_rank_pattern_loads_as_peft_merges_it(tiny_llama, spec, tmp_path):
    """PEFT's per-module ranks (``rank_pattern``): each module scaled by lora_alpha over its
    own rank, the merged weights those of PEFT's ``merge_and_unload``; a tensor of a rank
    neither ``r`` nor in ``rank_pattern`` is refused."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2})
    cfg.init_lora_weights = False
    peft = get_peft_model(model, cfg)
    peft.save_pretrained(tmp_path / "pattern")
    merged = {k: v for k, v in peft.merge_and_unload().state_dict().items()}
    adapter = loaded(tmp_path / "pattern", spec)
    assert {a.shape[0] for (_, m), (a, _) in adapter.weights.items() if m == "v_proj"} == {2}
    base = load_file(tiny_llama / "model.safetensors")
    ours = adapter.merged_into(base)
    for layer in range(spec.num_hidden_layers):
        for module in ("q_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{module}.weight"
            torch.testing.assert_close(ours[name], merged[name], rtol=1e-5, atol=1e-6)
    tensors = load_file(tmp_path / "pattern" / WEIGHTS)
    key = next(k for k in sorted(tensors) if "v_proj.lora_A" in k)
    tensors[key] = tensors[key][:1].contiguous()
    tensors[key.replace("lora_A", "lora_B")] = tensors[key.replace("lora_A", "lora_B")][:, :1].contiguous()
    save_file(tensors, tmp_path / "pattern" / WEIGHTS)
    message = refused(tmp_path / "pattern", spec)
    assert "rank 1" in message and "r=4" in message and "rank_pattern ranks [2]" in message, message


@pytest.mark.parametrize("field", ["r", "lora_alpha"])
def test_numbers_too_large_for_a_float_name_their_field(qv, spec, tmp_path, field):
    folder = copy_of(qv, tmp_path / "a")
    text = (folder / CONFIG).read_text()
    cfg = json.loads(text)
    (folder / CONFIG).write_text(text.replace(f'"{field}": {cfg[field]}', f'"{field}": {"9" * 400}'))
    message = refused(folder, spec)
    assert f"{field}=" in message or f"{field} must be" in message, message
    assert len(message) < 1000, len(message)


@pytest.mark.parametrize("field", ["bias", "peft_type", "modules_to_save", "target_modules"])
def test_a_megabyte_string_in_the_config_is_cut_short_in_the_error(qv, spec, tmp_path, field):
    """The error (a row's ``llm_error``, a log line) quotes at most a few dozen characters."""
    value = "x" * 1_000_000
    message = refused(copy_of(qv, tmp_path / "a", **{field: [value] if field == "target_modules" else value}), spec)
    assert field in message and "xxxx" in message.lower() and len(message) < 1000, len(message)


@pytest.mark.parametrize("where", ["prefix", "module"])
def test_a_megabyte_tensor_name_is_cut_short_in_the_error(qv, spec, tmp_path, where):
    folder = shutil.copytree(qv, tmp_path / "a")
    tensors = load_file(qv / WEIGHTS)
    name = "x" * 1_000_000
    key = f"{name}.lora_A.weight" if where == "prefix" else f"model.layers.0.self_attn.{name}.lora_A.weight"
    save_file({**tensors, key: torch.zeros(4, 4)}, folder / WEIGHTS)
    message = refused(folder, spec)
    assert "tensor 'xxxx" in message or "tensor 'model.layers.0.self_attn.xxxx" in message, message[:300]
    assert len(message) < 1000, len(message)


def test_dotted_target_module_names_are_peft_names(qv, spec, tmp_path):
    """PEFT matches ``self_attn.q_proj`` to every layer's q_proj: the adapter loads as the
    plain names give it; a dotted name of a module the model cannot adapt is refused."""
    want = loaded(qv, spec).weights
    got = loaded(
        copy_of(qv, tmp_path / "a", target_modules=["self_attn.q_proj", "model.layers.0.self_attn.v_proj"]), spec
    )
    assert got.weights.keys() == want.keys()
    for key, (a, b) in want.items():
        assert torch.equal(got.weights[key][0], a) and torch.equal(got.weights[key][1], b)
    message = refused(copy_of(qv, tmp_path / "b", target_modules=["self_attn.q_proj", "model.lm_head"]), spec)
    assert "model.lm_head" in message, message


# ---- tensors of the decoder's layers only ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "prefix",
    ["base_model.model.vision_tower.encoder.", "base_model.model.model.vision_model.", "model.mtp.", "encoder."],
)
def test_another_stacks_layers_are_refused(qv, spec, tmp_path, prefix):
    """``...vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight`` is not the
    decoder's layer 0: refused by name, never added to the decoder's q_proj."""
    folder = shutil.copytree(qv, tmp_path / "a")
    tensors = {k.replace("base_model.model.model.", prefix): v for k, v in load_file(qv / WEIGHTS).items()}
    save_file(tensors, folder / WEIGHTS)
    message = refused(folder, spec)
    assert f"tensor '{prefix}layers." in message and "not a LoRA A/B weight" in message, message


@pytest.mark.parametrize(
    "prefix", ["base_model.model.", "model.", "", "base_model.model.model.language_model.", "language_model.model."]
)
def test_the_decoders_layers_under_their_usual_names_load(qv, spec, tmp_path, prefix):
    """A bare decoder's, a vision-language model's language model's, and PEFT-less names."""
    folder = shutil.copytree(qv, tmp_path / "a")
    tensors = {k.replace("base_model.model.model.", prefix): v for k, v in load_file(qv / WEIGHTS).items()}
    save_file(tensors, folder / WEIGHTS)
    want = loaded(qv, spec).weights
    got = loaded(folder, spec).weights
    assert got.keys() == want.keys() and all(torch.equal(got[k][1], want[k][1]) for k in want)


# ---- files larger than any adapter are not read --------------------------------------------------------------
@pytest.mark.parametrize("name", [WEIGHTS, CONFIG])
def test_a_file_larger_than_any_adapter_is_refused_unread(qv, spec, tmp_path, name):
    """A sparse file of a terabyte (no disk space, no memory until read): refused at once,
    naming the file and its size, instead of an attempt to read it whole into memory."""
    folder = shutil.copytree(qv, tmp_path / "a")
    os.truncate(folder / name, 1 << 40)
    message = refused(folder, spec)
    assert f"{name} holds {1 << 40} bytes" in message and "not read" in message, message


def test_the_size_bound_admits_every_adapter_of_the_highest_rank_in_float64(spec, tmp_path):
    """Every layer's seven projections at rank ``max_lora_rank``, in float64: it loads."""
    from dfllm.lora.adapter import max_weights_bytes

    tensors = {}
    for layer in range(spec.num_hidden_layers):
        for module, (fan_in, fan_out) in module_shapes(spec).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, dtype=torch.float64) / 8
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, dtype=torch.float64) / 8
    folder = tmp_path / "widest"
    folder.mkdir()
    save_file(tensors, folder / WEIGHTS)
    (folder / CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 16, "bias": "none"}))
    assert (folder / WEIGHTS).stat().st_size <= max_weights_bytes(spec, RANK)
    assert loaded(folder, spec).rank == RANK


def test_files_that_grow_past_their_bound_while_read_are_not_read_whole(qv):
    with pytest.raises(OSError) as info:
        read_files(str(qv), {WEIGHTS: 64})
    assert info.value.errno == errno.EFBIG and WEIGHTS in str(info.value)


def test_an_adapters_identity_is_hashed_without_reading_it_whole(qv, tmp_path):
    """The response cache's key of a row's adapter: the digest of the files' bytes, the same
    as that of the bytes read whole, computed a chunk at a time (a 256 MiB file costs no
    256 MiB of memory)."""
    folder = shutil.copytree(qv, tmp_path / "a")
    contents = {name: (folder / name).read_bytes() for name in (CONFIG, WEIGHTS)}
    assert adapter_identity(str(folder)) == digest(contents)
    os.truncate(folder / WEIGHTS, 256 << 20)
    want = hashlib.sha256(CONFIG.encode() + b"\0" + contents[CONFIG])
    want.update(WEIGHTS.encode() + b"\0" + contents[WEIGHTS] + bytes((256 << 20) - len(contents[WEIGHTS])))
    tracemalloc.start()
    try:
        got = adapter_identity(str(folder))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == want.hexdigest() and peak < 32 << 20, peak


# ---- the folder's path ---------------------------------------------------------------------------------------
def test_a_lone_surrogate_in_the_path_is_the_adapters_error(spec):
    """A root no file system can encode: the adapter resolves (its identity that of an
    unreadable folder) and is refused by name when loaded, never a UnicodeEncodeError."""
    request = resolve("sql", "/adapters/\ud800")
    assert request.lora_path == "/adapters/\ud800/sql" and request.identity.startswith("unreadable:")
    with pytest.raises(LoRAAdapterError, match="not a directory"):
        load_adapter(request, spec, RANK)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["pipe", "dev-zero"])
@pytest.mark.parametrize("name", [WEIGHTS, CONFIG])
def test_a_pipe_or_a_device_in_place_of_a_file_is_unreadable_at_once(qv, spec, tmp_path, kind, name):
    """A named pipe (a read would wait for a writer for good) or a link to ``/dev/zero`` (a
    read would never end, filling memory): the row's adapter resolves at once with an
    unreadable identity, and is refused by name when loaded."""
    folder = shutil.copytree(qv, tmp_path / "a")
    (folder / name).unlink()
    if kind == "pipe":
        os.mkfifo(folder / name)
    else:
        (folder / name).symlink_to("/dev/zero")
    request = resolve(str(folder))
    assert request.identity == f"unreadable:{folder}"
    with pytest.raises(OSError, match="not a regular file"):
        read_files(str(folder))
    message = refused(folder, spec)
    assert f"{name} is missing" in message, message


# ---- weights the model's dtype cannot hold -------------------------------------------------------------------
def test_weights_that_overflow_float16_are_refused_by_a_float16_engine(qv, tiny_llama, spec, tmp_path):
    """lora_B times the scaling above float16's largest value: finite for a float32 or
    bfloat16 model, refused by name by a float16 one (whose slots would hold infinity and
    whose rows would end in non-finite logits, naming no adapter)."""
    folder = shutil.copytree(qv, tmp_path / "a")
    tensors = {k: v * 1e6 if "lora_B" in k else v for k, v in load_file(qv / WEIGHTS).items()}
    save_file(tensors, folder / WEIGHTS)
    llm = LLM(
        str(tiny_llama),
        enable_lora=True,
        max_lora_rank=RANK,
        dtype="float16",
        device="cpu",
        max_model_len=64,
        kv_cache_memory_bytes=1 << 22,
    )
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    with pytest.raises(InvalidRequestError, match="'big'.*overflows float16"):
        llm.generate(
            [prompt, prompt], SamplingParams(max_tokens=2), lora_request=[None, LoRARequest("big", 1, str(folder))]
        )
    assert not llm.llm_engine.has_unfinished_requests()
    for dtype in (torch.float32, torch.bfloat16):
        assert load_adapter(LoRARequest("big", 1, str(folder)), spec, RANK, dtype=dtype).rank == 4
    assert "overflows float16, the model's dtype" in refused(folder, spec, dtype=torch.float16)


@pytest.fixture(autouse=True, scope="module")
def _release():
    yield
    dfllm.release_engines()
