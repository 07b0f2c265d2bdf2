"""vLLM's engine arguments on ``dfllm.LLM``: accepted, mapped or refused, one table for all."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import pandas as pd
import pytest

from dfllm import LLM, SamplingParams
from dfllm.engine_args import (
    ENGINE_ARG_NAMES,
    ENGINE_ARGS,
    VLLM_ARGS,
    EngineArgs,
    add_cli_args,
    as_kwargs,
    check_engine_args,
    cli_kwargs,
    markdown_table,
)

from helpers import build_tiny_model  # noqa: F401  (tests/ is on sys.path in this subfolder too)

FROM_VLLM = Path(__file__).resolve().parents[3] / "docs" / "from_vllm.md"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["Hello there", "Numbers: 1 2 3"]
SMALL = dict(max_num_seqs=4, max_model_len=64)

REFUSED = [
    ("skip_tokenizer_init", "yes"),
    ("trust_remote_code", True),
    ("load_format", "pt"),
    ("load_format", "dummy"),
    ("tokenizer_mode", "mistral"),
    ("revision", "main"),
    ("tokenizer_revision", "v1"),
    ("download_dir", "/tmp/x"),
    ("kv_cache_dtype", "fp8"),
    ("quantization", "awq"),
    ("cpu_offload_gb", 4),
    ("structured_outputs_config", {"backend": "guidance"}),
    ("structured_outputs_config", {"backend": "outlines"}),
    ("structured_outputs_config", {"backend": "xgrammar", "whitespace_pattern": " "}),
    ("logprobs_mode", "logits"),
    ("config_format", "mistral"),
    ("attention_config", {"backend": "FLASH_ATTN"}),
    ("scheduling_policy", "lottery"),
    ("hf_overrides", "rope_theta=1e6"),
    ("distributed_executor_backend", "ray"),
    ("enforce_eager", "yes"),
    ("swap_space", -1),
    ("max_logprobs", -2),
    ("compilation_config", {"cudagraph_capture_sizes": [0, 8]}),
    ("compilation_config", "O3"),
]

ACCEPTED = dict(
    enforce_eager=True,
    disable_log_stats=False,
    swap_space=0,
    compilation_config={"level": 3, "cudagraph_capture_sizes": [1, 2, 4]},
    max_seq_len_to_capture=None,
    max_logprobs=-1,
    enable_chunked_prefill=False,
    enable_sleep_mode=True,
    disable_custom_all_reduce=True,
    tokenizer_mode="hf",
    skip_tokenizer_init=False,
    trust_remote_code=False,
    load_format="safetensors",
    revision=None,
    tokenizer_revision=None,
    download_dir=None,
    kv_cache_dtype="auto",
    quantization=None,
    cpu_offload_gb=0.0,
    structured_outputs_config={"backend": "xgrammar"},
    scheduling_policy="fcfs",
    hf_overrides=None,
    distributed_executor_backend="mp",
)


def test_signature_is_the_engine_args_fields():
    """``LLM.__init__`` spells out EngineArgs' fields for users and IDEs: the same names, in the
    same order, with the same defaults and annotations (an argument added to one place only fails)."""
    params = list(inspect.signature(LLM.__init__).parameters.values())[1:]  # without self
    assert [p.name for p in params] == [a.name for a in ENGINE_ARGS]
    for param, arg in zip(params, ENGINE_ARGS):
        assert param.default == arg.default, arg.name
        assert param.annotation == arg.type, arg.name
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if arg.name == "model" else inspect.Parameter.KEYWORD_ONLY
        assert param.kind is kind, arg.name
    assert list(ENGINE_ARG_NAMES) == [p.name for p in params[1:]]


def test_table_arguments_are_checked_by_effect():
    assert {a.metadata["effect"] for a in VLLM_ARGS} == {"maps", "no-op", "refuses"}
    check_engine_args(**as_kwargs(EngineArgs()))
    check_engine_args(**ACCEPTED)
    check_engine_args(scheduling_policy="priority", max_logprobs=5, tokenizer_mode="slow")


def test_every_argument_with_a_check_is_checked_once_by_name():
    """Each argument's value is checked by its field (one place): a wrong type names the
    argument and the value, before a model is looked for."""
    checked = [a for a in ENGINE_ARGS if a.metadata["check"] is not None]
    assert len(checked) >= 40
    for arg in checked:
        if arg.name in ("attention_config", "compilation_config"):
            continue  # any object: vLLM passes its config objects, whose attributes are read
        with pytest.raises(ValueError) as info:
            check_engine_args(**{arg.name: object()})
        assert arg.name in str(info.value), arg.name
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        LLM("/nonexistent/model", block_size=24)


def test_cli_flags_come_from_the_fields():
    """Every engine argument but ``model`` is a flag in vLLM's spelling, typed by its field;
    flags not given stay unset (None: LLM's default)."""
    parser = argparse.ArgumentParser()
    add_cli_args(parser, prefix="engine_")
    assert {a.dest for a in parser._actions if a.dest.startswith("engine_")} == {
        f"engine_{n}" for n in ENGINE_ARG_NAMES
    }
    args = parser.parse_args(
        [
            "--max-model-len",
            "64",
            "--no-enable-prefix-caching",
            "--swap-space",
            "2.5",
            "--hf-overrides",
            '{"rope_theta": 10.0}',
            "--reasoning-parser",
            "qwen3",
            "--enforce-eager",
            "--dtype",
            "float32",
        ]
    )
    assert cli_kwargs(args, "engine_") == {
        "max_model_len": 64,
        "enable_prefix_caching": False,
        "swap_space": 2.5,
        "hf_overrides": {"rope_theta": 10.0},
        "reasoning_parser": "qwen3",
        "enforce_eager": True,
        "dtype": "float32",
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-parser", "nope"])


@pytest.mark.parametrize("name,value", REFUSED, ids=[f"{n}={v!r}" for n, v in REFUSED])
def test_refused_value_raises_value_error_naming_it(name, value):
    with pytest.raises(ValueError) as info:
        check_engine_args(**{name: value})
    assert name in str(info.value) and repr(value) in str(info.value)


def test_llm_refuses_before_loading_anything():
    # a model that does not exist: the argument is refused first, by name
    with pytest.raises(ValueError, match="trust_remote_code=True.*never runs remote code"):
        LLM("/nonexistent/model", trust_remote_code=True)
    with pytest.raises(ValueError, match="revision='main'.*local directory"):
        LLM("/nonexistent/model", revision="main")
    with pytest.raises(ValueError, match="scheduling_policy='lottery'"):
        LLM("/nonexistent/model", scheduling_policy="lottery")


def test_unknown_kwarg_raises_type_error():
    with pytest.raises(TypeError):
        LLM("/nonexistent/model", enforce_eagre=True)
    with pytest.raises(TypeError, match="not_an_arg"):
        check_engine_args(not_an_arg=1)


@pytest.mark.slow
def test_accepted_arguments_change_no_output(tiny_llama):
    plain = LLM(tiny_llama, **SMALL).generate(PROMPTS, GREEDY, use_tqdm=False)
    vllm_style = LLM(tiny_llama, **SMALL, **ACCEPTED).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in vllm_style] == [o.outputs[0].token_ids for o in plain]
    slow = LLM(tiny_llama, **SMALL, enforce_eager=True, tokenizer_mode="slow")
    assert slow.generate(PROMPTS, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert slow.get_metrics()  # disable_log_stats=True (the default) keeps the metrics


def test_dataframe_engine_kwargs_accept_vllm_arguments(tiny_llama):
    out = pd.DataFrame({"q": ["hi"]}).llm.generate(
        "q", model=str(tiny_llama), sampling_params={"max_tokens": 2}, enforce_eager=True, **SMALL
    )
    assert len(out) == 1 and isinstance(out["generated_text"][0], str)
    with pytest.raises(ValueError, match="unknown argument"):
        pd.DataFrame({"q": ["hi"]}).llm.generate("q", model=str(tiny_llama), enforce_eagre=True)


def test_docs_table_is_the_engine_args_table():
    assert markdown_table() in FROM_VLLM.read_text()


@pytest.mark.slow
def test_hf_overrides_change_the_config_dfllm_reads(tiny_llama):
    """vLLM's hf_overrides: a dict of config.json fields, or a callable; applied before dfllm
    describes the model, so the engine is built from the overridden config."""
    assert LLM(tiny_llama).config.max_model_len == 1024
    small = LLM(tiny_llama, hf_overrides={"max_position_embeddings": 64})
    assert small.config.max_model_len == 64 and small.config.model.max_position_embeddings == 64

    def shorter(config):
        config.max_position_embeddings = 32
        return config

    assert LLM(tiny_llama, hf_overrides=shorter).config.max_model_len == 32
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = LLM(tiny_llama).generate("Hello", sp, use_tqdm=False)[0].outputs[0].token_ids
    other = LLM(tiny_llama, hf_overrides={"rope_parameters": {"rope_type": "default", "rope_theta": 10.0}})
    assert other.config.model.rope_parameters["rope_theta"] == 10.0
    assert other.generate("Hello", sp, use_tqdm=False)[0].outputs[0].token_ids != base
