"""Embedding throughput: dfllm vs sentence-transformers, same texts, same run.

Workload: ``--num-texts`` (default 2000) English-like texts of mixed length (1 to ~300
words, seeded), embedded with the bundled all-MiniLM-L6-v2 (mean pooling, normalised,
truncated at 256 tokens) by ``LLM.embed`` and by ``SentenceTransformer.encode`` (its
default batch size 32; it sorts by length too). Both run in float32 on the CPU, alternately
``--repeats`` times; the medians and their ratio are printed, with the minimum cosine
similarity between the two engines' embeddings.

The same run measures the workload's matmul ceiling (after each round of the engines, the
fastest of the rounds kept): the encoder's linear layers alone (q/k/v, attention output, the
MLP's two layers, times the number of layers) in float32, at the token count of a
length-sorted batch of 32 texts, the fastest of several passes of ``F.linear`` and of
oneDNN's prepacked GEMM (what dfllm runs), over the workload's real (unpadded) tokens. No
float32 engine can beat it (attention, norms, GELU and padding come on top), so each
engine's share of it shows how much headroom is left. The same GEMMs at their median pass are
printed too: on a VM whose speed varies from pass to pass the fastest pass is a burst that no
whole run sustains.

``--quantization int8`` adds dfllm with ``quantization="int8"`` (dynamic int8 encoder layers,
:mod:`dfllm.models.quantization`) to the alternation: its throughput, its ratio to
sentence-transformers and its cosine similarity to dfllm float32's embeddings (min and mean).

A breakdown of one more dfllm float32 pass over the workload follows (``--skip-breakdown``
drops it): the linear layers, attention, GELU, LayerNorm with its residual add, the
embeddings, the rest of the encoder, and what runs outside it (tokenising, batching,
pooling), each timed from outside the engine. It says where the time the linears-only
ceiling leaves out goes, and what attention's matmuls weigh against the linears' (FLOPs and
GFLOP/s).

    python benchmarks/bench_embed.py
    python benchmarks/bench_embed.py --quantization int8
    python benchmarks/bench_embed.py --num-texts 200 --repeats 1     # quick check
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections import defaultdict
from datetime import datetime

import torch
import torch.nn.functional as F

WORDS = (
    "the a of to and in is for on with as by at from that this it be are was data model query table "
    "column partition worker cluster parquet storage engine batch token prompt embedding vector search "
    "index result user system quickly slowly large small river mountain city music science history"
).split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 12), rng.randint(12, 60), rng.randint(60, 300)]) for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "." for k in lengths]


def time_it(fn) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def batch_tokens(lengths: list[int], batch: int = 32) -> int:
    """Padded tokens of the median batch when ``lengths`` are sorted and cut into ``batch``-sized
    batches (the shape a length-sorting engine hands the GEMM)."""
    ordered = sorted(lengths, reverse=True)
    sizes = sorted(max(ordered[i : i + batch]) * len(ordered[i : i + batch]) for i in range(0, len(ordered), batch))
    return sizes[len(sizes) // 2]


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """``(in, out)`` of one BERT layer's linear layers: fused q/k/v, attention output, MLP up, down."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(h, 3 * h), (h, h), (h, i), (i, h)]


def matmul_ceiling(cfg, tokens: int, passes: int = 9) -> tuple[float, float, float, float]:
    """Seconds the encoder's float32 linear layers take on ``tokens`` rows, fastest of
    ``passes`` (per shape, the faster of ``F.linear`` and oneDNN's prepacked GEMM); the same at
    the median pass (what the GEMMs sustain on a machine whose speed varies from pass to
    pass); and the GFLOP/s of ``F.linear`` and of the prepacked GEMM alone."""
    torch.manual_seed(0)
    best = {"F.linear": 0.0, "packed": 0.0, "either": 0.0}
    median_pass = 0.0
    for d_in, d_out in linear_shapes(cfg):
        x, w, b = torch.randn(tokens, d_in), torch.randn(d_out, d_in) * 0.02, torch.zeros(d_out)
        fns = {"F.linear": lambda x=x, w=w, b=b: F.linear(x, w, b)}
        if torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            fns["packed"] = lambda x=x, p=packed, b=b: torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
        shape_best, shape_median = {}, {}
        with torch.inference_mode():
            for name, fn in fns.items():
                fn()  # warm-up
                times = []
                for _ in range(passes):
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
                shape_best[name] = min(times)
                shape_median[name] = statistics.median(times)
        median_pass += min(shape_median.values())
        best["F.linear"] += shape_best["F.linear"]
        best["packed"] += shape_best.get("packed", shape_best["F.linear"])
        best["either"] += min(shape_best.values())
    layers = cfg.num_hidden_layers
    flops = 2 * tokens * sum(a * b for a, b in linear_shapes(cfg)) * layers
    gflops = flops / (best["F.linear"] * layers) / 1e9, flops / (best["packed"] * layers) / 1e9
    return best["either"] * layers, median_pass * layers, *gflops


