"""Embedding throughput: dfllm vs sentence-transformers, same texts, same run.

Workload: ``--num-texts`` (default 2000) English-like texts of mixed length (1 to ~300
words, seeded), embedded with the bundled all-MiniLM-L6-v2 (mean pooling, normalised,
truncated at 256 tokens) by ``LLM.embed`` and by ``SentenceTransformer.encode`` (its
default batch size 32; it sorts by length too). Both run in float32 on the CPU, alternately
``--repeats`` times; the medians and their ratio are printed, with the minimum cosine
similarity between the two engines' embeddings.

    python benchmarks/bench_embed.py
    python benchmarks/bench_embed.py --num-texts 200 --repeats 1     # quick check
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import datetime

import torch

WORDS = ("the a of to and in is for on with as by at from that this it be are was data model query table "
         "column partition worker cluster parquet storage engine batch token prompt embedding vector search "
         "index result user system quickly slowly large small river mountain city music science history").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 12), rng.randint(12, 60), rng.randint(60, 300)]) for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "." for k in lengths]


def time_it(fn) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-texts", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--st-batch-size", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from sentence_transformers import SentenceTransformer

    from dfllm import LLM

    texts = make_texts(args.num_texts)
    llm = LLM("all-minilm-l6-v2")
    st = SentenceTransformer(str(llm.config.model_path), device="cpu")
    n_tokens = sum(len(ids) for ids in llm.get_tokenizer()(texts, truncation=True, max_length=256)["input_ids"])
    print(f"workload: {len(texts)} texts, {n_tokens} tokens after truncation to 256")

    def run_dfllm():
        return torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])

    def run_st():
        return st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True, show_progress_bar=False)

    run_dfllm(), run_st()  # warm-up
    times: dict[str, list[float]] = {"dfllm": [], "sentence-transformers": []}
    for r in range(args.repeats):
        t_d, emb_d = time_it(run_dfllm)
        t_s, emb_s = time_it(run_st)
        times["dfllm"].append(t_d)
        times["sentence-transformers"].append(t_s)
        print(f"run {r + 1}: dfllm {len(texts) / t_d:.1f} texts/s, "
              f"sentence-transformers {len(texts) / t_s:.1f} texts/s")
    cos = torch.nn.functional.cosine_similarity(emb_d, emb_s.float()).min().item()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{'engine':<24}{'seconds':>10}{'texts/s':>10}{'tokens/s':>11}")
    for k, t in med.items():
        print(f"{k:<24}{t:>10.2f}{len(texts) / t:>10.1f}{n_tokens / t:>11.0f}")
    ratio = med["sentence-transformers"] / med["dfllm"]
    print(f"ratio dfllm/sentence-transformers: {ratio:.2f}x   (min cosine similarity {cos:.6f})")
    print(f"date {datetime.now().isoformat(timespec='seconds')}, torch {torch.__version__}, "
          f"CPUs {torch.get_num_threads()} threads, {platform.machine()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_seconds": med, "ratio": ratio, "texts": len(texts), "tokens": n_tokens,
                       "min_cosine": cos}, f, indent=2)


if __name__ == "__main__":
    main()
