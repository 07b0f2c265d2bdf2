"""The Dask cluster a job runs on: an existing scheduler, a local CPU cluster, or one worker per GPU.

dfllm keeps one engine per worker process (see :mod:`dfllm.worker.engine_cache`), so a
worker's threads are not compute parallelism but the number of partitions feeding its
engine at once; torch inside the worker uses the worker's cores. On CPU one worker is
the right default: two engines on the same cores only compete. With ``gpu=True`` each
worker owns ``gpus_per_engine`` GPUs (``CUDA_VISIBLE_DEVICES``) and declares them as the
Dask resource ``GPU``, as ``dask-cuda``'s ``LocalCUDACluster`` does; tasks then ask for
``GPU: gpus_per_engine / threads`` so that ``threads`` partitions share each engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from distributed import Client, LocalCluster, Nanny, Scheduler, SpecCluster

DEFAULT_THREADS = 4


def task_resources(gpus_per_engine: int, threads: int) -> dict:
    """The resources one partition task asks for so that ``threads`` tasks share a GPU worker."""
    return {"GPU": gpus_per_engine / max(1, threads)}


def gpu_worker_specs(num_gpus: int, gpus_per_engine: int, threads: int) -> dict:
    """``SpecCluster`` worker specs: one nanny per group of ``gpus_per_engine`` GPUs."""
    specs = {}
    for w in range(num_gpus // gpus_per_engine):
        devices = ",".join(str(d) for d in range(w * gpus_per_engine, (w + 1) * gpus_per_engine))
        specs[f"gpu-{w}"] = {
            "cls": Nanny,
            "options": {
                "nthreads": threads,
                "resources": {"GPU": gpus_per_engine},
                "env": {"CUDA_VISIBLE_DEVICES": devices},
            },
        }
    return specs


@contextlib.contextmanager
def connect(
    scheduler: str | None = None,
    *,
    workers: int | None = None,
    threads: int | None = None,
    gpu: bool = False,
    gpus_per_engine: int = 1,
    dashboard: str = ":8787",
) -> Iterator[tuple[Client, dict | None]]:
    """A distributed ``Client`` for the job and the resources its tasks should ask for.

    ``scheduler``: the address of a running cluster (``tcp://host:8786``). Otherwise a
    cluster is started for the job and closed after it: with ``gpu``, one worker per
    ``gpus_per_engine`` visible GPUs; else ``workers`` (default 1) CPU worker processes.
    ``threads`` (default 4) is the number of partitions each worker runs at once.
    Either way the scheduler gets dfllm's dashboard page (:func:`install_dashboard`).
    """
    logging.getLogger("distributed").setLevel(logging.ERROR)
    threads = threads or DEFAULT_THREADS
    if threads < 1 or (workers is not None and workers < 1):
        raise ValueError("--workers and --threads must be >= 1")
    if scheduler:
        client = _client_for(scheduler)
        with client:
            resources = _remote_resources(client, gpu, gpus_per_engine)
            install_dashboard(client)
            yield client, resources
        return
    if gpu:
        import torch

        found = torch.cuda.device_count()
        if found < gpus_per_engine:
            raise ValueError(f"--gpu: {found} CUDA GPU(s) visible, need {gpus_per_engine} per engine")
        cluster = SpecCluster(
            scheduler={"cls": Scheduler, "options": {"dashboard_address": dashboard}},
            workers=gpu_worker_specs(found, gpus_per_engine, threads),
            silence_logs=logging.ERROR,
        )
        task_res = task_resources(gpus_per_engine, threads)
    else:
        from dfllm.kernels.backend import build_cpu_kernels

        build_cpu_kernels()  # compiled here, once, saying so, rather than silently on the workers (they load the build)
        n = workers or 1  # engines on one machine split its cores instead of each taking them all
        cluster = LocalCluster(
            n_workers=n,
            threads_per_worker=threads,
            processes=True,
            dashboard_address=dashboard,
            silence_logs=logging.ERROR,
            env={"DFLLM_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))},
        )
        task_res = None
    with cluster, Client(cluster) as client:
        install_dashboard(client)
        yield client, task_res


def install_dashboard(client) -> str | None:
    """Load dfllm's dashboard page on the client's scheduler (see :mod:`dfllm.dashboard`);
    its URL, or None (no Bokeh dashboard there, or the scheduler cannot load dfllm)."""
    from dfllm.dashboard import install

    return install(client)


def _client_for(address: str):
    try:
        return Client(address, timeout=float(os.environ.get("DFLLM_CONNECT_TIMEOUT", "15")))
    except (OSError, TimeoutError) as exc:
        raise ValueError(f"cannot reach the Dask scheduler at {address}: {exc}") from None


def _remote_resources(client, gpu: bool, gpus_per_engine: int) -> dict | None:
    """On an existing cluster with ``--gpu``: share each GPU worker among its threads."""
    if not gpu:
        return None
    workers = client.scheduler_info(n_workers=-1)["workers"].values()
    gpu_workers = [w for w in workers if w.get("resources", {}).get("GPU", 0) >= gpus_per_engine]
    if not gpu_workers:
        raise ValueError(
            f"--gpu: no worker of the cluster declares the resource GPU >= {gpus_per_engine} "
            "(start workers with --resources GPU=N)"
        )
    return task_resources(gpus_per_engine, min(w["nthreads"] for w in gpu_workers))
