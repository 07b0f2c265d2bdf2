"""The semantic operators' tests' data (short product reviews whose topics are known) and
their direct, row-by-row computations with ``dfllm.LLM`` (the reference the operators on
dataframes must equal)."""

from __future__ import annotations

import json

import pandas as pd

from dfllm import LLM, SamplingParams, StructuredOutputsParams
from dfllm.semantic.extract import ANSWER as EXTRACT_ANSWER
from dfllm.semantic.extract import EXTRACT_PREAMBLE, as_json_schema, fields_text
from dfllm.semantic.filter import ANSWER, EXPLAINED_ANSWER, JUDGE_PREAMBLE, verdict_probability
from dfllm.semantic.prompts import semantic_prompt

REVIEWS = [
    ("My parcel arrived two weeks late and the box was crushed.", "shipping"),
    ("The courier lost my package; it never arrived.", "shipping"),
    ("Delivery took a month, far too slow.", "shipping"),
    ("The headphones sound great and the bass is deep.", "quality"),
    ("The fabric tore after one wash.", "quality"),
    ("Way too expensive for what you get.", "price"),
    ("Shipping was fast, arrived the next day.", "shipping"),
    ("The battery died after a week.", "quality"),
]
INSTRUCTION = "{review} is about shipping or delivery"
ENGINE = {"max_model_len": 512, "kv_cache_memory_bytes": 2**24}


def reviews(n: int = len(REVIEWS), null_at: int | None = None) -> pd.DataFrame:
    """``n`` reviews (recycled) with their ids and known topics; a null review at ``null_at``."""
    rows = [REVIEWS[i % len(REVIEWS)] for i in range(n)]
    texts = [None if i == null_at else r for i, (r, _) in enumerate(rows)]
    return pd.DataFrame({"id": range(n), "review": pd.Series(texts, dtype=object), "label": [t for _, t in rows]})


def _messages(prompt, row: dict) -> list[dict]:
    return [{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.template.format(**row)}]


def direct_judge(
    model, df: pd.DataFrame, instruction: str = INSTRUCTION, *, explanations: bool = False, logprobs: int = 20
) -> list[tuple | None]:
    """Per row ``(verdict, probability, explanation)`` by ``LLM.chat`` one row at a time (None: a null row)."""
    llm = LLM(str(model), **ENGINE, **({"max_logprobs": -1} if logprobs == -1 else {}))
    prompt = semantic_prompt(JUDGE_PREAMBLE, instruction, answer=EXPLAINED_ANSWER if explanations else ANSWER)
    if explanations:
        sp = SamplingParams(
            temperature=0.0,
            logprobs=logprobs,
            max_tokens=64,
            structured_outputs=StructuredOutputsParams(regex=r"(True|False): [^\n]+"),
        )
    else:
        sp = SamplingParams(
            temperature=0.0,
            logprobs=logprobs,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["True", "False"]),
        )
    out: list[tuple | None] = []
    for row in df.to_dict("records"):
        if row["review"] is None:
            out.append(None)
            continue
        completion = llm.chat(_messages(prompt, row), sp, use_tqdm=False)[0].outputs[0]
        answer, _, note = completion.text.partition(":")
        verdict = answer == "True"
        first = {
            t: {"logprob": lp.logprob, "decoded_token": lp.decoded_token} for t, lp in completion.logprobs[0].items()
        }
        out.append((verdict, verdict_probability(first, verdict), note.strip()))
    return out


def direct_extract(model, df: pd.DataFrame, schema, instruction: str = "{review}") -> list[dict | None]:
    """Per row the extracted object, by ``LLM.chat`` one row at a time under the JSON schema."""
    llm = LLM(str(model), **ENGINE)
    js = as_json_schema(schema)
    prompt = semantic_prompt(EXTRACT_PREAMBLE.format(fields=fields_text(js)), instruction, answer=EXTRACT_ANSWER)
    sp = SamplingParams(temperature=0.0, max_tokens=256, structured_outputs=StructuredOutputsParams(json=js))
    out: list[dict | None] = []
    for row in df.to_dict("records"):
        if row["review"] is None:
            out.append(None)
            continue
        completion = llm.chat(_messages(prompt, row), sp, use_tqdm=False)[0].outputs[0]
        out.append(json.loads(completion.text) if completion.finish_reason == "stop" else None)
    return out


def two_answer_model(root, smollm2_dir, first: str, second: str, seed: int) -> str:
    """A tiny random model whose output layer gives ``first`` the logit t = h.w, ``second`` -t
    and every other token about 0, so both answers' log-probabilities are among the top 20
    whenever they matter (a random model's answers are far down its 49,152 tokens)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from helpers import build_tiny_model

    path = build_tiny_model(root, smollm2_dir, seed=seed, tie_word_embeddings=False)
    tok = AutoTokenizer.from_pretrained(path)
    a, b = tok.convert_tokens_to_ids(first), tok.convert_tokens_to_ids(second)
    weights = load_file(path / "model.safetensors")
    head = weights["lm_head.weight"]
    w = head[a].clone() * 4
    head *= 1e-3
    head[a], head[b] = w, -w
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)
