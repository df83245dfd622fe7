"""The watchdog beside a ``ckpt train`` run: the ``watchdog`` flow for this one run, in a thread here.

It fences a hung or silent shard and reruns it in this process, with the run's own spec (never one
read from the store), so a local run recovers with nothing else started. It judges this session
only: beats written before it started are a predecessor's (``ckpt train --resume`` after a kill),
and that dead process is not this run. Its flow run is its own
in the UI (``watchdog-<run id>``); it stops when the training flow returns. Credentials: this
process's environment (``trainrun.credentials.export_storage_options``). ``docs/watchdog.md``.
"""

from __future__ import annotations

import contextvars
import threading
import time
import uuid
from typing import Any

import typer

# A shard on a work pool is a flow run: a worker polls for it, then starts a fresh Python process that
# imports Prefect and torch (40 s measured on a loaded 2-core machine); a Dask worker process imports
# them with its first task (over 34 s measured in CI with two test workers on 2 cores: both shards of
# round 1 were fenced as never started). Until a shard's first beat the watchdog beside a run on
# processes allows this long; threads share the flow's imports and keep the default start timeout,
# max(2 x timeout, timeout + 30).
POOL_START_TIMEOUT_S = 120.0


def start_timeout_beside(task_runner: Any, timeout_s: float) -> float | None:
    """The start timeout of a watchdog beside a run on ``task_runner`` (None: the watchdog's default)."""
    return None if str(task_runner) == "threads" else max(POOL_START_TIMEOUT_S, 2 * timeout_s)


class BesideWatchdog:
    """The ``watchdog`` flow watching ``params``' run from a thread (see the module docstring)."""

    def __init__(self, params: Any, timeout_s: float, start_timeout_s: float | None = None):
        from flows.watchdog import stop_event

        self.params, self.timeout_s = params, timeout_s
        if start_timeout_s is None:
            start_timeout_s = start_timeout_beside(params.task_runner, timeout_s)
        self.start_timeout_s = start_timeout_s
        self.key = f"train-{params.run_id}-{uuid.uuid4().hex[:6]}"
        self.since = time.time()  # this session's beats only: a resumed run's predecessor is not this run
        self.stop_flag = stop_event(self.key)
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self._ctx = contextvars.copy_context()  # the Prefect API settings of `api.use()`
        self._thread = threading.Thread(target=self._run, name="ckpt-watchdog", daemon=True)

    def _run(self) -> None:
        from flows.watchdog import watchdog

        p = self.params
        try:
            self.summary = self._ctx.run(
                watchdog, store=p.store, run_id=p.run_id, timeout_s=self.timeout_s, start_timeout_s=self.start_timeout_s,
                poll_s=min(2.0, max(0.2, self.timeout_s / 8)), duration_s=0, credentials_block=p.credentials_block,
                spec=p.spec(), stop_key=self.key, since=self.since)
        except BaseException as e:  # noqa: BLE001 - reported with the summary; the run goes on
            self.error = e

    def start(self) -> BesideWatchdog:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.stop_flag.set()
        self._thread.join(timeout=timeout_s)

    def decisions(self) -> list[dict]:
        """The watchdog's decisions as JSON (a warning first, when the watchdog itself failed)."""
        if self.error is not None:
            typer.echo(f"warning: the watchdog beside the run failed: {type(self.error).__name__}: {self.error}", err=True)
        return list((self.summary or {}).get("decisions") or [])
