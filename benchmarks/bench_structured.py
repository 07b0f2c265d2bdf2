"""Throughput cost of structured outputs: the same prompts with and without a JSON schema.

Workload
--------
``--num-prompts`` (default 32) chat prompts asking the bundled SmolLM2-135M-Instruct to
describe a city as JSON, rendered with the chat template. Greedy decoding in float32.

- unconstrained: ``SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)``.
- constrained: the same, plus ``structured_outputs=StructuredOutputsParams(json=...)`` with
  a schema whose output cannot end before ``N`` tokens (an array of at least 64 small city
  records), so that both runs generate exactly ``N`` tokens per prompt with the same batch
  dynamics and the difference is the cost of the masks (bitmask fill, mask application,
  matcher advance) per step.

On a machine where other processes compete for the cores, pass ``--threads 1``: torch's
OpenMP team oversubscribed by other jobs ran 20x slower there and the figures were noise.

The two alternate ``--repeats`` times (after one warm-up of each, which also compiles the
schema; the prefix cache is reset before each timed run) and the script prints the median
throughput of each and their ratio (constrained / unconstrained). A last run with a
realistic schema (one city record, which ends when complete) reports its throughput and how
many outputs parsed and validated.

Because wall-clock throughput on a shared machine is noisy, the script also replays the
constrained run's tokens through fresh matchers, batch by batch as the engine does (bitmask
fill, mask applied to a full-vocabulary logits row, token accepted), and prints that grammar
work in microseconds per generated token: a figure that does not depend on the model.

Run (from the repository root)::

    python benchmarks/bench_structured.py                 # about 2 minutes on 2 CPU cores
    python benchmarks/bench_structured.py --threads 1     # on a machine shared with other jobs
    python benchmarks/bench_structured.py --num-prompts 8 --max-tokens 16 --repeats 1   # quick check
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from dfllm import LLM, SamplingParams, StructuredOutputsParams
from dfllm.engine.structured import apply_masks

CITIES = [
    "Paris",
    "Tokyo",
    "Lima",
    "Cairo",
    "Oslo",
    "Delhi",
    "Quito",
    "Rome",
    "Seoul",
    "Accra",
    "Perth",
    "Hanoi",
    "Dakar",
    "Sofia",
    "Riga",
    "Bogota",
]

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "capital"],
}
# Cannot complete in fewer than thousands of tokens: every row runs to max_tokens.
LONG = {"type": "array", "items": CITY, "minItems": 64}


def prompts(llm: LLM, n: int) -> list[dict]:
    tok = llm.get_tokenizer()
    out = []
    for i in range(n):
        city = CITIES[i % len(CITIES)]
        text = tok.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Describe {city} (request {i}) as JSON with name, country, population "
                    "and whether it is a capital.",
                }
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        out.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
    return out


def timed(llm: LLM, batch: list[dict], params: SamplingParams) -> tuple[float, int, list]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), outs


def grammar_us_per_token(llm: LLM, outs: list, structured: StructuredOutputsParams) -> float:
    """Replay ``outs`` through fresh matchers as one batch: grammar work per token, in microseconds."""
    grammar = llm.engine.input_processor.grammars.prepare(structured)
    grammars = [grammar.matcher() for _ in outs]
    tokens = [o.outputs[0].token_ids for o in outs]
    logits = torch.zeros(len(outs), llm.config.model.vocab_size)
    start, n = time.perf_counter(), 0
    for t in range(max(map(len, tokens))):
        live = [g if t < len(ids) else None for g, ids in zip(grammars, tokens)]
        apply_masks(logits, live)
        for g, ids in zip(live, tokens):
            if g is not None:
                assert g.accept(ids[t])
                n += 1
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(max_model_len=512)
    batch = prompts(llm, args.num_prompts)
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=LONG),
    )
    for params in (free, constrained):  # warm-up (and the schema's compilation)
        llm.generate(batch[:4], params, use_tqdm=False)

    rates: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, params in (("unconstrained", free), ("json schema", constrained)):
            seconds, n, outs = timed(llm, batch, params)
            rates[name].append(n / seconds)
            tokens[name] = n
            if name == "json schema":
                assert all(o.outputs[0].structured_output_complete is False for o in outs)
                assert all(o.outputs[0].text.startswith("[{") for o in outs)
                constrained_outs = outs

    real = SamplingParams(
        temperature=0.0, max_tokens=4 * args.max_tokens, structured_outputs=StructuredOutputsParams(json=CITY)
    )
    seconds, n, outs = timed(llm, batch, real)
    valid = 0
    for o in outs:
        try:
            doc = json.loads(o.outputs[0].text)
            valid += o.outputs[0].structured_output_complete and set(doc) == set(CITY["properties"])
        except ValueError:
            pass

    free_rate, json_rate = statistics.median(rates["unconstrained"]), statistics.median(rates["json schema"])
    print(
        f"# bench_structured {datetime.date.today()} {platform.machine()} torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.num_prompts} prompts x {args.max_tokens} tokens, greedy, "
        f"median of {args.repeats} alternating runs"
    )
    print(f"{'run':<34}{'tokens':>8}{'tokens/s':>10}   single runs")
    for name, rate in (("unconstrained", free_rate), ("json schema (fixed length)", json_rate)):
        key = "unconstrained" if name == "unconstrained" else "json schema"
        singles = ", ".join(f"{r:.1f}" for r in rates[key])
        print(f"{name:<34}{tokens[key]:>8}{rate:>10.1f}   {singles}")
    print(f"{'ratio (json schema / unconstrained)':<42}{json_rate / free_rate:>10.3f}x")
    us = grammar_us_per_token(llm, constrained_outs, constrained.structured_outputs)
    print(
        f"grammar work (bitmask fill + mask + accept), replayed: {us:.0f} us per generated token = "
        f"{us * 1e-6 * free_rate:.1%} of an unconstrained token's time at the measured rate"
    )
    print(
        f"realistic schema (one record, ends when complete): {n} tokens, {n / seconds:.1f} tokens/s, "
        f"{valid}/{len(outs)} outputs complete and valid"
    )


if __name__ == "__main__":
    main()
