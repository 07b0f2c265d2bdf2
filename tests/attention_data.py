"""Random paged-attention batches (q/k/v and a filled paged cache with its metadata) and the
relative error the kernel tests compare by; shared by the kernel and the model tests."""

from __future__ import annotations

import torch

from dfllm.kernels.backend import TORCH_OPS
from dfllm.kernels.metadata import AttentionMetadata, DecodeGroup, PrefillSpan


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest reference value."""
    got, want = got.float().cpu(), want.float().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def attention_batch(seqs, kv_heads, group, head_dim, block_size, dtype, device, seed=0):
    """Random q/k/v and a filled paged cache for ``seqs`` = [(q_len, seq_len), ...].

    Block tables are random draws from a shuffled pool of block ids; the cache holds random
    values everywhere (so reading a wrong slot shows) and the step's new keys at their slots.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = sum(q for q, _ in seqs)
    blocks_needed = [-(-n // block_size) for _, n in seqs]
    num_blocks = sum(blocks_needed) + 3
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[pool.pop() for _ in range(b)] for b in blocks_needed]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q = rand(tokens, kv_heads * group, head_dim)
    k, v = rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim)
    k_cache = rand(num_blocks, block_size, kv_heads, head_dim)
    v_cache = rand(num_blocks, block_size, kv_heads, head_dim)
    meta = attention_metadata(seqs, tables, block_size, device)
    TORCH_OPS.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


def attention_metadata(seqs, tables, bs, device) -> AttentionMetadata:
    """Both the torch fields (prefill spans, one decode group) and the ragged fields."""
    slots, prefills, dec_rows, dec_tables, dec_lens, qsl = [], [], [], [], [], [0]
    for (q_len, seq_len), table in zip(seqs, tables):
        row, start = qsl[-1], seq_len - q_len
        slots += [table[p // bs] * bs + p % bs for p in range(start, seq_len)]
        if q_len == 1:
            dec_rows.append(row)
            dec_tables.append(table)
            dec_lens.append(seq_len)
        else:
            all_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(seq_len)], device=device)
            prefills.append(PrefillSpan(row, q_len, seq_len, None if start == 0 else all_slots))
        qsl.append(row + q_len)
    groups = []
    if dec_rows:
        width = max(len(t) for t in dec_tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables], device=device)
        mask = torch.arange(width * bs, device=device)[None, :] < torch.tensor(dec_lens, device=device)[:, None]
        groups.append(DecodeGroup(torch.tensor(dec_rows, device=device), padded, mask))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        prefills=prefills,
        decode_groups=groups,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n for _, n in seqs], dtype=torch.int32, device=device),
        block_tables=block_tables,
        block_size=bs,
        max_query_len=max(q for q, _ in seqs),
        max_seq_len=max(n for _, n in seqs),
    )
