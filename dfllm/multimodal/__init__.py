"""Multimodal inputs: image decoding, hashing, preprocessing and the processed-image cache."""

from dfllm.multimodal.image import ImageLoadError, image_hash, load_image

__all__ = ["load_image", "image_hash", "ImageLoadError"]
