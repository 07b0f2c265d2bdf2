"""One command surface: ``dfllm run`` and ``dfllm run-batch`` take the same engine flags (every
field of ``EngineArgs`` but ``model``, in vLLM's spelling) and every option they both take is
declared once (``dfllm.jobs.cli_options.add_job_options``), so the two cannot drift. Parsing and
building the job only: no model is loaded, no cluster started."""

from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager
from types import SimpleNamespace

import dask
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfllm.engine_args import ENGINE_ARG_NAMES, cli_kwargs
from dfllm.jobs.cli import build_job, build_parser, main
from dfllm.jobs.cli_options import ENGINE, add_job_options, positive_float

PARSER = build_parser()
COMMANDS = next(a for a in PARSER._actions if isinstance(a, argparse._SubParsersAction)).choices
RUN, BATCH = COMMANDS["run"], COMMANDS["run-batch"]
#: what decides an option: two actions equal in all of these are one declaration
DECIDES = ("option_strings", "dest", "type", "default", "help", "choices", "metavar", "nargs", "const", "required")


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option string of ``parser`` (``-h`` aside) and its action."""
    return {s: a for a in parser._actions for s in a.option_strings if a.dest != "help"}


def engine_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for s, a in options(parser).items() if a.dest.startswith(ENGINE)}


def described(action: argparse.Action) -> tuple:
    return (type(action), *(getattr(action, k) for k in DECIDES))


def test_both_commands_take_every_engine_argument_as_the_same_flag():
    expected = {f"--{n.replace('_', '-')}" for n in ENGINE_ARG_NAMES}
    run, batch = engine_flags(RUN), engine_flags(BATCH)
    assert set(run) == set(batch)
    assert {s for s in run if not s.startswith("--no-") or s in expected} == expected  # bools add --no-x
    assert {a.dest for a in run.values()} == {ENGINE + n for n in ENGINE_ARG_NAMES}
    assert [s for s in run if described(run[s]) != described(batch[s])] == []
    assert "--dtype" in run and "--quantization" in run and "--max-model-len" in run


def test_every_option_both_commands_take_is_declared_once():
    """An option string both commands take is one of add_job_options' declarations, and each
    command's action for it is that declaration (type, default, help...): none is declared
    twice, so none can drift (--calibration-seconds once differed: a float and a positive one)."""
    shared = argparse.ArgumentParser()
    add_job_options(shared)
    one = options(shared)
    run, batch = options(RUN), options(BATCH)
    assert set(run) & set(batch) == set(one)
    for flag, action in one.items():
        assert described(run[flag]) == described(action) == described(batch[flag]), flag
    assert run["--calibration-seconds"].type is positive_float
    assert {"--model", "--resume", "--no-prefix-placement", "--cache", "--gpu", "--dry-run"} <= set(one)


@pytest.mark.parametrize("command", [["run", "in.parquet", "out/"], ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"]])
@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "x"])
def test_calibration_seconds_is_a_positive_number_in_both(command, value, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([*command, "--calibration-seconds", value])
    assert info.value.code == 2 and "--calibration-seconds: must be a positive number" in capsys.readouterr().err


def value_of(action: argparse.Action) -> st.SearchStrategy:
    """``(text, value)``: a flag's command-line text and the value it must give, by its action."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return st.booleans().map(lambda b: (None, b))
    if action.choices:
        return st.sampled_from(list(action.choices)).map(lambda c: (c, c))
    if action.type is int:
        return st.integers(-(2**40), 2**40).map(lambda i: (str(i), i))
    if action.type is float:
        return st.floats(allow_nan=False, allow_infinity=False).map(lambda x: (repr(x), x))
    if action.type is None:
        return st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12).map(lambda t: (t, t))
    small = st.dictionaries(st.text(max_size=4), st.integers() | st.booleans() | st.text(max_size=4), max_size=3)
    return small.map(lambda d: (json.dumps(d), d))


ENGINE_ACTIONS = {a.dest: a for a in engine_flags(RUN).values()}


@st.composite
def engine_argv(draw) -> tuple[list[str], dict]:
    """Some engine flags with values, as argv, and the keyword arguments they must give."""
    names = draw(st.lists(st.sampled_from(sorted(ENGINE_ACTIONS)), unique=True, max_size=8))
    argv, kwargs = [], {}
    for dest in names:
        action = ENGINE_ACTIONS[dest]
        text, value = draw(value_of(action))
        flag = action.option_strings[0]
        if text is None:  # a bool: --x or --no-x
            argv.append(flag if value else action.option_strings[1])
        else:
            argv.append(f"{flag}={text}")  # = keeps a value such as -1e-05 from reading as a flag
        kwargs[dest.removeprefix(ENGINE)] = value
    return argv, kwargs


