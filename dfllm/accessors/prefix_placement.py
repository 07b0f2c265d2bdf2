"""Prefix-aware placement: a job's rows that share a prompt prefix go to one engine.

Dask places a job's partitions on workers with no regard to what their prompts share, so a
document whose questions sit in four partitions would have its prefix computed by every
engine that got one of them. With placement on (the default for a Dask ``.llm`` call of a
generative task, and so for ``dfllm run``), each ``llm-<kind>`` partition task, on a
distributed cluster of two engines or more:

1. **keys** its rows: renders and tokenizes them with its worker's engine for the task and
   hashes each prompt's full blocks with the engine's own prefix-cache hash chain
   (:func:`dfllm.tasks.prefix_keys.prefix_keys`; per model, LoRA adapter and images). This
   runs on the workers, one partition at a time, never on the client (a task on a worker
   without the job's ``resources`` keys its rows on one that has them);
2. **places** them: under a Dask ``Lock``, reads the job's :class:`PrefixDirectory` from
   the scheduler's metadata (plain JSON, never pickled; a job's directory is dropped after
   :data:`STALE_S` without a partition), places the rows (each with its prefix group's engine, within
   the balance bound; see :mod:`dfllm.accessors.prefix_directory`) and writes it back;
3. **shuffles** them: the rows bound for each engine go there as a Dask task of their own
   (``llm-<kind>-routed-*``, restricted to that worker, with the job's resources), which
   runs the ordinary :func:`dfllm.tasks.runners.run_task`; the partition task waits for
   them without holding a thread (``worker_client`` secedes), then puts its rows back in
   their order. A routed task whose worker left the cluster, before it ran or holding its
   finished rows, is sent again to a live one.

So the result has the input's partitions and row order, and each row the output it gets
unrouted (a row's output does not depend on the rows batched with it); resumable writes
(:func:`dfllm.write_parquet`), budgets and ``resources=`` are unchanged: placement is inside
the partition's task. The cost is a second tokenization of each row (keying, then running)
and moving rows to their engines and back.

**The switch** is Dask's configuration key ``dfllm.prefix-placement`` (True by default;
``dask.config.set({"dfllm.prefix-placement": False})``, or the environment variable
``DASK_DFLLM__PREFIX_PLACEMENT=false``, or ``dfllm run --no-prefix-placement``), read when
the ``.llm`` call is made. ``dfllm.prefix-placement-balance`` (0.2) is the bound above the
mean work per engine.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dfllm.accessors.prefix_directory import PlacementSettings, PrefixDirectory
from dfllm.engine_args import DEFAULTS

logger = logging.getLogger("dfllm.prefix_placement")

CONFIG_KEY = "dfllm.prefix-placement"
BALANCE_KEY = "dfllm.prefix-placement-balance"
LIVENESS_CHECK_S = 2.0  # how often a partition task checks that its routed tasks' workers are alive
METADATA_ROOT = "dfllm-prefix-placement"  # the scheduler metadata holding each job's directory
STALL_S_ROUTED = 60.0  # after the workers changed: how long routed shares may make no progress
STALE_S = 6 * 3600.0  # a job's directory is dropped once it placed no partition for this long


def placement_settings() -> PlacementSettings:
    """Prefix-aware placement's settings from Dask's configuration (see the module's docstring)."""
    import dask

    enabled = dask.config.get(CONFIG_KEY, True)
    if isinstance(enabled, str):
        enabled = enabled.strip().lower() not in ("0", "false", "no", "off")
    return PlacementSettings(enabled=bool(enabled), balance=float(dask.config.get(BALANCE_KEY, 0.2)))


@dataclass(frozen=True)
class JobPlacement:
    """One ``.llm`` call's placement: its settings, a name for its directory on the
    scheduler, and its number of partitions (for the balance estimate)."""

    settings: PlacementSettings
    npartitions: int
    name: str = field(default_factory=lambda: f"dfllm-prefix-{uuid.uuid4().hex}")


def engines(client, resources: dict | None) -> list[str]:
    """The addresses of the cluster's workers that can run the job (those declaring
    ``resources``), sorted."""
    # asked of the scheduler now (a worker's client may not have its scheduler info yet)
    workers = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
    return sorted(
        addr
        for addr, info in workers.items()
        if all((info.get("resources") or {}).get(k, 0) >= v for k, v in (resources or {}).items())
    )


def directory_report(client, job: JobPlacement) -> dict | None:
    """What a job's placement did so far (its engines' work, rows split off their group's
    engine), read from the scheduler; None before its first partition."""
    d = _read(client, job)
    if d is None:
        return None
    return {"work": dict(d.loads), "split_rows": d.split, "partitions": d.partitions}


def _read(client, job: JobPlacement) -> PrefixDirectory | None:
    entry = client.get_metadata([METADATA_ROOT, job.name], default=None)
    if not entry:
        return None
    return PrefixDirectory.from_json(entry["directory"], job.npartitions, job.settings)


def _forget_stale(client) -> None:
    """Drop the directories of jobs that placed no partition for :data:`STALE_S` (the
    scheduler's metadata would otherwise keep every finished job's)."""
    now = time.time()
    for name, entry in (client.get_metadata([METADATA_ROOT], default=None) or {}).items():
        if entry and now - float(entry.get("updated", 0)) > STALE_S:
            client.set_metadata([METADATA_ROOT, name], None)


def run_routed(df: pd.DataFrame, fn) -> pd.DataFrame | None:
    """``fn(df)`` with the rows sent to their prefix groups' engines (see the module's
    docstring), or None where there is nothing to route (not on a Dask worker, an empty
    partition, no row with keys, fewer than two engines): the caller then runs the
    partition as usual. ``fn`` is a :class:`~dfllm.accessors.partitions.WritableFunction`
    with a ``placement``: its ``prefix_keys(df)`` keys the rows on this worker, and its
    ``without_placement()`` runs each engine's rows there."""
    from dfllm.accessors.placement import _worker

    job: JobPlacement = fn.placement
    worker = _worker()
    if not len(df) or worker is None:
        return None
    from dfllm.dashboard import ensure_installed

    ensure_installed()  # the dashboard page from the job's first partition, as unrouted
    limit = int(fn.engine_kwargs.get("max_num_seqs") or DEFAULTS["max_num_seqs"])
    with _routing_slot(len(df), limit) as slot:
        if not slot:  # a full batch of routed rows waits here already: this partition runs here
            return None
        return _route(df, fn, job)


@contextlib.contextmanager
def _routing_slot(rows: int, limit: int):
    """Whether a partition of ``rows`` may be routed. A routed partition's task leaves its
    thread while its rows run, so the worker starts another partition; as the engine's own
    backpressure does (:mod:`dfllm.worker.driver`), a worker routes partitions while the
    rows of its routed partitions are fewer than a batch (``limit``, the engine's
    ``max_num_seqs``; one partition at least), and runs the partitions beyond them where Dask
    put them, their thread held, so it holds no more partitions than without placement."""
    global _routing
    with _routing_lock:
        slot = not _routing or _routing + rows <= limit
        taken = rows if slot else 0
        _routing += taken
    try:
        yield slot
    finally:
        with _routing_lock:
            _routing -= taken


_routing = 0  # rows of the routed partitions waiting in this process
_routing_lock = threading.Lock()


def _route(df: pd.DataFrame, fn, job: JobPlacement) -> pd.DataFrame | None:
    from distributed import Lock, worker_client

    from dfllm.accessors.placement import worker_has

    resources = fn.resources
    with worker_client() as client:
        addresses = engines(client, resources)
        if len(addresses) < 2:
            return None
        if resources is None or worker_has(resources):
            keys = fn.prefix_keys(df)
        else:
            keys = client.submit(fn.prefix_keys, df, resources=resources, pure=False, key=_key(fn, "keys")).result()
        if all(k is None for k in keys):
            return None
        with Lock(f"{job.name}-lock"):
            directory = _read(client, job)
            if directory is None:  # the job's first partition
                _forget_stale(client)
                directory = PrefixDirectory(job.npartitions, job.settings)
            directory.sync(addresses)
            placement = directory.place(keys)
            client.set_metadata([METADATA_ROOT, job.name], {"updated": time.time(), "directory": directory.to_json()})
        if placement.split:
            logger.info(
                "prefix placement: %d row(s) of this partition placed away from their prefix group's engine "
                "to keep each engine's work within %.0f%% of the mean (the group is split across engines)",
                placement.split,
                100 * job.settings.balance,
            )

        by_engine: dict[str, list[int]] = {}
        for i, addr in enumerate(placement.engines):
            by_engine.setdefault(addr, []).append(i)
        return _gather(client, df, fn.without_placement(), by_engine, set(addresses))


def _key(fn, what: str) -> str:
    return f"{fn.__name__}-{what}-{uuid.uuid4().hex[:12]}"


def _submit(client, df: pd.DataFrame, fn, addr: str | None):
    workers = [addr] if addr else None
    return client.submit(fn, df, workers=workers, resources=fn.resources, pure=False, key=_key(fn, "routed"))


def _gather(client, df: pd.DataFrame, fn, by_engine: dict[str, list[int]], members: set[str]) -> pd.DataFrame:
    """Run each engine's rows there (``fn``, unrouted), and the partition's rows back in
    order (:func:`_collect`)."""
    pending = {_submit(client, df.iloc[rows], fn, addr): (addr, rows) for addr, rows in by_engine.items()}
    return _collect(client, df, fn, pending, members)


def _collect(client, df: pd.DataFrame, fn, pending: dict, members: set[str]) -> pd.DataFrame:
    """Wait for the routed shares ``pending`` (future: (worker, rows)) and put ``df``'s rows
    back in order. A share whose worker left, before it ran or holding its rows
    (:func:`_fetch`), is sent to a live engine (its rows' outputs do not depend on where); if
    the cluster's workers changed from ``members`` (those placed on) and no share has
    finished for :data:`STALL_S_ROUTED`, the rows still pending run here, in this task."""
    from distributed import wait

    parts: list[tuple[list[int], pd.DataFrame]] = []
    progress = time.monotonic()
    while pending:
        try:
            done, _ = wait(list(pending), timeout=LIVENESS_CHECK_S, return_when="FIRST_COMPLETED")
        except TimeoutError:  # none finished meanwhile: are their workers still there?
            done = set()
        lost = False
        for future in done:
            part = _fetch(future)
            if part is None:  # its worker died holding its rows: sent again below
                lost = True
                continue
            _, rows = pending.pop(future)
            parts.append((rows, part))
            progress = time.monotonic()
        if not pending or (done and not lost):
            continue
        alive = engines(client, fn.resources)
        if set(alive) != members and time.monotonic() - progress > STALL_S_ROUTED:
            logger.warning(
                "prefix placement: the cluster's workers changed and %d routed share(s) made no progress "
                "for %.0f s; running their rows here",
                len(pending),
                STALL_S_ROUTED,
            )
            for future, (_, rows) in pending.items():
                future.cancel()
                parts.append((rows, fn(df.iloc[rows])))
            break
        for future, (addr, rows) in list(pending.items()):
            if future.cancelled() or (addr not in alive and alive):
                future.cancel()
                del pending[future]
                # to a live engine; with none, to whichever worker with the job's resources joins
                target = alive[len(rows) % len(alive)] if alive else None
                pending[_submit(client, df.iloc[rows], fn, target)] = (target, rows)
    positions = np.concatenate([np.asarray(rows, dtype=np.int64) for rows, _ in parts])
    out = pd.concat([p for _, p in parts]) if len(parts) > 1 else parts[0][1]
    return out.iloc[np.argsort(positions, kind="stable")]


def _fetch(future) -> pd.DataFrame | None:
    """A finished routed share's rows, or None where they were lost with the worker holding
    them. Dask then marks the share lost (or, after a failed fetch, pending again), and a
    share restricted to a worker that left can never run again: ``future.result()`` alone
    would wait for it forever. A watcher cancels the wait once the share is no longer
    finished; the caller sends its rows again."""
    from concurrent.futures import CancelledError

    fetched = threading.Event()
    gave_up = threading.Event()

    def watch() -> None:
        while not fetched.wait(LIVENESS_CHECK_S):
            if future.status in ("lost", "pending"):
                gave_up.set()
                future.cancel()
                return

    watcher = threading.Thread(target=watch, name="dfllm-routed-fetch", daemon=True)
    watcher.start()
    try:
        return future.result()
    except CancelledError:
        if gave_up.is_set():
            return None
        raise
    finally:
        fetched.set()
