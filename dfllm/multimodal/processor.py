"""The input side: images of a prompt or conversation decoded, preprocessed by the model's own
transformers image processor, cached, and their placeholder tokens expanded.

:class:`ImageInputProcessor` belongs to an engine's input processor. ``process`` takes a
prompt's token ids (with one image token per image, as the chat template or the user wrote
it) and its images, and returns the token ids with each image token expanded to the model's
number of tokens per image (as transformers' processor does) and the request's
:class:`~dfllm.multimodal.inputs.MultiModalInputs`. Processed pixels are cached by image hash
and processor settings (``reset`` clears them, with ``LLM.reset_mm_cache``).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from dfllm.errors import InvalidRequestError
from dfllm.multimodal.image import ImageLoadError, image_hash, load_image
from dfllm.multimodal.inputs import ImageItem, MultiModalInputs

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")
DEFAULT_PROCESSED_CACHE_ITEMS = 1024


@dataclass(frozen=True)
class ImageTokens:
    """How a vision-language model's prompts hold images, as its class declares them
    (``image_tokens(spec, tokenizer)``): the placeholder token ``image_token_id`` and its text
    ``image_token``; ``tokens_per_image`` embeddings per image or, for processors that give each
    image's patch grid (Qwen2-VL's), ``t * h * w / merge**2``; ``mrope``: 3-D rotary positions;
    ``placeholder``: what a chat message's image part becomes in the text (default ``image_token``)."""

    image_token_id: int
    image_token: str
    tokens_per_image: int
    merge: int = 1
    mrope: bool = False
    placeholder: str | None = None