BREAKDOWN_PARTS = [
    ("linear layers", "q/k/v, attention output, MLP up and down"),
    ("attention", "the encoder attention kernel"),
    ("GELU", "the MLP's activation"),
    ("LayerNorm + add", "the residual adds and their norms"),
    ("embeddings", "lookups, their sum and norm"),
    ("rest of the encoder", "unpadding, module calls"),
    ("outside the encoder", "tokenising, batching, pooling, normalising"),
]


def breakdown(llm, texts: list[str]) -> dict[str, float]:
    """Seconds of one ``llm.embed(texts)`` per part of :data:`BREAKDOWN_PARTS`, timed by
    forward hooks and a wrapped attention kernel (from outside the engine, for measurement)."""
    from dfllm.models import bert
    from dfllm.models.cpu_linear import PackedLinear
    from dfllm.models.quantization import Int8Linear

    model = llm.pooling_engine.model
    acc: dict[str, float] = defaultdict(float)
    starts: dict[tuple[int, str], float] = {}
    handles = []

    def timed(module, name: str) -> None:
        def pre(m, _args):
            starts[id(m), name] = time.perf_counter()

        def post(m, _args, _out):
            acc[name] += time.perf_counter() - starts[id(m), name]

        handles.extend([module.register_forward_pre_hook(pre), module.register_forward_hook(post)])

    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, PackedLinear, Int8Linear)):
            timed(module, "linear")
        elif isinstance(module, (bert.BertIntermediate, bert.BertDenseNorm)):
            # the whole block, and its linear layer on its own: the difference is GELU, or add + norm
            kind = "intermediate" if isinstance(module, bert.BertIntermediate) else "dense_norm"
            timed(module, kind)
            timed(module.dense, f"{kind}.dense")
        elif isinstance(module, bert.BertEmbeddings):
            timed(module, "embeddings")
    timed(model, "model")
    attends = [(m, m.attend) for m in model.modules() if isinstance(m, bert.BertSelfAttention)]

    def attend(qkv, cu_seqlens, heads, _fn=attends[0][1]):
        start = time.perf_counter()
        out = _fn(qkv, cu_seqlens, heads)
        acc["attention"] += time.perf_counter() - start
        return out

    bert.use_encoder_attention(model, attend)
    try:
        start = time.perf_counter()
        llm.embed(texts, use_tqdm=False)
        total = time.perf_counter() - start
    finally:
        for h in handles:
            h.remove()
        for m, fn in attends:
            m.attend = fn
    parts = {
        "linear layers": acc["linear"],
        "attention": acc["attention"],
        "GELU": acc["intermediate"] - acc["intermediate.dense"],
        "LayerNorm + add": acc["dense_norm"] - acc["dense_norm.dense"],
        "embeddings": acc["embeddings"],
    }
    parts["rest of the encoder"] = acc["model"] - sum(parts.values())
    parts["outside the encoder"] = total - acc["model"]
    return {**parts, "total": total}


