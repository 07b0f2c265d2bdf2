"""The worker side: image embeddings computed once per image, cached, and gathered into a step.

:class:`EncoderCache` keeps each image's embeddings (keyed by :attr:`ImageItem.key`) up to a
byte budget, least recently used first out. A step's images that are not cached are encoded
together (one batch per pixel shape); an image whose placeholders a chunked prefill splits
over several steps is encoded once: its embeddings are pinned for the sequence until the step
that reaches its last placeholder, whatever the cache evicts meanwhile. A preempted request
recomputes from its prompt and finds its images cached (or pinned). ``reset`` clears it
(``LLM.reset_mm_cache``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from dfllm.multimodal.inputs import ImageItem

DEFAULT_CACHE_BYTES = 512 * 2**20
MAX_PINS = 4096  # images held for sequences mid-prefill (far more than any step has)


class EncoderCache:
    """Image embeddings by image key, least recently used evicted past ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.images_encoded = 0  # images run through the vision encoder (a counter, for tests and stats)
        self.hits = 0  # images whose embeddings came from the cache
        # (sequence id, image key) -> embeddings of an image a sequence has prefilled part of
        self.pins: dict[tuple[int, str], torch.Tensor] = {}

    def get(self, key: str) -> torch.Tensor | None:
        value = self.entries.get(key)
        if value is not None:
            self.entries.move_to_end(key)
            return value
        return next((v for (_, k), v in self.pins.items() if k == key), None)

    def hold(self, seq_id: int, key: str, value: torch.Tensor, partial: bool) -> None:
        """Pin an image's embeddings for a sequence that has prefilled only part of its
        placeholders (``partial``); unpin once it has all of them."""
        if partial:
            self.pins[(seq_id, key)] = value
            if len(self.pins) > MAX_PINS:  # a sequence aborted mid-image never unpins: drop the oldest
                self.pins.pop(next(iter(self.pins)))
        else:
            self.pins.pop((seq_id, key), None)

    def put(self, key: str, value: torch.Tensor) -> None:
        if key in self.entries:
            return
        self.entries[key] = value
        self.bytes += value.numel() * value.element_size()
        while self.bytes > self.max_bytes and self.entries:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def reset(self) -> None:
        self.entries.clear()
        self.pins.clear()
        self.bytes = 0


def step_image_embeds(
    model, sched, cache: EncoderCache, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows, embeddings)`` of the step's image placeholder tokens (rows of the flattened
    batch, as ``prepare_inputs`` lays it out); None when the step has none."""
    wanted: list[tuple[int, ImageItem, int, int, int]] = []  # (batch row, image, first, end placeholder, seq)
    row = 0
    for seq, n in zip(sched.seqs, sched.num_new_tokens):
        mm = seq.request.mm_inputs
        start = seq.num_computed_tokens
        if mm is not None and start < seq.num_prompt_tokens:
            for item in mm.overlapping(start, start + n):
                lo, hi = max(start, item.offset), min(start + n, item.end)
                wanted.append((row + lo - start, item, lo - item.offset, hi - item.offset, seq.seq_id))
        row += n
    if not wanted:
        return None
    feats: dict[str, torch.Tensor] = {}
    missing: dict[str, ImageItem] = {}
    for _, item, _, _, _ in wanted:
        if item.key in feats or item.key in missing:
            continue
        cached = cache.get(item.key)
        if cached is not None:
            feats[item.key] = cached
            cache.hits += 1
        else:
            missing[item.key] = item
    for items, out in _encode(model, list(missing.values()), device):
        cache.images_encoded += len(items)
        for it, value in zip(items, out):
            if value.shape[0] != it.length:
                raise ValueError(
                    f"image {it.key[:12]}: the model gives {value.shape[0]} embeddings, the prompt has "
                    f"{it.length} placeholder tokens for it"
                )
            feats[it.key] = value
            cache.put(it.key, value)
    for _, item, _, hi, seq_id in wanted:
        cache.hold(seq_id, item.key, feats[item.key], partial=hi < item.length)
    rows = torch.cat([torch.arange(r, r + hi - lo) for r, _, lo, hi, _ in wanted]).to(device)
    values = torch.cat([feats[item.key][lo:hi] for _, item, lo, hi, _ in wanted])
    return rows, values


def _encode(model, items: list[ImageItem], device: torch.device):
    """``(images, their embeddings)`` batches: fixed-size images stacked per pixel shape
    (``model.encode_images``); images with a patch grid (Qwen2-VL) all in one batch
    (``model.encode_image_items``)."""
    if not items:
        return
    if hasattr(model, "encode_image_items"):
        yield items, model.encode_image_items(items, device)
        return
    by_shape: dict[tuple[int, ...], list[ImageItem]] = {}
    for item in items:
        by_shape.setdefault(tuple(item.pixel_values.shape), []).append(item)
    for group in by_shape.values():
        yield group, model.encode_images(torch.stack([it.pixel_values for it in group]).to(device))


def step_mrope_positions(sched, device: torch.device) -> torch.Tensor | None:
    """The step's 3-D rotary positions ``(3, tokens)`` (Qwen2-VL), laid out as ``prepare_inputs``
    lays out the tokens; None when no sequence of the step has images (1-D positions are then
    the same on all three axes)."""
    if not any(s.request.mm_inputs is not None and s.request.mm_inputs.mrope_positions is not None for s in sched.seqs):
        return None
    parts = []
    for seq, n in zip(sched.seqs, sched.num_new_tokens):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        mm = seq.request.mm_inputs
        if mm is None or mm.mrope_positions is None:
            parts.append(torch.arange(start, end).expand(3, -1))
            continue
        table, prompt = mm.mrope_positions, mm.mrope_positions.shape[1]
        head = table[:, start : min(end, prompt)]
        tail = torch.arange(max(start, prompt), max(end, prompt)) + mm.mrope_delta
        parts.append(torch.cat([head, tail.expand(3, -1)], dim=1))
    return torch.cat(parts, dim=1).to(device)


def step_mm_kwargs(model, sched, cache: EncoderCache, device: torch.device) -> dict:
    """What a vision-language model's ``forward`` takes besides the tokens this step:
    ``mm_embeds`` (see :func:`step_image_embeds`) and, for Qwen2-VL, ``mrope_positions``;
    empty when the step needs neither."""
    out: dict = {}
    mm = step_image_embeds(model, sched, cache, device)
    if mm is not None:
        out["mm_embeds"] = mm
    if getattr(model, "uses_mrope", False):
        pos = step_mrope_positions(sched, device)
        if pos is not None:
            out["mrope_positions"] = pos
    return out


def move_mm(mm: dict, device: torch.device) -> dict:
    """:func:`step_mm_kwargs`'s result with its tensors on ``device``."""
    out: dict = {}
    for key, value in mm.items():
        out[key] = tuple(v.to(device) for v in value) if isinstance(value, tuple) else value.to(device)
    return out


def embed_with_images(
    embed, input_ids: torch.Tensor, image_token_id: int, mm_embeds: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Token embeddings with the image placeholder rows replaced by the images' embeddings."""
    x = embed(torch.where(input_ids == image_token_id, 0, input_ids))  # those rows are overwritten
    rows, values = mm_embeds
    return x.index_copy(0, rows, values.to(x.dtype))
