"""The engine's hot-path operations: paged attention, KV-cache writes, RMSNorm, rotary, SiLU-and-multiply.

Each operation has a PyTorch reference, the CPU path, in ``<op>.py`` (``rms_norm.py`` holds
``rms_norm_torch``), and a Triton twin with the same signature and semantics in the sibling
module ``_triton_<op>.py`` (``_triton_rms_norm.py`` holds ``rms_norm_triton``). The Triton
modules are imported only by :func:`dfllm.kernels.backend.select_ops` when the Triton backend is
chosen, never by ``import dfllm``: on a CPU the backend first sets ``TRITON_INTERPRET=1``, which
must be in place before triton's kernels are defined, so that they run in Triton's interpreter.

``select_ops("auto", device)`` picks Triton on CUDA and PyTorch on a CPU; "torch" and "triton"
force one.
"""
