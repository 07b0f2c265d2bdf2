"""Which layers of a decoder attend within a sliding window, and how wide it is."""

from __future__ import annotations

from dfllm.models.spec import ModelSpec


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


def honours_windows(cls: type, spec: ModelSpec) -> bool:
    """Whether the decoder class ``cls`` attends within the windows of ``spec``'s layers: every
    class when there are none; a class that passes each layer's own window to the kernel
    (``per_layer_windows``, Gemma); and, for one window on every layer (Mistral, Phi-3), a class
    running :class:`~dfllm.models.llama.LlamaForCausalLM`'s ``forward``, which hands it to the
    kernels through the step's metadata."""
    from dfllm.models.llama import LlamaForCausalLM

    windows = set(layer_windows(spec))
    if windows <= {None} or getattr(cls, "per_layer_windows", False):
        return True
    return len(windows) == 1 and getattr(cls, "forward", None) is LlamaForCausalLM.forward
