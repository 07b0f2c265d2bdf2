"""Which layers of a decoder attend within a sliding window, and how wide it is."""

from __future__ import annotations

from typing import Literal

from dfllm.models.spec import ModelSpec

# the windows a decoder class honours (its ``window_support``): none, one on every layer, or each layer's own
WindowSupport = Literal["none", "uniform", "per_layer"]


def layer_windows(spec: ModelSpec) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers decides it.

    A config with ``layer_types`` (Gemma 2/3, Qwen2 with ``use_sliding_window``) windows the
    "sliding_attention" layers; one without (Mistral) windows every layer when it has a
    ``sliding_window``. A query at position ``p`` sees the keys at ``p - window < j <= p``.
    """
    n = spec.num_hidden_layers
    window = spec.sliding_window if spec.use_sliding_window else None
    if window is None:
        return (None,) * n
    if spec.layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in spec.layer_types[:n])
    return (window,) * n


def uniform_window(spec: ModelSpec) -> int | None:
    """The window of a model whose every layer is windowed alike (Mistral), else None."""
    windows = set(layer_windows(spec))
    return windows.pop() if len(windows) == 1 else None


def honours_windows(support: WindowSupport, spec: ModelSpec) -> bool:
    """Whether a decoder class declaring ``support`` (its ``window_support``) attends within
    the windows of ``spec``'s layers: every class when there are none; "per_layer" (Gemma) for
    any windows; "uniform" (Llama's forward, which hands the window to the kernels through the
    step's metadata) for one window on every layer (Mistral, Phi-3); "none" for no windows."""
    windows = set(layer_windows(spec))
    if windows <= {None} or support == "per_layer":
        return True
    return len(windows) == 1 and support == "uniform"
