"""Fidelity of greedy decoding against Hugging Face transformers, by log-probabilities.

The criterion is vLLM's (``check_logprobs_close`` in vLLM's ``tests/models/utils.py``): for
each prompt, the two greedy continuations must be equal token for token up to their first
divergence; at that position each side's token must be among the other side's top-``k``
log-probabilities (the two distributions are computed from the same prefix there, so a
divergence is only allowed between near-tied candidates). After the first divergence the
continuations are conditioned on different prefixes and comparison stops for that prompt.
Without a divergence both continuations must have the same length, unless the shorter one
ended on the end-of-sequence token.

Why not bit-identical tokens: two correct float32 implementations that add in a different
order (blocked or split-K matmuls, fused attention kernels, another batch composition) give
logits that differ in the last bits, and on a near tie greedy decoding then picks the other
token and the continuations part. vLLM measures fidelity to transformers this way, so the
engine may use faster kernels. A real defect (a wrong rope, mask, norm or cache entry) moves
the logits far more than rounding does and picks a token outside the other side's top-k.

Exactness is kept where it is natural: between dfllm configurations that must compute the
same thing (prefix cache on/off, preemption or not, chunked prefill or not, tensor parallel
vs one rank), tests compare token ids with ``==``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM

from dfllm import LLM, SamplingParams
from dfllm.outputs import RequestOutput

TOPK = 5


class GreedyLogprobs(NamedTuple):
    """One greedy continuation: its token ids and, per generated position, the top-k
    ``{token_id: logprob}`` of the distribution that position was chosen from."""

    token_ids: list[int]
    logprobs: list[dict[int, float]]


def _per_prompt(n: list[int] | int, count: int) -> list[int]:
    return [n] * count if isinstance(n, int) else list(n)


def hf_greedy_logprobs(
    path: Path, prompts: list[list[int]], max_new_tokens: list[int] | int, topk: int = TOPK
) -> list[GreedyLogprobs]:
    """Transformers' own greedy ``generate`` (float32, eager attention, one prompt at a time,
    no padding, end-of-sequence disabled) with the top-``topk`` log-probabilities of the raw
    logits at every generated position."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for ids, n in zip(prompts, _per_prompt(max_new_tokens, len(prompts))):
            x = torch.tensor([ids])
            res = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = res.sequences[0, len(ids) :].tolist()
            logprobs = []
            for step in res.logits:
                values, top = torch.log_softmax(step[0].float(), dim=-1).topk(topk)
                logprobs.append(dict(zip(top.tolist(), values.tolist())))
            outs.append(GreedyLogprobs(tokens, logprobs))
    return outs


def from_outputs(outputs: Sequence[RequestOutput], topk: int = TOPK) -> list[GreedyLogprobs]:
    """The first completion of each of dfllm's outputs (generated with ``logprobs=topk``), as
    token ids and top-``topk`` ``{token_id: logprob}`` (the sampled token, which dfllm adds
    when it is outside the top-k, is left out, as it is not part of the top-k)."""
    result = []
    for out in outputs:
        c = out.outputs[0]
        if c.logprobs is None:
            raise ValueError(f"request {out.request_id} was generated without SamplingParams.logprobs")
        logprobs = [
            {t: lp.logprob for t, lp in pos.items() if lp.rank is None or lp.rank <= topk} for pos in c.logprobs
        ]
        result.append(GreedyLogprobs(list(c.token_ids), logprobs))
    return result


def greedy_params(max_tokens: int, topk: int = TOPK) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens with the top-``topk`` logprobs."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=topk, ignore_eos=True)


def dfllm_greedy_logprobs(
    llm: LLM, prompts: list[list[int]], max_tokens: list[int] | int, topk: int = TOPK
) -> list[GreedyLogprobs]:
    """dfllm's greedy continuations of token-id ``prompts`` (end-of-sequence ignored) with the
    top-``topk`` log-probabilities, from ``SamplingParams(temperature=0, logprobs=topk)``."""
    params = [greedy_params(n, topk) for n in _per_prompt(max_tokens, len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return from_outputs(outs, topk)


def token_ids(outputs: Sequence[GreedyLogprobs]) -> list[list[int]]:
    """The token ids alone, for exact comparisons between dfllm configurations."""
    return [list(o.token_ids) for o in outputs]


def _fmt(lp: dict[int, float]) -> str:
    return "{" + ", ".join(f"{t}: {v:.4f}" for t, v in sorted(lp.items(), key=lambda kv: -kv[1])) + "}"


def check_logprobs_close(
    outputs_0: Sequence[GreedyLogprobs],
    outputs_1: Sequence[GreedyLogprobs],
    name_0: str,
    name_1: str,
    eos_token_id: int | None = None,
) -> None:
    """Assert vLLM's log-probability criterion between two lists of greedy continuations (one
    per prompt, same order): tokens equal up to the first divergence, and there each side's
    token in the other side's top-k; comparison stops at the first divergence. Without a
    divergence the lengths must match unless the shorter one ends with ``eos_token_id``.
    Raises AssertionError naming the prompt index, the position and both tokens and top-k."""
    if len(outputs_0) != len(outputs_1):
        raise AssertionError(f"{name_0} has {len(outputs_0)} outputs, {name_1} has {len(outputs_1)}")
    for i, (a, b) in enumerate(zip(outputs_0, outputs_1)):
        for name, o in ((name_0, a), (name_1, b)):
            if len(o.logprobs) != len(o.token_ids):
                raise AssertionError(
                    f"prompt {i}: {name} has {len(o.token_ids)} tokens but {len(o.logprobs)} logprob positions"
                )
        pos = next((p for p, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if pos is None:
            if len(a.token_ids) != len(b.token_ids):
                short = a if len(a.token_ids) < len(b.token_ids) else b
                if eos_token_id is None or not short.token_ids or short.token_ids[-1] != eos_token_id:
                    raise AssertionError(
                        f"prompt {i}: no divergence but {name_0} has {len(a.token_ids)} tokens and {name_1} "
                        f"{len(b.token_ids)} (the shorter does not end with eos {eos_token_id}); "
                        f"matched {a.token_ids[: len(short.token_ids)]}"
                    )
            continue
        ta, tb, la, lb = a.token_ids[pos], b.token_ids[pos], a.logprobs[pos], b.logprobs[pos]
        problems = []
        if ta not in lb:
            problems.append(f"{name_0}'s token {ta} is not in {name_1}'s top-{len(lb)}")
        if tb not in la:
            problems.append(f"{name_1}'s token {tb} is not in {name_0}'s top-{len(la)}")
        if problems:
            raise AssertionError(
                f"prompt {i}, position {pos}: {'; '.join(problems)}\n"
                f"matched tokens: {a.token_ids[:pos]}\n"
                f"{name_0}: token {ta}, top-k {_fmt(la)}\n"
                f"{name_1}: token {tb}, top-k {_fmt(lb)}"
            )
