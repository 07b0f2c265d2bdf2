"""Sliding-window attention and logit soft-capping: the kernels against a dense reference,
the Triton kernel against the PyTorch one, and Mistral with a window shorter than its prompts
against transformers."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from decoder_builders import build_decoder
from fidelity import check_logprobs_close, dfllm_greedy_logprobs, hf_greedy_logprobs
from transformers import MistralConfig

from dfllm import LLM
from dfllm.kernels.backend import TORCH_OPS, select_ops

from attention_data import attention_batch, rel_err
from helpers import random_prompts

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

# (q_len, seq_len): a fresh prefill, a chunk over a cached prefix, decodes short and long.
MIXED = [(9, 9), (7, 40), (1, 5), (1, 33), (1, 70)]


def dense_reference(q, kc, vc, meta, scale, window, softcap):
    """Attention written out key by key from the cache (positions, not kernels)."""
    out = torch.empty_like(q, dtype=torch.float32)
    bs = kc.shape[1]
    group = q.shape[1] // kc.shape[2]
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        table = meta.block_tables[i].tolist()
        slots = [table[p // bs] * bs + p % bs for p in range(seq_len)]
        keys = kc.reshape(-1, *kc.shape[2:])[slots].float().repeat_interleave(group, dim=1)
        values = vc.reshape(-1, *vc.shape[2:])[slots].float().repeat_interleave(group, dim=1)
        q_len = qsl[i + 1] - qsl[i]
        for r in range(q_len):
            pos = seq_len - q_len + r
            seen = [j for j in range(seq_len) if j <= pos and (window is None or j > pos - window)]
            s = torch.einsum("hd,khd->hk", q[qsl[i] + r].float(), keys[seen]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[qsl[i] + r] = torch.einsum("hk,khd->hd", s.softmax(-1), values[seen])
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (8, None), (1, None), (None, 5.0), (13, 2.0)])
def test_reference_matches_dense_attention(window, softcap):
    q, k, v, kc, vc, meta = attention_batch(MIXED, 2, 3, 16, 4, torch.float32, "cpu", seed=3)
    q = q * 3  # large scores, so that the cap matters
    got = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.25, sliding_window=window, softcap=softcap)
    assert rel_err(got, dense_reference(q, kc, vc, meta, 0.25, window, softcap)) < 1e-5
    if window is not None:  # the metadata's window (Mistral: every layer) is the same
        meta.sliding_window = window
        assert torch.equal(TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.25, softcap=softcap), got)


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="Triton needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "window,softcap,num_segments",
    [
        (8, None, 1),
        (8, None, 4),
        (1, None, None),
        (None, 5.0, 1),
        (13, 2.0, 2),
        (100, 2.0, None),
    ],
)
def test_triton_matches_reference(window, softcap, num_segments):
    from dfllm.kernels._triton_paged_attention import paged_attention_launch

    select_ops("triton", torch.device(DEVICE))  # the interpreter on a CPU
    seqs = MIXED + [(20, 52)]  # and a chunk long enough for the 64-row query tiles
    q, k, v, kc, vc, meta = attention_batch(seqs, 2, 3, 16, 4, torch.float32, DEVICE, seed=5)
    q = q * 3
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.25, sliding_window=window, softcap=softcap)
    got = paged_attention_launch(
        q, kc, vc, meta, 0.25, num_segments=num_segments, sliding_window=window, softcap=softcap
    )
    assert rel_err(got, want) < 1e-5


@pytest.mark.slow
def test_blocks_before_the_window_are_never_read():
    """Blocks wholly before the window of a sequence's first query may be freed and reused:
    both kernels must give the same output with NaN there (0 * NaN would show)."""
    window, bs = 8, 4
    q, k, v, kc, vc, meta = attention_batch(MIXED, 2, 3, 16, bs, torch.float32, "cpu", seed=9)
    group = meta.decode_groups[0]
    for row, n in enumerate(group.mask.sum(1).tolist()):  # pad with the row's own last block, as the engine
        real = -(-n // bs)
        group.block_tables[row, real:] = group.block_tables[row, real - 1]
    want = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.25, sliding_window=window)
    qsl = meta.query_start_loc.tolist()
    poisoned = 0
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        first_key = max(0, seq_len - (qsl[i + 1] - qsl[i]) - window + 1)
        for b in range(first_key // bs):
            block = int(meta.block_tables[i, b])
            kc[block], vc[block] = float("nan"), float("nan")
            poisoned += 1
    assert poisoned >= 20
    got = TORCH_OPS.paged_attention(q, k, v, kc, vc, meta, 0.25, sliding_window=window)
    assert torch.equal(got, want)
    if INTERPRET or DEVICE == "cuda":
        from dfllm.kernels._triton_paged_attention import paged_attention_launch

        select_ops("triton", torch.device(DEVICE))
        args = [x.to(DEVICE) for x in (q, kc, vc)]
        meta = attention_batch(MIXED, 2, 3, 16, bs, torch.float32, DEVICE, seed=9)[-1]
        for segments in (1, 4):
            got = paged_attention_launch(*args, meta, 0.25, num_segments=segments, sliding_window=window)
            assert rel_err(got, want) < 1e-5


# ---- Mistral: every layer windowed ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory, smollm2_dir) -> Path:
    return build_decoder(tmp_path_factory.mktemp("models"), smollm2_dir, MistralConfig, "mistral-w8", sliding_window=8)


@pytest.mark.slow
def test_mistral_window_shorter_than_prompts_matches_transformers(tiny_mistral):
    prompts = random_prompts(4, 9, 30, seed=11)
    max_tokens = [12, 5, 9, 16]
    want = hf_greedy_logprobs(tiny_mistral, prompts, max_tokens)
    # small chunks and blocks: the window crosses chunk and block boundaries
    llm = LLM(tiny_mistral, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, max_model_len=128)
    check_logprobs_close(dfllm_greedy_logprobs(llm, prompts, max_tokens), want, "dfllm", "transformers")
    # shared prefixes served from the prefix cache
    shared = [prompts[0] + p[:5] for p in prompts[1:]]
    want = hf_greedy_logprobs(tiny_mistral, shared, 6)
    check_logprobs_close(dfllm_greedy_logprobs(llm, shared, 6), want, "dfllm", "transformers")


# ---- releasing the blocks that fell out of the window ---------------------------------------------


def test_block_manager_releases_blocks_out_of_the_window():
    from dfllm.engine.block_manager import FREED, BlockManager

    from helpers import make_seq

    bm = BlockManager(16, 4, enable_prefix_caching=True, sliding_window=6)
    tokens = list(range(100, 130))
    seq = make_seq(tokens)
    bm.allocate(seq, 30)
    seq.num_computed_tokens = 30
    bm.cache_full_blocks(seq)  # next query at 30 sees keys 25..30: blocks 0-5 (keys 0-23) are dead
    assert seq.block_table[:6] == [FREED] * 6 and FREED not in seq.block_table[6:]
    assert bm.num_free_blocks == 16 - 2
    seq.num_computed_tokens = 31  # one more token: nothing more is dead, nothing is released twice
    bm.cache_full_blocks(seq)
    assert bm.num_free_blocks == 16 - 2
    # released blocks keep their contents and hashes: a prompt sharing them is served from them
    other = make_seq(tokens[:21])
    hits = bm.match_prefix(other)
    assert len(hits) == 5
    bm.free_seq(seq)  # no block is released twice
    assert bm.num_free_blocks == 16 and all(b.ref_count == 0 for b in bm.blocks)
    # once a released block is handed out again, its hash is gone and the chain stops before it
    grab = make_seq([1] * 64)
    bm.allocate(grab, 64)
    assert bm.match_prefix(other) == []


@pytest.mark.slow
def test_mistral_releasing_blocks_keeps_outputs(tiny_mistral):
    prompts = random_prompts(4, 25, 33, seed=12)
    max_tokens = [20, 14, 17, 9]
    want = hf_greedy_logprobs(tiny_mistral, prompts, max_tokens)
    llm = LLM(tiny_mistral, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, max_model_len=128)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.bm.sliding_window == 8  # every layer is windowed: the engine frees what falls out
    held, released = [], []
    real_update = scheduler.update_from_step

    def update_and_record(out):
        real_update(out)
        held.append(max((sum(b != -1 for b in s.block_table) for s in scheduler.running), default=0))
        released.append(sum(b == -1 for s in scheduler.running for b in s.block_table))

    scheduler.update_from_step = update_and_record
    check_logprobs_close(dfllm_greedy_logprobs(llm, prompts, max_tokens), want, "dfllm", "transformers")
    assert max(released) >= 20
    assert max(held) <= 6  # a window of 8 keys spans at most 3 blocks of 4; plus the hash parent, a chunk


def test_only_classes_that_honour_the_window_accept_it():
    from dfllm.models.gemma import Gemma2ForCausalLM
    from dfllm.models.llama import LlamaForCausalLM
    from dfllm.models.sliding_window import honours_windows, layer_windows
    from dfllm.models.spec import ModelSpec

    every = ModelSpec.from_hf(MistralConfig(num_hidden_layers=3, sliding_window=16))
    assert layer_windows(every) == (16, 16, 16)
    some = replace(every, layer_types=("full_attention", "sliding_attention", "full_attention"))
    assert layer_windows(some) == (None, 16, None)

    llama, gemma = LlamaForCausalLM.window_support, Gemma2ForCausalLM.window_support
    assert honours_windows(llama, every) and not honours_windows(llama, some)
    assert honours_windows(gemma, some)
    assert not honours_windows("none", every)
    assert honours_windows("none", replace(every, sliding_window=None))