def load_image_processor(path: Path):
    """The model directory's transformers image processor, in its PIL/numpy form (no torchvision)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, backend="pil")
    except (TypeError, ValueError):  # transformers 4: the slow processor is use_fast=False
        return AutoImageProcessor.from_pretrained(path, use_fast=False)


def _settings_key(kwargs: dict) -> str:
    return json.dumps(kwargs, sort_keys=True, default=repr)


class ImageInputProcessor:
    """Images to :class:`MultiModalInputs` for one model (see the module's docstring), whose
    prompts hold images as ``tokens`` says. ``limit_per_prompt`` is vLLM's ``limit_mm_per_prompt``
    (``{"image": n}``; None: no limit) and ``processor_kwargs`` its ``mm_processor_kwargs``
    (passed to the image processor; a prompt's own override them)."""

    def __init__(
        self,
        path: Path,
        tokens: ImageTokens,
        *,
        limit_per_prompt: dict[str, int] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
        max_cached: int = DEFAULT_PROCESSED_CACHE_ITEMS,
    ):
        self.path = path
        self.image_token_id, self.image_token = tokens.image_token_id, tokens.image_token
        self.tokens_per_image, self.merge, self.mrope = tokens.tokens_per_image, tokens.merge, tokens.mrope
        self.placeholder = tokens.placeholder or tokens.image_token
        self.limit = check_limit_mm_per_prompt(limit_per_prompt)
        self.processor_kwargs = check_mm_processor_kwargs(processor_kwargs, "mm_processor_kwargs")
        self._image_processor: Any = None
        self.cache: OrderedDict[str, tuple[torch.Tensor, tuple[int, int, int] | None]] = OrderedDict()
        self.max_cached = max_cached
        self.images_processed = 0  # images run through the image processor (the rest came from the cache)

    @property
    def image_processor(self):
        if self._image_processor is None:
            self._image_processor = load_image_processor(self.path)
        return self._image_processor

    def reset(self) -> None:
        """Forget every processed image."""
        self.cache.clear()

    # ---- images from the caller's forms -------------------------------------------------
    def images_of_prompt(self, prompt: Any, what: str) -> tuple[list[Image.Image], dict]:
        """The images of a prompt dict's ``multi_modal_data`` and its ``mm_processor_kwargs``."""
        if not isinstance(prompt, dict):
            return [], {}
        kwargs = check_mm_processor_kwargs(prompt.get("mm_processor_kwargs"), f"{what}: mm_processor_kwargs")
        data = prompt.get("multi_modal_data")
        if data is None:
            return [], kwargs
        if not isinstance(data, dict):
            raise InvalidRequestError(
                f"{what}: multi_modal_data must be a dict such as {{'image': image}}, got {type(data).__name__}",
                parameter="multi_modal_data",
            )
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise InvalidRequestError(
                f"{what}: multi_modal_data: this model takes images only ('image'), got {unknown}",
                parameter="multi_modal_data",
            )
        value = data.get("image")
        values = [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
        return [self._load(v, f"{what}: multi_modal_data['image'][{i}]") for i, v in enumerate(values)], kwargs

    def images_of_conversation(self, conversation: list[dict], what: str) -> list[Image.Image]:
        """The images of a conversation's ``image_url`` / ``image_pil`` / ``image`` parts, in order."""
        images = []
        for j, msg in enumerate(conversation):
            content = msg.get("content")
            if not isinstance(content, list):
                continue
            for k, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                    images.append(self._load(image_part_value(part), f"{what}, message {j}, part {k}"))
        return images

    @staticmethod
    def _load(value: Any, what: str) -> Image.Image:
        try:
            return load_image(value)
        except ImageLoadError as exc:
            raise InvalidRequestError(f"{what}: {exc}", parameter="multi_modal_data") from None

    # ---- processing ----------------------------------------------------------------------
    def process(
        self, token_ids: list[int], images: list[Image.Image], what: str, kwargs: dict | None = None
    ) -> tuple[list[int], MultiModalInputs | None]:
        """``token_ids`` with each image token expanded, and the images as :class:`MultiModalInputs`
        (None without images). The prompt must hold one image token per image."""
        found = sum(1 for t in token_ids if t == self.image_token_id)
        limit = self.limit.get("image")
        if limit is not None and len(images) > limit:
            raise InvalidRequestError(
                f"{what}: {len(images)} images, more than limit_mm_per_prompt allows ({{'image': {limit}}})",
                parameter="multi_modal_data",
                value=len(images),
            )
        if found != len(images):
            raise InvalidRequestError(
                f"{what}: the prompt has {found} image placeholder token(s) ({self.image_token!r}, id "
                f"{self.image_token_id}) for {len(images)} image(s): put one {self.image_token!r} where each image "
                "goes (chat messages with image parts get them from the chat template)",
                parameter="prompt",
            )
        if not images:
            return token_ids, None
        settings = {**self.processor_kwargs, **(kwargs or {})}
        pixels = self._pixels(images, settings, what)
        out: list[int] = []
        items = []
        it = iter(pixels)
        for t in token_ids:
            if t != self.image_token_id:
                out.append(t)
                continue
            key, px, grid = next(it)
            n = self.tokens_per_image if grid is None else grid[0] * grid[1] * grid[2] // self.merge**2
            items.append(ImageItem(key, px, len(out), n, grid))
            out.extend([self.image_token_id] * n)
        mrope = mrope_positions(len(out), items, self.merge) if self.mrope else None
        return out, MultiModalInputs(tuple(items), *(mrope or (None, 0)))

    def _pixels(
        self, images: list[Image.Image], settings: dict, what: str
    ) -> list[tuple[str, torch.Tensor, tuple[int, int, int] | None]]:
        """``(key, pixel values, grid)`` of each image (the grid ``(t, h, w)`` in patches for
        processors that give one, Qwen2-VL's), processed once per image and settings."""
        skey = _settings_key(settings)
        keys = [hashlib.blake2b(f"{image_hash(im)}|{skey}".encode(), digest_size=20).hexdigest() for im in images]
        done = {k: self.cache[k] for k in keys if k in self.cache}
        todo = {k: im for k, im in zip(keys, images) if k not in done}  # the same image twice: processed once
        if todo:
            try:
                batch = self.image_processor(images=list(todo.values()), return_tensors="pt", **settings)
            except Exception as exc:  # a bad kwarg, an image the processor cannot take
                raise InvalidRequestError(
                    f"{what}: the image processor failed: {type(exc).__name__}: {exc}", parameter="mm_processor_kwargs"
                ) from None
            values, grids = batch["pixel_values"], batch.get("image_grid_thw")
            if values.dtype == torch.float64:
                values = values.float()
            per: list[tuple[Any, Any]]
            if grids is None:
                per = [(px, None) for px in values]
            else:
                sizes = [int(g.prod()) for g in grids]
                per = [(px, tuple(int(x) for x in g)) for px, g in zip(values.split(sizes), grids)]
            self.images_processed += len(todo)
            for k, value in zip(todo, per):
                done[k] = value
                self.cache[k] = value
                while len(self.cache) > self.max_cached:
                    self.cache.popitem(last=False)
        for k in keys:
            if k in self.cache:
                self.cache.move_to_end(k)
        return [(k, *done[k]) for k in keys]

    # ---- chat rendering ------------------------------------------------------------------
    def flatten_content(self, msg: dict, template: str | None) -> dict:
        """A message whose content has image parts, as the chat template takes it: a template
        that handles image parts itself (it mentions ``image``) gets Hugging Face's parts
        (``{"type": "image"}`` and ``{"type": "text", "text": ...}``); any other gets one string,
        each image's placeholder on its own line before the text (vLLM's "string" format)."""
        content = msg.get("content")
        if not isinstance(content, list):
            return msg
        if template is not None and "image" in template:
            parts = [
                {"type": "image"} if p.get("type") in IMAGE_PART_TYPES else {"type": "text", "text": p["text"]}
                for p in content
            ]
            return {**msg, "content": parts}
        placeholders = [self.placeholder for p in content if p.get("type") in IMAGE_PART_TYPES]
        texts = [p["text"] for p in content if p.get("type") == "text"]
        return {**msg, "content": "\n".join(placeholders + ["\n".join(texts)] if texts else placeholders)}


def image_part_value(part: dict) -> Any:
    """The image of a chat content part: ``image_url`` (``{"url": ...}`` or a str), ``image_pil``, ``image``."""
    kind = part["type"]
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    return value


def has_image_parts(conversation: list[dict]) -> bool:
    """Whether any message of a conversation has an image part."""
    return any(
        isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
        for m in conversation
        if isinstance(m.get("content"), list)
        for p in m["content"]
    )


def check_limit_mm_per_prompt(value: Any) -> dict[str, int]:
    """vLLM's ``limit_mm_per_prompt``: None or ``{"image": n}`` (n >= 0)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must be a dict such as {{'image': 4}}, got {value!r}")
    out = {}
    for k, v in value.items():
        n = v.get("count") if isinstance(v, dict) else v  # vLLM >= 0.11 also takes {"image": {"count": n}}
        if k not in ("image", "video", "audio") or isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"limit_mm_per_prompt: expected {{'image': n}} with an int n >= 0, got {value!r}")
        out[k] = n
    return out


def check_mm_processor_kwargs(value: Any, name: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"{name} must be a dict of image processor arguments, got {type(value).__name__}",
            parameter="mm_processor_kwargs",
        )
    return dict(value)


def image_input_processor(
    path: Path,
    tokens: ImageTokens | None,
    *,
    limit_per_prompt: dict | None = None,
    processor_kwargs: dict | None = None,
) -> ImageInputProcessor | None:
    """The image input processor of a model whose prompts hold images as ``tokens`` says (its
    class's ``image_tokens``); None for a text-only model (``tokens`` None)."""
    if tokens is None:
        if limit_per_prompt:
            check_limit_mm_per_prompt(limit_per_prompt)
        return None
    return ImageInputProcessor(path, tokens, limit_per_prompt=limit_per_prompt, processor_kwargs=processor_kwargs)


def mrope_positions(length: int, items: list[ImageItem], merge: int) -> tuple[torch.Tensor, int]:
    """Qwen2-VL's 3-D rotary positions of a prompt of ``length`` tokens (as transformers'
    ``get_rope_index``): text tokens count up on all three axes; an image's tokens take
    (start + frame, start + row, start + column) of its merged grid, and the text after it
    resumes at start + max(rows, columns). Returns ``(positions (3, length), delta)``, ``delta``
    being what generated tokens add to their index."""
    pos = torch.empty(3, length, dtype=torch.long)
    current, at = 0, 0
    for item in items:
        n = item.offset - at
        pos[:, at : item.offset] = torch.arange(current, current + n)
        current += n
        assert item.grid is not None
        t, h, w = item.grid[0], item.grid[1] // merge, item.grid[2] // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        pos[:, item.offset : item.end] = torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + current
        current += max(h, w)
        at = item.end
    pos[:, at:] = torch.arange(current, current + length - at)
    delta = int(pos.max()) + 1 - length
    return pos, delta
