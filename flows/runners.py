"""Where shard tasks run, by one parameter: ``threads`` | ``dask`` | ``dask://HOST:PORT``.

* ``threads``: the flow's own ThreadPoolTaskRunner (one process; shards are threads).
* ``dask``: a temporary local Dask cluster of processes (``prefect_dask.DaskTaskRunner``), one worker
  process per shard (at least 2), one thread each; it lives as long as the flow run.
* ``dask://HOST:PORT``: an existing Dask scheduler (``dask scheduler`` + ``dask worker`` on many
  machines). Every worker must import this project (and the workload's module) and reach the store,
  so use an s3:// store there.

Only shard tasks go to Dask. The cut runs in the flow's process (a thread). Validations run in one
separate worker process (``validation_runner``): they are Python-heavy (pandas, Great Expectations)
and, as threads, would hold the GIL against the shards' training loops; in their own process they
only share the CPU. They never take a worker slot from the next round's shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def shard_runner(spec: str, shards: int) -> Iterator[Any]:
    """A started task runner for shard tasks, or None for the flow's own (threads)."""
    if spec == "threads":
        yield None
        return
    from prefect_dask import DaskTaskRunner

    if spec == "dask":
        runner = DaskTaskRunner(cluster_kwargs={"n_workers": max(2, shards), "threads_per_worker": 1,
                                                "processes": True, "dashboard_address": None})
    elif spec.startswith("dask://"):
        runner = DaskTaskRunner(address="tcp://" + spec[len("dask://"):])
    else:
        raise ValueError(f"unknown task runner {spec!r}: use threads, dask or dask://HOST:PORT")
    with runner:
        yield runner


def submit(runner: Any, task: Any, **parameters: Any) -> Any:
    """Submit ``task`` to ``runner`` (None: the flow's own task runner). Returns a PrefectFuture."""
    if runner is None:
        return task.submit(**parameters)
    return runner.submit(task, parameters)


@contextmanager
def validation_runner(kind: str) -> Iterator[Any]:
    """``process``: one worker process for validations (sequential, beside training); ``threads``:
    the flow's own thread pool (None)."""
    if kind == "threads":
        yield None
        return
    if kind != "process":
        raise ValueError(f"unknown validation runner {kind!r}: use process or threads")
    from prefect.task_runners import ProcessPoolTaskRunner

    with ProcessPoolTaskRunner(max_workers=1) as runner:
        yield runner
