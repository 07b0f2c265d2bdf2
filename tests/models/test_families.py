"""``dfllm models`` lists every registered architecture with its tasks; an unsupported
architecture's error names the closest supported family."""

from __future__ import annotations

import json

import pytest
from decoder_builders import build_decoder
from transformers import Qwen3Config

from dfllm import LLM
from dfllm.jobs.cli import main
from dfllm.models.families import closest_supported, supported_architectures
from dfllm.models.loader import check_model_dir
from dfllm.models.registry import DECODER_CLASSIFIER_ARCHITECTURES, ENCODER_ARCHITECTURES, GENERATIVE_ARCHITECTURES


def test_models_command_lists_every_registered_architecture(capsys):
    assert main(["models"]) == 0
    lines = {
        line.split()[0]: line.split(None, 1)[1]
        for line in capsys.readouterr().out.splitlines()
        if line.split() and line.split()[0].endswith(("LM", "Model", "Classification", "ColBERT", "Generation"))
    }
    registered = {**GENERATIVE_ARCHITECTURES, **ENCODER_ARCHITECTURES, **DECODER_CLASSIFIER_ARCHITECTURES}
    assert set(registered) <= set(lines)
    assert lines["Qwen3ForCausalLM"] == "generate, chat, embed, token_embed, score"
    assert lines["Phi3ForCausalLM"].startswith("generate")
    assert lines["Qwen3ForSequenceClassification"] == "classify, score"
    assert lines["BertForSequenceClassification"] == "classify, score"
    assert lines["BertModel"] == "embed, token_embed, score"


@pytest.mark.parametrize(
    "arch,closest",
    [
        ("Qwen3NextForCausalLM", "Qwen3ForCausalLM"),
        ("Qwen3VLForConditionalGeneration", "Qwen3ForCausalLM"),
        ("LlavaNextForConditionalGeneration", "LlavaForConditionalGeneration"),
        ("Phi3SmallForCausalLM", "Phi3ForCausalLM"),
        ("LamaForCausalLM", "LlamaForCausalLM"),
    ],
)
def test_closest_supported_family(arch, closest):
    assert closest_supported(arch)[0] == closest
    assert arch not in supported_architectures()


def test_unsupported_architecture_error_names_the_closest(tmp_path, smollm2_dir):
    path = build_decoder(tmp_path, smollm2_dir, Qwen3Config, "qwen3-next", hidden=32, head_dim=8, layers=1)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen3NextForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    message = r"unsupported architecture \['Qwen3NextForCausalLM'\]; the closest supported: Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=message):
        check_model_dir(path)
    with pytest.raises(ValueError, match=message):
        LLM(path)
    config["architectures"] = ["GPT2LMHeadModel"]  # no family in common: no suggestion, the list
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\['GPT2LMHeadModel'\]\. dfllm runs: .*Qwen3ForCausalLM"):
        LLM(path)
