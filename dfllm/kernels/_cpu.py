"""dfllm's compiled CPU kernels: the CPU twins of the PyTorch references.

The C++ source, ``csrc/cpu_ops.cpp``, is built on first use by torch's extension builder
(``torch.utils.cpp_extension.load``: a C++ compiler and ``ninja``) into torch's extension
cache (``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``), once per machine, source
content, torch version and flags (every install of the same dfllm shares it), saying so
first; later processes (each Dask worker) load the built library in well under a second.
Without a compiler the build fails once, is logged, and the engine keeps the PyTorch
references (:func:`load` returns None).

* :func:`paged_attention_cpu`: every decode of the step in one call that reads its keys and
  values straight from the paged cache through its block table, instead of gathering them
  into a padded tensor; every prefill span of the step in one more call (head sizes
  32/64/128; others take SDPA per span, as the reference), causal over the cache too, in
  tiles of up to 64 query rows, and no Python per span: with AVX-512 intrinsics 2.3-2.6x
  faster than SDPA per span on SmolLM2's prefill steps; elsewhere (AVX2) in loops the
  compiler vectorises, 3.4x on an AVX2 EPYC. A bfloat16 cache under float32 queries
  (``kv_cache_dtype="bfloat16"``) is widened on load. bfloat16 queries over a bfloat16 cache
  take their decode scores from AVX512-BF16 dot products (``vdpbf16ps``, checked at run time:
  the library is built for plain AVX-512) instead of widening every key (1.4x on the kernel
  alone with the cache in L2; out of cache it is bound by memory either way).
* :func:`encoder_attention_cpu`: the encoders' (BERT's) bidirectional attention over
  unpadded sequences, reading queries, keys and values in place from the fused projection's
  output by the sequences' offsets, for head sizes 32/64/128 on every build (GCC vector types,
  no intrinsics); each sequence's head copies its keys and values into contiguous buffers
  first, then its queries go in lane-transposed tiles of 16 (as the prefill kernel's). On
  MiniLM's head-32 shapes it measured 1.3x padded SDPA on one thread and 1.3-1.9x on two.
* Every kernel converts bfloat16 with its own integer code, which the compiler vectorises
  (c10's conversions are scalar calls: SiLU-and-multiply was 15x slower in bfloat16 than in
  float32 on them); it rounds as c10 does, to nearest even.
* :func:`rms_norm_cpu`, :func:`silu_and_mul_cpu`, :func:`rotary_cpu`,
  :func:`write_kv_cache_cpu`: one pass over memory each, instead of PyTorch's several
  element-wise kernels and temporaries (and, for the cache write, a host sync to check for
  padding slots).
* :func:`argmax_rows_cpu`: greedy sampling's argmax over ``[rows, vocab]`` float32 logits,
  vectorised (torch's CPU argmax tracks its index scalar by scalar: 12x slower at SmolLM2's
  49,152-token vocabulary); the same indices as ``torch.argmax``, ties and NaN included, or
  on request -1 for a row whose maximum is not finite (the sampler's check, in the same pass).
* :func:`exact_top_logits_cpu`: a bfloat16 (float16) LM head's logits widened to float32, the
  few that could be their row's maximum recomputed in float32 (``dfllm.kernels.logits``).

They agree with the references up to float rounding (the order of a few reductions differs),
which the tests check; greedy fidelity against transformers is measured by log-probabilities.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

from dfllm.kernels.activation import silu_and_mul_torch
from dfllm.kernels.argmax import argmax_rows_torch
from dfllm.kernels.encoder_attention import encoder_attention_torch
from dfllm.kernels.kv_cache import write_kv_cache_torch
from dfllm.kernels.logits import MARGIN, exact_top_logits_torch
from dfllm.kernels.metadata import AttentionMetadata, DecodeBatch
from dfllm.kernels.paged_attention import attend_prefills, paged_attention_torch
from dfllm.kernels.rms_norm import rms_norm_torch
from dfllm.kernels.rotary import rotary_torch

logger = logging.getLogger("dfllm")

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# head sizes of the prefill kernel (other prefills take SDPA, as the reference)
PREFILL_HEAD_DIMS = (32, 64, 128)
# head sizes of the encoders' attention kernel (every build; others take the reference)
ENCODER_HEAD_DIMS = (32, 64, 128)
STALE_LOCK_S = 900.0  # a build takes about a minute; a lock this old belongs to a killed process

# -fno-trapping-math lets loops that round (exp's range reduction) vectorise; neither flag
# changes a result (no floating-point exception or errno is ever read)
CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
# vector flags per CPU capability torch detected (not -march=native: the built library is
# cached per user, and a home directory may be shared by machines of different generations)
_ARCH_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


def build_name(capability: str, flags: list[str]) -> str:
    """The build's name: the CPU capability and a hash of what the library is built from (the
    source's content, torch's version, the flags), not of where the source lies, so that two
    installs of the same dfllm on one machine (two clones, two virtual environments) share
    one build, and a changed source or torch gets a build of its own."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"\0{torch.__version__}\0{' '.join(flags)}".encode())
    return f"dfllm_cpu_ops_{capability}_{h.hexdigest()[:12]}"


