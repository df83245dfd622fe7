"""A cancel of a ``train-run`` flow run, seen from inside it: its shards checkpoint and stop, and it ends Cancelled.

Prefect 3.9 delivers a cancel two ways:

* a flow run in a worker's (runner's) subprocess: the runner sends the intent over its control
  channel, then SIGTERM, then SIGKILL 30 s later. The SIGTERM reaches ``trainrun.preemption``'s
  handler (the flow installs it over Prefect's): the shards checkpoint and stop, then the signal
  goes on to Prefect's handler, which ends the run ``Cancelled`` (the runner's intent);
* a flow run in the caller's process (``ckpt train``, ``python -m flows.train``, a test): nothing
  reaches it. The API says ``Cancelling`` and the engine goes on (the run would end in
  ``Cancelling``, its result ``UnfinishedRun``).

So the flow also watches its own state (``CancelWatch``, one API read every ``poll_s``): on
``Cancelling`` it asks its shards to stop (``preemption.request("cancel")``), commits nothing more,
and returns a ``Cancelled`` state carrying its summary (``RunCancelled`` to a Python caller).

Either way (a cancel, a SIGTERM) the request also writes the run's stop document (``StopNotice``,
``trainrun.preemption``): shards in other processes (Dask workers, shard flow runs, rank groups)
read it at their next beat and checkpoint and stop as the flow's own threads do.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any

from ckptlib.errors import CheckpointError
from ckptlib.heartbeat import read_heartbeat
from ckptlib.store import Store
from trainrun import preemption
from trainrun.layout import COORDINATOR

log = logging.getLogger("flows.cancel")


class RunCancelled(CheckpointError, RuntimeError):
    """The run was cancelled: its shards checkpointed where they were; ``summary`` says what it
    committed. Raised to a caller of ``train_run``; the flow run ends Cancelled with the message."""

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary


class CancelWatch:
    """Looks at the flow run's state every ``poll_s`` seconds (a thread in the flow's Prefect
    context); once it is Cancelling or Cancelled, asks this process's training loops to stop."""

    def __init__(self, flow_run_id: str, poll_s: float = 1.0):
        self.flow_run_id, self.poll_s = flow_run_id, poll_s
        self._stop = threading.Event()
        ctx = contextvars.copy_context()  # the flow run's Prefect API
        self._thread = threading.Thread(target=ctx.run, args=(self._watch,), name="ckpt-cancel-watch", daemon=True)

    def start(self) -> CancelWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        from uuid import UUID

        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            while not self._stop.wait(self.poll_s):
                try:
                    state = client.read_flow_run(UUID(self.flow_run_id)).state
                except Exception as e:  # noqa: BLE001 - the API is briefly away: look again
                    log.debug("cannot read flow run %s's state: %s", self.flow_run_id, e)
                    continue
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    preemption.request("cancel")
                    return


class StopNotice:
    """``preemption.on_request``'s writer for a session of a run: the stop document, with the round
    the coordinator's beat says it is in. A new session clears an earlier one's (``start``)."""

    def __init__(self, store: Store, by: str):
        self.store, self.by = store, by

    def start(self) -> StopNotice:
        preemption.clear_stop(self.store)  # before any shard of this session beats
        preemption.on_request(self)
        return self

    def stop(self) -> None:
        preemption.on_request(None)

    def __call__(self, reason: str) -> None:
        beat = read_heartbeat(self.store, COORDINATOR)
        preemption.write_stop(self.store, reason, by=self.by, round_no=beat.round if beat is not None else None)
        log.warning("%s: stop document written to %s/%s", reason, self.store.url, preemption.STOP_KEY)
