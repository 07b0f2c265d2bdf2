"""Many LoRA adapters mixed in one batch vs the base model alone vs one merged-model job per adapter.

Workload
--------
``--rows`` (256) prompts of ``--prompt-tokens`` (about 32) random token ids, greedy decoding of
``--max-tokens`` (32) tokens each (``ignore_eos``), on the bundled SmolLM2-135M (or ``--model``).
Random rank-``--rank`` (8) adapters on q/k/v/o and gate/up/down are written as PEFT writes
them (``adapter_config.json``, ``adapter_model.safetensors``; lora_alpha 16). For each count
in ``--adapters`` (4, 16) the rows are assigned adapters uniformly (row ``i`` runs adapter
``i % n``), and three ways of running them are timed (model loading excluded; each engine
runs the workload once untimed first, then once timed):

- base: the base model alone on the same rows (no adapters), alternated with mixed on the same
  engine ``--repeats`` (3) times, medians reported: the ceiling;
- mixed: one ``LLM(enable_lora=True, max_loras=n)``, every row with its adapter, one
  ``generate`` call (adapters share every step);
- merged: for each adapter, its weights merged into the base (``W + scale B A``), one engine
  per merged model, running that adapter's rows only (``n`` separate jobs, times summed).

Outputs of mixed and merged are compared row by row (greedy: they must be equal).

Run (idle machine)::

    python benchmarks/bench_lora.py                       # the issue's shape, ~5 min on 2 cores
    python benchmarks/bench_lora.py --rows 32 --max-tokens 8 --adapters 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dfllm import LLM, LoRARequest, SamplingParams
from dfllm.lora.adapter import load_adapter
from dfllm.models.bundled import resolve_model
from dfllm.models.spec import ModelSpec

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(base: Path, out: Path, seed: int, rank: int) -> Path:
    """A random PEFT-format LoRA adapter of ``base`` (every decoder layer, all seven projections)."""
    cfg = json.loads((base / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for m, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 16,
                "target_modules": list(TARGETS),
                "lora_dropout": 0.0,
                "bias": "none",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base),
            }
        )
    )
    return out


def write_merged(base: Path, adapter: Path, out: Path) -> Path:
    """The base model with ``adapter`` merged into its weights, as a model directory."""
    from transformers import AutoConfig

    spec = ModelSpec.from_hf(AutoConfig.from_pretrained(base))
    lora = load_adapter(LoRARequest(adapter.name, 1, str(adapter)), spec, 64)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors"))
    weights = {}
    for f in base.glob("*.safetensors"):
        weights.update(load_file(f))
    save_file(lora.merged_into(weights), out / "model.safetensors")
    return out


def run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, loras=None, warm: bool = True
) -> tuple[float, list]:
    """The time and outputs of a run, after an untimed identical one when ``warm`` (the first run
    touches the KV cache's memory and loads the adapters: up to 4x slower on CPU)."""
    if warm:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--adapters", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--repeats", type=int, default=3, help="alternated base/mixed runs (medians reported)")
    ap.add_argument("--skip-merged", action="store_true", help="time base and mixed only")
    args = ap.parse_args()
    base = resolve_model(args.model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.rows)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tokens = args.rows * args.max_tokens
    common = dict(device="cpu", max_model_len=args.prompt_tokens + args.max_tokens + 16, max_num_seqs=256)
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    try:
        adapters = [write_adapter(base, tmp / f"adapter{i}", i, args.rank) for i in range(max(args.adapters))]
        report = {
            "date": datetime.date.today().isoformat(),
            "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "rows": args.rows,
            "max_tokens": args.max_tokens,
            "rank": args.rank,
        }
        for n in args.adapters:
            loras = [LoRARequest(f"a{i}", i + 1, str(adapters[i])) for i in range(n)]
            per_row = [loras[i % n] for i in range(args.rows)]
            llm = LLM(str(base), enable_lora=True, max_loras=n, max_lora_rank=args.rank, **common)
            # base (no row with an adapter: the base model's path) and mixed alternate on one engine,
            # so that both see the same machine; medians of --repeats
            run(llm, prompts, params)
            times: dict[str, list[float]] = {"base": [], "mixed": []}
            for _ in range(args.repeats):
                times["base"].append(run(llm, prompts, params, warm=False)[0])
                took, mixed = run(llm, prompts, params, per_row, warm=len(times["mixed"]) == 0)
                times["mixed"].append(took)
            base_s, mixed_s = statistics.median(times["base"]), statistics.median(times["mixed"])
            del llm
            print(
                f"base model alone: {base_s:.1f} s, {tokens / base_s:.0f} generated tok/s "
                f"(runs {[round(t, 1) for t in times['base']]})"
            )
            report[f"base_{n}_tok_s"] = round(tokens / base_s)
            line = (
                f"{n} adapters mixed: {mixed_s:.1f} s, {tokens / mixed_s:.0f} tok/s, "
                f"{mixed_s / base_s:.2f}x the base model's time (runs {[round(t, 1) for t in times['mixed']]})"
            )
            report[f"mixed_{n}_tok_s"] = round(tokens / mixed_s)
            report[f"mixed_{n}_slowdown"] = round(mixed_s / base_s, 2)
            if not args.skip_merged:
                merged_s, equal = 0.0, 0
                for i in range(n):
                    rows = list(range(i, args.rows, n))
                    path = write_merged(base, adapters[i], tmp / f"merged{i}")
                    took, outs = run(LLM(str(path), **common), [prompts[r] for r in rows], params)
                    merged_s += took
                    equal += sum(o == mixed[r] for r, o in zip(rows, outs))
                    shutil.rmtree(path)
                line += (
                    f"; {n} merged jobs: {merged_s:.1f} s ({mixed_s / merged_s:.2f}x their time); "
                    f"outputs equal on {equal}/{args.rows} rows"
                )
                report[f"merged_{n}_tok_s"] = round(tokens / merged_s)
                report[f"merged_{n}_equal_rows"] = equal
            print(line)
        print(json.dumps(report))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