@functools.cache
def load() -> ModuleType | None:
    """The built extension, building it on first use (saying so, with where it is cached);
    None (and one warning) if it cannot be."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    arch = next((flags for tag, flags in _ARCH_FLAGS.items() if capability.startswith(tag)), [])
    name = build_name(capability, [*CFLAGS, *arch])
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        _clear_stale_lock(build_dir)
        if (build_dir / f"{name}.so").exists() and not (build_dir / "lock").exists():
            # built from this very source, torch and flags: loaded as it is (torch's builder would
            # rebuild it for another virtual environment, whose include paths differ)
            return cpp_extension._import_module_from_library(name, str(build_dir), True)
        source = _build_source(build_dir)
        logger.warning(
            "compiling dfllm's CPU kernels once for this machine (about a minute on 2 cores); cached in %s", build_dir
        )
        module = cpp_extension.load(
            name=name, sources=[str(source)], extra_cflags=[*CFLAGS, *arch], extra_ldflags=["-fopenmp"], verbose=False
        )
    except Exception as exc:  # no compiler, no ninja, a build error: keep the references
        logger.warning(
            "dfllm's CPU kernels could not be built (%s: %s); using the PyTorch references",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1:] or "",
        )
        return None
    took = time.perf_counter() - start
    if took > 2:
        logger.info("built dfllm's CPU kernels (%s) in %.0f s", name, took)
    return module


def _build_source(build_dir: Path) -> Path:
    """The source, copied into the build folder: the build then names the same path from every
    install, so torch's builder (which records the source's path) does not rebuild on a switch."""
    target = build_dir / SOURCE.name
    data = SOURCE.read_bytes()
    if not target.exists() or target.read_bytes() != data:
        tmp = build_dir / f".{SOURCE.name}.{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return target


def _clear_stale_lock(build_dir: Path, older_than_s: float = STALE_LOCK_S) -> None:
    """Remove the build lock a process killed while building left behind (torch's builder
    would otherwise wait for it forever); a live build refreshes nothing, but none takes
    anywhere near ``older_than_s``."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > older_than_s:
        logger.warning("removing a stale build lock of dfllm's CPU kernels (%s, %.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


def available() -> bool:
    """Whether the CPU kernels are built (building them now if needed)."""
    return load() is not None


def loaded() -> bool:
    """Whether this process has already loaded the CPU kernels (never starts a build)."""
    return load.cache_info().currsize > 0 and load() is not None


def _cache_types_ok(x: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether the kernels take queries (or new keys) ``x`` over ``cache``: the same dtype, or
    a bfloat16 cache under float32 (``kv_cache_dtype="bfloat16"``)."""
    mixed = x.dtype == torch.float32 and cache.dtype == torch.bfloat16
    return x.dtype in DTYPES and (cache.dtype == x.dtype or mixed)


def paged_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`~dfllm.kernels.paged_attention.paged_attention_torch`, with the step's decodes
    attended by the C++ kernel straight from the paged cache."""
    decodes = meta.decodes
    if (decodes is None and not meta.prefills) or not _cache_types_ok(q, k_cache):
        return paged_attention_torch(q, k, v, k_cache, v_cache, meta, scale, sliding_window, softcap)
    ext = load()
    assert ext is not None  # select_ops picks these kernels only once they are built
    window = sliding_window if sliding_window is not None else meta.sliding_window
    q = q if q.stride(1) == q.shape[2] and q.stride(2) == 1 else q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if decodes is not None:
        ext.decode_attention(
            out,
            q,
            k_cache,
            v_cache,
            decodes.rows,
            decodes.block_tables,
            decodes.seq_lens,
            float(scale),
            int(window or 0),
            float(softcap or 0.0),
        )
    if not meta.prefills:
        return out
    if (
        softcap is None
        and q.shape[2] in PREFILL_HEAD_DIMS
        and q.shape[1] // k_cache.shape[2] <= 64
        and hasattr(ext, "prefill_attention")
    ):
        ext.prefill_attention(
            out,
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            float(scale),
            int(window or 0),
        )
    else:
        attend_prefills(out, q, k, v, k_cache, v_cache, meta, scale, window, softcap)
    return out


def rms_norm_cpu(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`~dfllm.kernels.rms_norm.rms_norm_torch` in one pass (the residual add fused)."""
    if (
        x.dtype not in DTYPES
        or weight.dtype != x.dtype
        or x.stride(-1) != 1
        or (residual is not None and (residual.dtype != x.dtype or residual.stride(-1) != 1))
    ):
        return rms_norm_torch(x, weight, eps, residual)
    ext = load()
    assert ext is not None
    if x.dim() == 2:  # hidden states (no reshaping: a view costs more than the kernel at decode sizes)
        outs = ext.rms_norm(x, weight, float(eps), residual)
        return outs[0] if residual is None else (outs[0], outs[1])
    shape = x.shape
    outs = ext.rms_norm(
        x.reshape(-1, shape[-1]), weight, float(eps), None if residual is None else residual.reshape(-1, shape[-1])
    )
    if residual is None:
        return outs[0].view(shape)
    return outs[0].view(shape), outs[1].view(shape)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """:func:`~dfllm.kernels.activation.silu_and_mul_torch` in one pass."""
    if x.dtype not in DTYPES or x.stride(-1) != 1:
        return silu_and_mul_torch(x)
    ext = load()
    assert ext is not None
    if x.dim() == 2:
        return ext.silu_and_mul(x)
    shape = x.shape
    return ext.silu_and_mul(x.reshape(-1, shape[-1])).view(*shape[:-1], shape[-1] // 2)


def rotary_cpu(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~dfllm.kernels.rotary.rotary_torch` in one pass per tensor."""
    if q.dtype not in DTYPES or cos.dtype != torch.float32 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return rotary_torch(q, k, cos, sin)
    ext = load()
    assert ext is not None
    q, k = ext.rotary_qk(q, k, cos, sin)
    return q, k


def write_kv_cache_cpu(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """:func:`~dfllm.kernels.kv_cache.write_kv_cache_torch` in one pass, slots of -1 skipped
    without a check on the host first."""
    if (
        not _cache_types_ok(key, k_cache)
        or slot_mapping.dtype != torch.int64
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or not k_cache.is_contiguous()
        or not v_cache.is_contiguous()
    ):
        write_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping)
        return
    ext = load()
    assert ext is not None
    ext.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def argmax_rows_cpu(x: torch.Tensor, code_non_finite: bool = False) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D ``x``, through the vectorised kernel where it applies
    (float32 on the CPU, contiguous rows, the kernels already loaded in this process); with
    ``code_non_finite``, :data:`~dfllm.kernels.argmax.NON_FINITE_ID` for a row whose ``amax`` is
    not finite (NaN, +inf or -inf), found in the same pass there."""
    if (
        x.device.type != "cpu"
        or x.dtype != torch.float32
        or x.dim() != 2
        or x.shape[1] == 0
        or x.stride(1) != 1
        or not loaded()
    ):
        return argmax_rows_torch(x, code_non_finite)
    ext = load()
    assert ext is not None
    return ext.argmax_rows(x, code_non_finite)


def encoder_attention_cpu(qkv: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int) -> torch.Tensor:
    """:func:`~dfllm.kernels.encoder_attention.encoder_attention_torch` by the C++ kernel
    (float32 CPU tensors, head sizes :data:`ENCODER_HEAD_DIMS`, contiguous rows; otherwise the
    reference): no padding, and queries, keys and values read in place from the fused ``qkv``."""
    ext = load()
    if (
        ext is None
        or qkv.device.type != "cpu"
        or qkv.dtype != torch.float32
        or qkv.dim() != 2
        or qkv.stride(1) != 1
        or qkv.shape[1] // (3 * num_heads) not in ENCODER_HEAD_DIMS
        or qkv.shape[1] % (3 * num_heads)
    ):
        return encoder_attention_torch(qkv, cu_seqlens, num_heads)
    return ext.encoder_attention(qkv, cu_seqlens, num_heads, (qkv.shape[1] // (3 * num_heads)) ** -0.5)


def encoder_attention_count() -> int:
    """How many times the C++ encoder attention kernel ran in this process (0 when not built)."""
    ext = load() if loaded() else None
    return 0 if ext is None else int(ext.encoder_attention_count())


def exact_top_logits_cpu(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`~dfllm.kernels.logits.exact_top_logits_torch` in the pass that widens the logits."""
    if (
        logits.dtype not in MARGIN
        or not (logits.dtype == hidden.dtype == weight.dtype)
        or logits.dim() != 2
        or any(t.stride(-1) != 1 for t in (logits, hidden, weight))
        or not loaded()
    ):
        return exact_top_logits_torch(logits, hidden, weight)
    ext = load()
    assert ext is not None
    return ext.exact_top_logits(logits, hidden, weight, MARGIN[logits.dtype])


def bf16_gemm_ready() -> bool:
    """Whether :func:`bf16_gemm_cpu` runs in this process: the kernels build (building them now
    if needed) and the CPU has AVX512-BF16's dot product."""
    ext = load()
    return ext is not None and bool(ext.bf16_gemm_available())


def bf16_gemm_pack_cpu(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[n, k]`` (bfloat16) laid out for :func:`bf16_gemm_cpu` (an opaque copy)."""
    ext = load()
    assert ext is not None and weight.dtype == torch.bfloat16
    with torch.no_grad():
        return ext.bf16_gemm_pack(weight.detach())


def decode_layers_cpu(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    qk_norms: list[torch.Tensor],
    caches: list[torch.Tensor],
    *,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    decodes: DecodeBatch,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    eps: float,
    qk_eps: float,
    scale: float,
    onednn: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-family decoder layers over a decode-only step, in one call: ``x`` ``[tokens, hidden]``
    the first layer's input; per layer six ``weights`` (input norm, qkv, o, post-attention norm,
    gate_up, down; the linears packed for one GEMM: as :func:`bf16_gemm_pack_cpu` laid them out,
    or with ``onednn`` as ``torch.ops.mkldnn._reorder_linear_weight`` did), four
    ``biases`` (the linears', None where one has none), none or two ``qk_norms`` (Qwen3's q_norm
    and k_norm weights, epsilon ``qk_eps``) and two ``caches`` (keys, values); ``cos``/``sin``
    the tokens' rotary tables, ``slots`` their cache slots, ``decodes`` the step's decode batch. The kernels and
    their order are the modules' (:class:`~dfllm.models.llama.DecoderLayer`), so are the
    results. Returns the last layer's output and residual."""
    ext = load()
    assert ext is not None
    x, residual = ext.decode_layers(
        x,
        weights,
        biases,
        qk_norms,
        caches,
        cos,
        sin,
        slots,
        decodes.rows,
        decodes.block_tables,
        decodes.seq_lens,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        float(eps),
        float(qk_eps),
        float(scale),
        onednn,
    )
    return x, residual


def bf16_gemm_cpu(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """:func:`~dfllm.kernels.gemm.bf16_linear_torch` of ``x`` ``[..., k]`` (bfloat16) and the weight
    that :func:`bf16_gemm_pack_cpu` laid out as ``packed``: ``[..., out_features]``, bfloat16."""
    ext = load()
    assert ext is not None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[1] % 2:  # the layout pairs k's elements: a zero column pairs the last one
        rows = torch.nn.functional.pad(rows, (0, 1))
    y = ext.bf16_gemm(rows, packed, bias, out_features)
    return y.view(*x.shape[:-1], out_features)
