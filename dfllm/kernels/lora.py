"""Many LoRA adapters in one batch: the per-token adapter slots of a step and the
segmented (SGMV-style) batched matmul that adds each token's adapter delta.

Every token row of a step carries a slot index (-1: the base model alone). A LoRA-adapted
projection ``y = W x`` holds the adapters of the ``max_loras`` slots stacked: ``a``
``[slots, R, in]`` and ``b`` ``[slots, out, R]`` (the scaling folded into ``b``; a slot's
rank is ``ranks[slot] <= R``, the rest zeros), and adds ``delta = (x @ a[s].T) @ b[s].T``
to each row of slot ``s``. As Punica's SGMV (and vLLM's punica kernels), the rows are
grouped by adapter once per step (:class:`LoRAMetadata`) and each group costs two small
matmuls, whatever the number of tokens of the other adapters:

- :func:`lora_reference`: the PyTorch reference (one adapter gathered per token);
- :func:`lora_apply` on CPU (and any device without Triton): per segment, a slice of the
  batch when the segment's rows are consecutive (a prefill chunk, or the decodes of one
  adapter placed together), else one gather and one ``index_add_``; each slot's own rank
  only;
- ``dfllm.kernels._triton_lora``: the Triton SGMV kernels (shrink then expand), one launch
  each over every segment.

A row-parallel projection (``o_proj``, ``down_proj`` under tensor parallelism) holds the
slice of ``a`` matching its slice of the input features: the partial shrinks are summed
over the ranks (``reduce``) before the expand, which every rank does in full.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dfllm.kernels.metadata import LoRAMetadata


def lora_metadata(token_slots: list[int], device: torch.device) -> LoRAMetadata | None:
    """The metadata of a step whose token row ``t`` runs adapter slot ``token_slots[t]``
    (-1: none); None when no row runs one."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    if not by_slot:
        return None
    seg_slots: list[int] = []
    bounds: list[tuple[int, int]] = []
    rows: list[torch.Tensor | None] = []
    starts: list[int] = []
    lens: list[int] = []
    flat: list[int] = []
    for slot in sorted(by_slot):
        r = by_slot[slot]
        seg_slots.append(slot)
        consecutive = r[-1] - r[0] + 1 == len(r)
        bounds.append((r[0], r[-1] + 1))
        rows.append(None if consecutive else _send(r, torch.long, device))
        starts.append(len(flat))
        lens.append(len(r))
        flat.extend(r)
    meta = LoRAMetadata(
        _send(token_slots, torch.long, device),
        seg_slots,
        bounds,
        rows,
        _send(flat, torch.long, device),
        _send(starts, torch.int32, device),
        _send(lens, torch.int32, device),
        _send(seg_slots, torch.int32, device),
        max(lens),
    )
    span, width = seg_slots[-1] + 1, max(lens)
    # many segments of few rows: two batched matmuls beat two per segment when padding wastes little
    if (
        len(seg_slots) >= BATCHED_MIN_SEGMENTS
        and width <= BATCHED_MAX_ROWS
        and span * width <= BATCHED_MAX_PADDING * len(flat)
    ):
        pad = torch.zeros(span, width, dtype=torch.long)
        valid = torch.zeros(span, width, 1, dtype=torch.bool)
        for slot, r in by_slot.items():
            pad[slot, : len(r)] = torch.tensor(r)
            valid[slot, : len(r)] = True
        meta.pad_rows, meta.pad_valid = pad.flatten().to(device, non_blocking=True), valid.to(device, non_blocking=True)
        meta.batched = True
        if flat == list(range(flat[0], flat[0] + len(flat))):  # sorted by slot and consecutive
            unpad = [slot * width + k for slot in seg_slots for k in range(len(by_slot[slot]))]
            meta.unpad, meta.adapted = (
                _send(unpad, torch.long, device),
                (flat[0], flat[0] + len(flat)),
            )
    return meta