def print_breakdown(parts: dict[str, float], ceiling: float, lengths: list[int], cfg) -> None:
    total = parts["total"]
    print("\nwhere dfllm float32's time goes (one more pass over the workload, timed from outside):")
    print(f"  {'part':<22}{'':<44}{'s':>8}{'%':>7}")
    for name, what in BREAKDOWN_PARTS:
        print(f"  {name:<22}{what:<44}{parts[name]:>8.2f}{100 * parts[name] / total:>7.1f}")
    print(f"  {'whole embed':<66}{total:>8.2f}{100:>7.1f}")
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    linear_flops = 2 * sum(lengths) * sum(a * b for a, b in linear_shapes(cfg)) * layers
    attention_flops = 4 * sum(n * n for n in lengths) * h * layers
    attention_rate = attention_flops / parts["attention"] / 1e9
    linear_rate = linear_flops / parts["linear layers"] / 1e9
    print(
        f"  attention's matmuls are {100 * attention_flops / linear_flops:.1f}% of the linears' FLOPs, at "
        f"{attention_rate:.0f} GFLOP/s (the linears {linear_rate:.0f}); "
        f"at 85% of the ceiling, all but the ceiling's linears would have to fit in {ceiling / 0.85 - ceiling:.2f} s "
        f"({ceiling:.2f} s of linears at their fastest pass, here they took {parts['linear layers']:.2f} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-texts", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--st-batch-size", type=int, default=32)
    ap.add_argument(
        "--quantization",
        choices=["int8"],
        default=None,
        help="also time dfllm with this quantization (alternating with the others)",
    )
    ap.add_argument("--skip-breakdown", action="store_true", help="no breakdown of dfllm float32's time")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from sentence_transformers import SentenceTransformer

    from dfllm import LLM

    texts = make_texts(args.num_texts)
    llm = LLM("all-minilm-l6-v2")
    st = SentenceTransformer(str(llm.config.model_path), device="cpu")
    lengths = [len(ids) for ids in llm.get_tokenizer()(texts, truncation=True, max_length=256)["input_ids"]]
    n_tokens = sum(lengths)
    print(f"workload: {len(texts)} texts, {n_tokens} tokens after truncation to 256")
    int8 = LLM("all-minilm-l6-v2", quantization=args.quantization) if args.quantization else None

    def embed(engine):
        return lambda: torch.tensor([o.outputs.embedding for o in engine.embed(texts, use_tqdm=False)])

    def run_st():
        return st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True, show_progress_bar=False)

    runs = {"dfllm": embed(llm), "sentence-transformers": run_st}
    if int8 is not None:
        runs[f"dfllm {args.quantization}"] = embed(int8)
    for fn in runs.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in runs}
    outs: dict[str, torch.Tensor] = {}
    # the matmul ceiling is measured after each round of the engines (same process, same
    # threads): one measurement could fall in a slow spell of the machine that no engine run saw
    m = batch_tokens(lengths)
    ceilings = []
    for r in range(args.repeats):
        for k, fn in runs.items():
            t, outs[k] = time_it(fn)
            times[k].append(t)
        ceilings.append(matmul_ceiling(llm.config.hf_config, m))
        print(f"run {r + 1}: " + ", ".join(f"{k} {len(texts) / v[-1]:.1f} texts/s" for k, v in times.items()))
    cos = torch.nn.functional.cosine_similarity(outs["dfllm"], outs["sentence-transformers"].float()).min().item()
    med = {k: statistics.median(v) for k, v in times.items()}

    per_call = min(c[0] for c in ceilings)
    per_call_median = statistics.median(c[1] for c in ceilings)
    gflops_linear, gflops_packed = max(c[2] for c in ceilings), max(c[3] for c in ceilings)
    ceiling, sustained = per_call * n_tokens / m, per_call_median * n_tokens / m
    print(
        f"\nmatmul ceiling: the encoder's float32 linear layers alone on the {n_tokens} real tokens, at {m} tokens "
        f"per call (a length-sorted batch of 32): {ceiling:.2f} s = {len(texts) / ceiling:.1f} texts/s, "
        f"{n_tokens / ceiling:.0f} tokens/s (F.linear {gflops_linear:.0f} GFLOP/s, oneDNN packed "
        f"{gflops_packed:.0f} GFLOP/s, the faster per shape); at the median pass {sustained:.2f} s = "
        f"{len(texts) / sustained:.1f} texts/s (dfllm float32 at {100 * sustained / med['dfllm']:.0f}% of that)"
    )
    print(f"\n{'engine':<24}{'seconds':>10}{'texts/s':>10}{'tokens/s':>11}{'% of fp32 matmul ceiling':>26}")
    print(
        f"{'(fp32 matmul ceiling)':<24}{ceiling:>10.2f}{len(texts) / ceiling:>10.1f}{n_tokens / ceiling:>11.0f}"
        f"{100:>25}%"
    )
    for k, t in med.items():
        print(f"{k:<24}{t:>10.2f}{len(texts) / t:>10.1f}{n_tokens / t:>11.0f}{100 * ceiling / t:>25.0f}%")
    ratio = med["sentence-transformers"] / med["dfllm"]
    print(
        f"ratio dfllm/sentence-transformers: {ratio:.2f}x   (min cosine similarity {cos:.6f}); "
        f"float32 ceiling/sentence-transformers: {med['sentence-transformers'] / ceiling:.2f}x"
    )
    parts = None
    if not args.skip_breakdown:
        parts = breakdown(llm, texts)
        print_breakdown(parts, ceiling, lengths, llm.config.hf_config)
    result = {
        "breakdown_seconds": parts,
        "median_seconds": med,
        "ratio": ratio,
        "texts": len(texts),
        "tokens": n_tokens,
        "min_cosine": cos,
        "matmul_ceiling_seconds": ceiling,
        "matmul_median_pass_seconds": sustained,
        "ceiling_tokens_per_call": m,
        "ceiling_gflops": {"F.linear": gflops_linear, "packed": gflops_packed},
    }
    if int8 is not None:
        name = f"dfllm {args.quantization}"
        q_cos = torch.nn.functional.cosine_similarity(outs[name], outs["dfllm"])
        q_ratio = med["sentence-transformers"] / med[name]
        print(
            f"ratio {name}/sentence-transformers: {q_ratio:.2f}x, {name}/dfllm float32: "
            f"{med['dfllm'] / med[name]:.2f}x   (cosine similarity to dfllm float32: min "
            f"{q_cos.min().item():.4f}, mean {q_cos.mean().item():.5f})"
        )
        result.update(
            {
                "quantization": args.quantization,
                "quantized_ratio": q_ratio,
                "quantized_min_cosine": q_cos.min().item(),
                "quantized_mean_cosine": q_cos.mean().item(),
            }
        )
    print(
        f"date {datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
        f"CPUs {torch.get_num_threads()} threads, {platform.machine()}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
