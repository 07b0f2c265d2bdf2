"""The images of one request as the engine sees them: processed pixels and where their
placeholder tokens sit in the prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ImageItem:
    """One image of a prompt: ``key`` identifies its processed pixels (a hash of the image's
    pixels and of the processor settings), ``pixel_values`` is ``(channels, height, width)``
    (or Qwen2-VL's ``(patches, patch values)`` with its ``grid``),
    and its ``length`` placeholder tokens start at prompt position ``offset``."""

    key: str
    pixel_values: torch.Tensor
    offset: int
    length: int
    grid: tuple[int, int, int] | None = None  # (frames, rows, columns) in patches (Qwen2-VL; None: fixed-size)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def key_int(self) -> int:
        """``key`` as a negative int (never a token id): what prefix-cache block keys carry."""
        return -1 - int(self.key[:15], 16)


@dataclass(frozen=True, eq=False)
class MultiModalInputs:
    """A request's images, in prompt order."""

    images: tuple[ImageItem, ...]
    # Qwen2-VL: the prompt's 3-D rotary positions (3, prompt length) and what later tokens add to
    # their index (None and 0 elsewhere)
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(item.key for item in self.images)

    def overlapping(self, start: int, end: int) -> list[ImageItem]:
        """The images with a placeholder token in prompt positions ``[start, end)``."""
        return [item for item in self.images if item.offset < end and start < item.end]

    def block_key(self, index: int, block_size: int) -> tuple[int, ...]:
        """What block ``index`` of the prompt adds to its token ids in the prefix cache's keys:
        the key of each image whose placeholders it holds (nothing for a text-only block)."""
        start = index * block_size
        return tuple(item.key_int for item in self.overlapping(start, start + block_size))


def block_tokens(token_ids: list[int], mm: MultiModalInputs | None, index: int, block_size: int) -> tuple[int, ...]:
    """The prefix-cache key of full block ``index``: its token ids, then the keys of the images
    whose placeholders it holds (so the same text with another image never shares the block)."""
    tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
    return tokens if mm is None else tokens + mm.block_key(index, block_size)