@settings(max_examples=60, deadline=None, derandomize=not os.environ.get("DFLLM_HYPOTHESIS_RANDOM"))
@given(engine_argv())
def test_any_engine_flags_parse_alike_in_both_commands(drawn):
    argv, kwargs = drawn
    run = PARSER.parse_args(["run", "in.parquet", "out/", *argv])
    batch = PARSER.parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", *argv])
    assert cli_kwargs(run, ENGINE) == cli_kwargs(batch, ENGINE) == kwargs


class Frame:
    """Stands in for the input's Dask frame: ``.llm.generate``/``.llm.chat`` record their keyword
    arguments (and Dask's prefix-placement setting) instead of building a graph."""

    columns = ["prompt", "messages", "adapter"]

    def __init__(self):
        self.llm, self.calls = self, []

    def generate(self, first, **kwargs):
        self.calls.append({**kwargs, "placement": dask.config.get("dfllm.prefix-placement", None)})
        return SimpleNamespace(npartitions=1)

    chat = generate


@pytest.fixture
def frame(monkeypatch):
    import dfllm.jobs.sources as sources

    f = Frame()
    monkeypatch.setattr(sources, "read_input", lambda *a, **k: f)
    monkeypatch.setattr(sources, "repartition", lambda ddf, **k: ddf)
    return f


def test_engine_flags_new_to_run_reach_the_task_as_run_batchs_do(frame):
    flags = ["--dtype", "bfloat16", "--quantization", "int8", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    flags += ["--seed", "3", "--max-model-len", "64", "--max-loras", "2"]
    run = PARSER.parse_args(["run", "in.parquet", "out/", "--temperature", "0.5", "--lora-column", "adapter", *flags])
    build_job(run)
    [call] = frame.calls
    batch = PARSER.parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", *flags])
    engine = cli_kwargs(batch, ENGINE)
    assert engine == {
        "dtype": "bfloat16",
        "quantization": "int8",
        "max_num_seqs": 8,
        "enable_prefix_caching": False,
        "seed": 3,
        "max_model_len": 64,
        "max_loras": 2,
    }
    assert {k: call[k] for k in engine} == engine and call["lora"] == "adapter"
    assert call["sampling_params"]["seed"] == 3  # dfllm run's --seed also seeds every row


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--quantization", "fp8"], "quantization='fp8' is not supported"),  # checked as run-batch checks it
        (["--block-size", "24"], "block_size must be a power of two"),
        (["--max-lora-rank", "8"], "--max-lora-rank apply with --lora-column"),
        (["--task", "embed", "--prompt", "prompt", "--reasoning-parser", "qwen3"], "--reasoning-parser applies to"),
    ],
)
def test_engine_flag_values_are_refused_before_any_work(frame, flags, message):
    with pytest.raises(ValueError, match=message):
        build_job(PARSER.parse_args(["run", "in.parquet", "out/", *flags]))
    assert frame.calls == []


class Client:
    dashboard_link = None

    def scheduler_info(self, **_):
        return {"workers": {}}

    def run(self, *a, **k):
        return {}

    def run_on_scheduler(self, *a, **k):
        raise RuntimeError("no scheduler here")


@pytest.mark.parametrize("placement", [True, False])
def test_no_prefix_placement_sets_dasks_config_for_both_commands(frame, monkeypatch, tmp_path, placement, capsys):
    import dfllm.accessors.writer as writer
    import dfllm.jobs.batch_job as batch_job
    import dfllm.jobs.cluster as cluster

    seen = []

    @contextmanager
    def connect(*a, **k):
        yield Client(), None

    def run_batch(*a, **k):  # run-batch's job, as it runs on the cluster
        seen.append(dask.config.get("dfllm.prefix-placement", None))
        return SimpleNamespace(lines=0, failed=0)

    monkeypatch.setattr(cluster, "connect", connect)
    monkeypatch.setattr(batch_job, "run_batch", run_batch)
    monkeypatch.setattr(writer, "write_parquet", lambda *a, **k: SimpleNamespace(rows=0, errors=0, stopped=None))
    monkeypatch.setattr("dfllm.jobs.cli.format_summary", lambda *a, **k: "")  # of the fakes' summaries
    monkeypatch.setattr("dfllm.jobs.batch_cli.format_batch_summary", lambda *a, **k: "")
    src = tmp_path / "in.jsonl"
    src.write_text("")
    flag = [] if placement else ["--no-prefix-placement"]
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--no-progress", *flag]) == 0
    assert main(["run", str(tmp_path / "in.parquet"), str(tmp_path / "out"), "--no-progress", *flag]) == 0
    want = None if placement else False  # without the flag, as Dask's config has it (here: unset)
    assert seen == [want] and frame.calls[-1]["placement"] is want, capsys.readouterr().err
    with dask.config.set({"dfllm.prefix-placement": False}):  # DASK_DFLLM__PREFIX_PLACEMENT=false stays
        assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--no-progress"]) == 0
    assert seen[-1] is False
