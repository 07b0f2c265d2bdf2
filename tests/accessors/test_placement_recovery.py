"""A partition's routed shares survive the worker that holds them dying (a LocalCluster of two
worker processes, one killed for real).

The case that hung ``dfllm run`` when a worker was killed: a routed share has finished on its
worker and the partition task is fetching its rows when that worker dies. Dask marks the share
lost and would run it again, but only on the worker it is restricted to, which is gone: the
fetch must give up and the rows go to a live engine.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pandas as pd
import pytest

from dfllm.accessors.prefix_placement import _collect, _submit

from helpers import local_client

pytestmark = pytest.mark.slow


def routed_function():
    """A stand-in for a partition's unrouted function: what the routing needs of it (a name
    for its tasks' keys, its resources) and rows out for rows in."""

    def double(df: pd.DataFrame) -> pd.DataFrame:
        return df.assign(y=df.x * 2, pid=os.getpid())

    double.resources = None  # type: ignore[attr-defined]
    return double


def test_rows_held_by_a_killed_worker_are_computed_again_elsewhere():
    with local_client(2) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        pid_a = client.run(os.getpid, workers=[a])[a]
        df = pd.DataFrame({"x": range(10)}, index=pd.RangeIndex(100, 110, name="row"))
        fn = routed_function()
        shares = {a: [0, 2, 4, 6, 8], b: [1, 3, 5, 7, 9]}
        pending = {_submit(client, df.iloc[rows], fn, addr): (addr, rows) for addr, rows in shares.items()}
        for future in pending:
            future.result()  # both shares finished, their rows held on their workers

        # worker a stops answering while the partition fetches its rows, then dies
        os.kill(pid_a, signal.SIGSTOP)
        result: dict = {}

        def collect() -> None:
            try:
                result["out"] = _collect(client, df, fn, dict(pending), {a, b})
            except BaseException as e:  # noqa: BLE001 (said below)
                result["error"] = e

        thread = threading.Thread(target=collect, daemon=True)
        thread.start()
        time.sleep(1.5)
        os.kill(pid_a, signal.SIGKILL)
        thread.join(120)
        assert not thread.is_alive(), "the partition waits forever for rows its dead worker held"
        assert "error" not in result, result.get("error")
        out = result["out"]
        assert out.index.tolist() == df.index.tolist()
        assert out.y.tolist() == [2 * x for x in range(10)]
        assert pid_a not in set(out.pid), "rows came back from the killed worker"
