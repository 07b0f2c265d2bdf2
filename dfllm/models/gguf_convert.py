"""GGUF -> Hugging Face conversion of llama-architecture models (the bundled chat model ships as GGUF).

Weights are dequantized to float32 and written as safetensors under Hugging Face Llama names;
config, generation config and tokenizer (with the GGUF's chat template) are written beside them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Convert a llama-architecture GGUF file into a float32 Hugging Face directory.

    Writes ``config.json``, ``generation_config.json``, the tokenizer files
    (with the GGUF's chat template) and ``model.safetensors`` holding the
    dequantized weights under Hugging Face Llama names, with llama.cpp's
    rotary permutation of the Q/K projections undone.  ``out_dir`` is written
    in place (not atomically); :func:`resolve_model` wraps it atomically.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.
    """
    from transformers import AutoConfig

    gguf_path, out = Path(gguf_path), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if config.model_type != "llama":
        raise ValueError(f"{gguf_path}: only llama GGUF models are supported, got {config.model_type!r}")
    _write_config(config, out)
    _write_generation_config(config, out)
    _write_tokenizer(gguf_path, out, config.max_position_embeddings)
    _write_weights(gguf_path, config, out)
    return out


# Generic PretrainedConfig keys that the original SmolLM2 config.json lacks.
_CONFIG_NOISE = (
    "_name_or_path",
    "_model_name_or_path",
    "id2label",
    "label2id",
    "problem_type",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
)


def _write_config(config: Any, out: Path) -> None:
    """Write ``config.json`` (float32, LlamaForCausalLM, HF-style rounding)."""
    data = config.to_dict()
    for key in _CONFIG_NOISE:
        data.pop(key, None)
    data["architectures"] = ["LlamaForCausalLM"]
    data["dtype"] = data["torch_dtype"] = "float32"
    # GGUF stores eps as float32 (9.99999974e-06); restore the original 1e-05.
    data["rms_norm_eps"] = float(str(np.float32(data["rms_norm_eps"])))
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope:  # also expose the transformers 4.x top-level key
        data["rope_theta"] = rope["rope_theta"]
    (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_generation_config(config: Any, out: Path) -> None:
    """Write ``generation_config.json`` with the model's bos/eos/pad ids."""
    from transformers import GenerationConfig

    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)


def _write_tokenizer(gguf_path: Path, out: Path, max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json
    and chat_template.jinja (the template is also kept in the config)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.model_max_length = max_length
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only", "backend"):
        cfg.pop(key, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # loads in transformers 4.x and 5.x
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    specials = {k: str(v) for k, v in tok.special_tokens_map.items()}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def _write_weights(gguf_path: Path, config: Any, out: Path) -> None:
    """Dequantize the GGUF tensors to float32 and save ``model.safetensors``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only used for its parameter names
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    tensors = {k: v.contiguous() for k, v in parsed["tensors"].items() if k in expected}
    missing = sorted(expected - set(tensors))
    if missing:
        raise RuntimeError(f"{gguf_path}: GGUF lacks tensors for {missing[:5]} ...")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
