"""The engine's hot-path operations: paged attention, KV-cache writes, RMSNorm, rotary, SiLU-and-multiply.

Each operation has a PyTorch reference in ``<op>.py`` (``rms_norm.py`` holds
``rms_norm_torch``), and a Triton twin with the same signature and semantics in the sibling
module ``_triton_<op>.py`` (``_triton_rms_norm.py`` holds ``rms_norm_triton``). The Triton
modules are imported only by :func:`dfllm.kernels.backend.select_ops` when the Triton backend is
chosen, never by ``import dfllm``: on a CPU the backend first sets ``TRITON_INTERPRET=1``, which
must be in place before triton's kernels are defined, so that they run in Triton's interpreter.

On a CPU the hot ops also have compiled twins: ``_cpu.py`` wraps ``csrc/cpu_ops.cpp`` (decode
attention read straight from the paged cache, RMSNorm with its residual add, SiLU-and-multiply,
rotary), built on first use by torch's extension builder.

``select_ops("auto", device)`` picks Triton on CUDA and the compiled CPU kernels on a CPU (the
PyTorch references where those cannot be built); "torch", "cpu" and "triton" force one.
"""
