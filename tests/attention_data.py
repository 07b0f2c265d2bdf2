"""Random paged-attention batches (q/k/v and a filled paged cache with its metadata) and the
relative error the kernel tests compare by; shared by the kernel and the model tests."""

from __future__ import annotations

import torch

from dfllm.kernels.backend import TORCH_OPS
from dfllm.kernels.metadata import AttentionMetadata, DecodeBatch, DecodeGroup, PrefillSpan


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest reference value."""
    got, want = got.float().cpu(), want.float().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def attention_batch(
    seqs,
    kv_heads,
    group,
    head_dim,
    block_size,
    dtype,
    device="cpu",
    seed=0,
    freed_before: int | None = None,
    freed: list[int] | None = None,
):
    """Random q/k/v and a filled paged cache for ``seqs`` = [(q_len, seq_len), ...], with the
    metadata of every path: decode groups for the reference, the flat batch for the kernels.

    Block tables are random draws from a shuffled pool of block ids; the cache holds random
    values everywhere (so reading a wrong slot shows) and the step's new keys at their slots.
    ``freed_before`` marks each decode's table entries wholly before that many last keys as
    freed (-1), as the block manager does for blocks out of a sliding window, and lists them
    in ``freed``.
    """
    g = torch.Generator().manual_seed(seed)
    bs = block_size
    need = [-(-n // bs) for _, n in seqs]
    num_blocks = sum(need) + 3
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[pool.pop() for _ in range(b)] for b in need]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    tokens = sum(q for q, _ in seqs)
    q = rand(tokens, kv_heads * group, head_dim)
    k, v = rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim)
    k_cache, v_cache = rand(num_blocks, bs, kv_heads, head_dim), rand(num_blocks, bs, kv_heads, head_dim)
    slots, prefills, dec, qsl = [], [], [], [0]
    for (q_len, seq_len), table in zip(seqs, tables):
        row, start = qsl[-1], seq_len - q_len
        slots += [table[p // bs] * bs + p % bs for p in range(start, seq_len)]
        if q_len == 1:
            if freed_before is not None:
                dead = max(0, seq_len - freed_before) // bs
                if freed is not None:
                    freed += table[:dead]
                table[:dead] = [-1] * dead
            dec.append((row, table, seq_len))
        else:
            all_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(seq_len)], device=device)
            prefills.append(PrefillSpan(row, q_len, seq_len, None if start == 0 else all_slots))
        qsl.append(row + q_len)
    groups, decodes = [], None
    if dec:
        width = max(len(t) for _, t, _ in dec)
        padded = [t + [t[-1]] * (width - len(t)) for _, t, _ in dec]  # as the engine pads
        lens = torch.tensor([n for _, _, n in dec], device=device)
        mask = torch.arange(width * bs, device=device)[None, :] < lens[:, None]
        rows = torch.tensor([r for r, _, _ in dec], device=device)
        groups.append(DecodeGroup(rows, torch.tensor(padded, device=device), mask))
        decodes = DecodeBatch(rows, torch.tensor(padded, dtype=torch.int32, device=device), lens.to(torch.int32))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        prefills=prefills,
        decode_groups=groups,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n for _, n in seqs], dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        block_size=bs,
        max_query_len=max(q for q, _ in seqs),
        max_seq_len=max(n for _, n in seqs),
        decodes=decodes,
    )
    TORCH_OPS.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta
