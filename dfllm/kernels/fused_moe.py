"""Mixture-of-experts feed-forward: top-k routing and the experts' SwiGLU MLPs (PyTorch reference).

Every expert ``e`` is a SwiGLU MLP with weights ``w13[e] = cat(gate, up)`` of shape
``(2 * I, H)`` and ``w2[e]`` of shape ``(H, I)``. A token goes through its ``top_k`` experts
and their outputs are summed, each scaled by the token's routing weight for that expert.

:func:`fused_moe_torch` groups the work by expert: the ``(token, slot)`` pairs are sorted by
expert id, each expert that any token chose runs one matmul over all of its tokens, the
scaled outputs go back to their pairs' rows and each token sums its ``top_k`` rows (no
per-token Python loop). The Triton twin, same signature and semantics, is in
``_triton_fused_moe.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids)``, each ``(tokens, top_k)``: the softmax (in float32) of the
    router logits, its ``top_k`` largest entries, renormalised to sum to one when ``renormalize``.

    The weights stay float32 (the experts' outputs are scaled in float32 too)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for every token row ``t``.

    ``x`` is ``(T, H)``; ``w13`` ``(E, 2 * I, H)`` holds each expert's gate then up
    projection; ``w2`` ``(E, H, I)`` its down projection; ``topk_weights`` and ``topk_ids``
    are ``(T, K)``. Returns ``(T, H)`` in ``x``'s dtype.
    """
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = order // top_k
    weights = topk_weights.reshape(-1)[order]
    # one row per (token, slot) pair: each is written once (no scatter-add, which PyTorch
    # parallelises badly on a busy CPU), then each token sums its top_k rows
    pair_out = x.new_empty(tokens * top_k, x.shape[-1])
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        stop = start + count
        gate, up = F.linear(x[rows[start:stop]], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        pair_out[order[start:stop]] = (y * weights[start:stop, None]).to(x.dtype)
        start = stop
    return pair_out.view(tokens, top_k, -1).sum(dim=1)