def _send(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied without a stream synchronisation (from
    pageable memory the copy is staged before this returns, so the list may go)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


BATCHED_MIN_SEGMENTS = 3
BATCHED_MAX_PADDING = 2.0  # padded rows at most this many times the adapted rows
BATCHED_MAX_ROWS = 32  # longer segments (prefill chunks) multiply in place, one slice each: no copies


def lora_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """The delta of every row (zeros for slot -1), one adapter gathered per token: the
    definition the fast paths are tested against."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    rows = (token_slots >= 0).nonzero().flatten()
    if rows.numel():
        slots = token_slots[rows]
        s = torch.einsum("ti,tri->tr", x[rows].float(), a[slots].float())
        out[rows] = torch.einsum("tr,tor->to", s, b[slots].float())
    return out.to(x.dtype)


def lora_apply(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    meta: LoRAMetadata,
    ranks: list[int],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    triton: bool = False,
) -> torch.Tensor:
    """``y`` plus each adapted row's delta (in place when possible; returned). ``reduce``
    sums the shrink over the tensor-parallel ranks of a row-parallel projection; ``triton``
    runs the Triton kernels."""
    if triton:
        from dfllm.kernels._triton_lora import sgmv_expand, sgmv_shrink

        s = sgmv_shrink(x, a, meta)
        if reduce is not None:
            s = reduce(s)
        sgmv_expand(s, b, y, meta)
        return y
    if meta.batched:
        return _apply_batched(x, y, a, b, meta, ranks, reduce)
    if reduce is None:
        for slot, (lo, hi), rows in zip(meta.seg_slots, meta.seg_bounds, meta.seg_rows):
            r = ranks[slot]
            if r == 0:
                continue
            a_t, b_t = a[slot, :r].t(), b[slot, :, :r].t()
            if rows is None:
                y[lo:hi].addmm_(x[lo:hi] @ a_t, b_t)
            else:
                y.index_add_(0, rows, (x[rows] @ a_t) @ b_t)
        return y
    width = max(ranks[slot] for slot in meta.seg_slots)
    s = x.new_zeros(x.shape[0], width)
    for slot, (lo, hi), rows in zip(meta.seg_slots, meta.seg_bounds, meta.seg_rows):
        r = ranks[slot]
        if r:
            if rows is None:
                s[lo:hi, :r] = x[lo:hi] @ a[slot, :r].t()
            else:
                s[rows, :r] = x[rows] @ a[slot, :r].t()
    s = reduce(s)
    for slot, (lo, hi), rows in zip(meta.seg_slots, meta.seg_bounds, meta.seg_rows):
        r = ranks[slot]
        if r == 0:
            continue
        b_t = b[slot, :, :r].t()
        if rows is None:
            y[lo:hi].addmm_(s[lo:hi, :r], b_t)
        else:
            y.index_add_(0, rows, s[rows, :r] @ b_t)
    return y


def _apply_batched(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    meta: LoRAMetadata,
    ranks: list[int],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None,
) -> torch.Tensor:
    """The batched path: the adapted rows laid out ``[span, max_seg_len]`` by slot, one ``bmm``
    for every shrink and one for every expand (padding masked out), one ``index_add_``."""
    assert meta.pad_rows is not None and meta.pad_valid is not None
    span, width = meta.pad_valid.shape[0], meta.pad_valid.shape[1]
    r = max(ranks[slot] for slot in meta.seg_slots)
    xs = x.index_select(0, meta.pad_rows).view(span, width, x.shape[1])
    s = torch.bmm(xs, a[:span, :r].transpose(1, 2))
    if reduce is not None:
        s = reduce(s)
    d = torch.bmm(s, b[:span, :, :r].transpose(1, 2))
    if meta.unpad is None:  # padded rows are added too (to row 0): masked out (NaN * 0 is NaN: not a product)
        d = torch.where(meta.pad_valid, d, d.new_zeros(()))
        return y.index_add_(0, meta.pad_rows, d.view(span * width, -1))
    d = d.view(span * width, -1)
    lo, hi = meta.adapted  # the padded rows are never read back
    y[lo:hi] += d.index_select(0, meta.unpad)
    return y
