"""Settings of a process that hosts engines for Dask tasks, applied once, when its driver
thread starts (see :mod:`dfllm.worker.driver`): how many threads torch uses, glibc's
malloc thresholds, and the Dask worker's profiler.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 * 2**20
TRIM_THRESHOLD_BYTES = 256 * 2**20


def worker_thread_count() -> int | None:
    """Threads an engine should use here: ``DFLLM_NUM_THREADS``, or a Dask worker's threads
    capped at the machine's cores; None outside a worker."""
    override = os.environ.get("DFLLM_NUM_THREADS")
    if override:
        return int(override)
    try:
        from distributed import get_worker

        nthreads = get_worker().state.nthreads
    except (ImportError, ValueError, AttributeError):
        return None
    return max(1, min(nthreads, os.cpu_count() or 1))


def tune_worker_process() -> None:
    """Keep torch's buffers on the heap and stop the Dask profiler. The driver thread's
    start calls it, once per process, from the task thread that starts it (the profiler is
    found through the running task's worker)."""
    _keep_torch_buffers_on_the_heap()
    _stop_dask_profiler()


def _keep_torch_buffers_on_the_heap() -> None:
    """Undo, for this process, a side effect of Dask's ``MALLOC_TRIM_THRESHOLD_``.

    Dask starts workers with that glibc setting so they give memory back; but setting it
    also freezes glibc's mmap threshold at 128 KiB, so every activation buffer torch
    allocates is a fresh ``mmap`` whose pages fault in again on each step: the engine ran
    1.5x slower in a worker than in a plain process. Raising the mmap threshold keeps those
    buffers on the heap; raising the trim threshold (to 256 MiB) stops the heap's top from
    being handed back and faulted in again after every step (another ~10%). Free heap
    beyond 256 MiB is still returned, and the engine's memory stays flat across a job.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc
        pass


def _stop_dask_profiler() -> None:
    """Stop the Dask worker's statistical profiler in a process that hosts an engine.

    Every 10 ms it walks the stacks of the threads running tasks, under the GIL; here those
    threads only wait for the engine's driver thread, which loses the GIL to it between
    torch calls (4-8% of throughput measured). ``DFLLM_KEEP_DASK_PROFILER=1`` keeps it.
    """
    if os.environ.get("DFLLM_KEEP_DASK_PROFILER"):
        return
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        return
    for name in ("profile", "profile-cycle"):
        callback = worker.periodic_callbacks.pop(name, None)
        if callback is not None:
            worker.loop.add_callback(callback.stop)  # periodic callbacks belong to the event loop
