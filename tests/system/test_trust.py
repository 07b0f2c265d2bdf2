"""Trust boundaries: what dfllm never does with what it is given.

- Chat templates render in a sandboxed Jinja environment: a template reaching for Python
  internals is refused and never executes; message content is data, never template code.
- ``trust_remote_code`` is never set: code named by a model directory's ``auto_map`` is
  ignored (a model_type transformers implements) or refused (one it does not), and never
  imported, even when a "yes" is waiting on stdin.
- Values in input rows are only ever text: a prompt that is the path of a file is
  tokenized as that string; the file is never opened (a FIFO would block forever if it were).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dask
import dask.dataframe as dd
import jinja2
import pandas as pd
import pytest

import dfllm  # noqa: F401  (registers the accessors)
from dfllm import LLM, SamplingParams

ENGINE = dict(max_model_len=64, kv_cache_memory_bytes=2**22)
SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, **ENGINE)


# ---- sandboxed chat templates ---------------------------------------------------------------------------
def evil_templates(marker: Path) -> list[str]:
    touch = f"touch {marker}"
    return [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        f"{{{{ cycler.__init__.__globals__.os.system('{touch}') }}}}",
        f"{{{{ joiner.__init__.__globals__.os.popen('{touch}').read() }}}}",
        f"{{{{ lipsum.__globals__['os'].system('{touch}') }}}}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{% for m in messages %}{{ m.__class__.__base__.__subclasses__() }}{% endfor %}",
        f"{{{{ messages.__class__.__init__.__globals__['sys'].modules['os'].system('{touch}') }}}}",
        "{{ messages.pop() }}{{ messages.append(1) }}",  # the immutable sandbox: no mutation either
    ]


@pytest.mark.parametrize("i", range(10))
def test_chat_template_cannot_reach_python_internals(llm, tmp_path, i):
    marker = tmp_path / "MARKER"
    template = evil_templates(marker)[i]
    with pytest.raises(jinja2.exceptions.SecurityError, match="unsafe|not safely"):
        llm.chat([{"role": "user", "content": "hi"}], SP, chat_template=template, use_tqdm=False)
    assert not marker.exists()
    assert not llm.engine.has_unfinished_requests()


def test_unsafe_attribute_alone_renders_nothing(llm):
    """A lone unsafe attribute renders as an empty undefined value (Jinja's sandbox), never the
    object; a template that renders nothing at all is an empty prompt, refused before work."""
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.chat(
            [{"role": "user", "content": "hi"}], SP, chat_template="{{ raise_exception.__globals__ }}", use_tqdm=False
        )
    out = llm.chat(
        [{"role": "user", "content": "hi"}], SP, chat_template="x{{ raise_exception.__globals__ }}y", use_tqdm=False
    )
    assert out[0].prompt == "xy"
    assert not llm.engine.has_unfinished_requests()


def test_model_chat_template_is_sandboxed_in_dataframes(tiny_llama, tmp_path):
    """A model directory whose own chat template is hostile: every chat row gets a per-row
    error naming the refusal, and the template's command never runs."""
    marker = tmp_path / "MARKER"
    path = Path(shutil.copytree(tiny_llama, tmp_path / "evil-template"))
    (path / "chat_template.jinja").write_text(evil_templates(marker)[2])
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    df = pd.DataFrame({"c": pd.Series([[{"role": "user", "content": "hi"}]] * 2, dtype=object)})
    out = df.llm.chat("c", model=str(path), sampling_params={"max_tokens": 2}, **ENGINE)
    assert out.generated_text.isna().all()
    assert all("chat template" in e and "unsafe" in e for e in out.llm_error)
    assert not marker.exists()


@pytest.mark.parametrize("i", [2, 4, 8])
def test_chat_template_argument_is_sandboxed_in_dataframes(tiny_llama, tmp_path, i):
    marker = tmp_path / "MARKER"
    df = pd.DataFrame({"c": pd.Series([[{"role": "user", "content": "hi"}]] * 2, dtype=object)})
    with dask.config.set({"dataframe.convert-string": False}):  # keep the lists of messages as they are
        ddf = dd.from_pandas(df, npartitions=2)
    for frame in (df, ddf):
        out = frame.llm.chat(
            "c",
            chat_template=evil_templates(marker)[i],
            model=str(tiny_llama),
            sampling_params={"max_tokens": 2},
            **ENGINE,
        )
        out = out.compute(scheduler="synchronous") if hasattr(out, "compute") else out
        assert out.generated_text.isna().all() and all("unsafe" in e for e in out.llm_error)
    assert not marker.exists()


def test_message_content_is_data_not_template(llm):
    content = "{{ 7 * 7 }} {% for x in range(3) %}loop{% endfor %} {{ ''.__class__ }}"
    out = llm.chat([{"role": "user", "content": content}], SP, use_tqdm=False)[0]
    assert content in out.prompt and "49" not in out.prompt and "looploop" not in out.prompt


# ---- no remote code ----------------------------------------------------------------------------------
EVIL_CODE = """\
import pathlib
pathlib.Path({marker!r}).write_text("custom code was imported")
from transformers import LlamaConfig, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig):
    model_type = "llama"
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


def remote_code_model(src: Path, dst: Path, marker: Path, model_type: str | None = None) -> Path:
    """A copy of ``src`` whose config.json and tokenizer_config.json map to custom code that
    writes ``marker`` when imported."""
    path = Path(shutil.copytree(src, dst))
    (path / "evil_code.py").write_text(EVIL_CODE.format(marker=str(marker)))
    cfg = json.loads((path / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil_code.EvilConfig", "AutoModelForCausalLM": "evil_code.EvilModel"}
    if model_type:
        cfg["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((path / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["evil_code.EvilTokenizer", None]}
    (path / "tokenizer_config.json").write_text(json.dumps(tok))
    return path


def test_auto_map_of_a_known_model_type_is_ignored(tiny_llama, llm, tmp_path):
    marker = tmp_path / "MARKER"
    path = remote_code_model(tiny_llama, tmp_path / "known", marker)
    evil = LLM(path, **ENGINE)
    assert type(evil.config.hf_config).__module__.startswith("transformers.")
    assert not type(evil.get_tokenizer()).__module__.startswith("evil_code")
    assert (
        evil.generate("hello", SP, use_tqdm=False)[0].outputs[0].token_ids
        == llm.generate("hello", SP, use_tqdm=False)[0].outputs[0].token_ids
    )
    assert not marker.exists() and "evil_code" not in sys.modules


def test_auto_map_of_an_unknown_model_type_is_refused(tiny_llama, tmp_path):
    marker = tmp_path / "MARKER"
    path = remote_code_model(tiny_llama, tmp_path / "unknown", marker, model_type="evil_model")
    with pytest.raises(ValueError, match="auto_map names custom code.*never runs code from a model directory"):
        LLM(path, **ENGINE)
    with pytest.raises(ValueError, match="never runs code"):
        pd.DataFrame({"q": ["hi"]}).llm.generate("q", model=str(path), **ENGINE)
    assert not marker.exists() and "evil_code" not in sys.modules


@pytest.mark.slow
def test_remote_code_is_refused_even_with_yes_on_stdin(tiny_llama, tmp_path):
    """transformers asks on the terminal whether to run a directory's custom code; dfllm never
    gets that far, so a "y" waiting on stdin changes nothing."""
    marker = tmp_path / "MARKER"
    path = remote_code_model(tiny_llama, tmp_path / "prompted", marker, model_type="evil_model")
    code = f"from dfllm import LLM\nLLM({str(path)!r}, max_model_len=64, kv_cache_memory_bytes=2**22)\n"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input="y\ny\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0 and "never runs code from a model directory" in proc.stderr
    assert not marker.exists()


# ---- input rows are text, never paths ------------------------------------------------------------------
@pytest.fixture
def secret_and_fifo(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET: the launch code is 0000\n" * 20)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening this for reading would block until a writer appears: forever
    return secret, fifo


@pytest.mark.timeout(120)
def test_prompt_that_names_a_file_is_literal_text(llm, tiny_llama, secret_and_fifo):
    secret, fifo = secret_and_fifo
    tok = llm.get_tokenizer()
    prompts = [str(secret), str(fifo), f"file://{secret}", f"@{secret}"]
    direct = llm.generate(prompts, SP, use_tqdm=False)
    for p, o in zip(prompts, direct):
        assert o.prompt == p and o.prompt_token_ids == tok.encode(p)
    df = pd.DataFrame({"q": prompts, "path": [str(secret)] * 4})
    out = df.llm.generate("q", sampling_params=SP, model=str(tiny_llama), **ENGINE)
    assert out.llm_error.isna().all()
    assert out.num_input_tokens.tolist() == [len(tok.encode(p)) for p in prompts]
    assert out.generated_text.tolist() == [o.outputs[0].text for o in direct]
    templ = df.llm.generate("Read {path}", sampling_params=SP, model=str(tiny_llama), **ENGINE)
    assert templ.num_input_tokens.tolist() == [len(tok.encode(f"Read {secret}"))] * 4
    lazy = dd.from_pandas(df, npartitions=2).llm.generate("q", sampling_params=SP, model=str(tiny_llama), **ENGINE)
    assert lazy.compute(scheduler="synchronous").generated_text.tolist() == out.generated_text.tolist()
    chat = pd.DataFrame({"c": pd.Series([[{"role": "user", "content": str(fifo)}]], dtype=object)})
    replied = chat.llm.chat("c", sampling_params=SP, model=str(tiny_llama), **ENGINE)
    assert replied.llm_error.isna().all()
    assert replied.num_input_tokens[0] == len(
        llm.chat([{"role": "user", "content": str(fifo)}], SP, use_tqdm=False)[0].prompt_token_ids
    )


@pytest.mark.timeout(120)
def test_embedding_a_path_embeds_the_string(secret_and_fifo):
    secret, fifo = secret_and_fifo
    emb = LLM("all-minilm-l6-v2")
    tok = emb.get_tokenizer()
    outs = emb.embed([str(secret), str(fifo)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [tok(str(secret))["input_ids"], tok(str(fifo))["input_ids"]]
    assert outs[0].outputs.embedding == emb.embed([str(secret)], use_tqdm=False)[0].outputs.embedding
    secret_text = emb.embed([secret.read_text()], use_tqdm=False)[0].outputs.embedding
    assert outs[0].outputs.embedding != secret_text
