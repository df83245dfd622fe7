"""Which flow run a resumed training run continues: read from the coordinator's last beat.

Every session of a run beats ``heartbeats/coordinator.json`` with its Prefect flow run id
(``CoordinatorInfo``). Before a new session writes its own beat, the one there is its
predecessor's: a dead process's (still ``running``, silent), a failed one's or a finished one's.
How it ended is its flow run's final state in Prefect's API where that can be read (``Cancelled``,
``Crashed``, ``Completed``, ``Failed``: the beat cannot tell a cancel or a crash from a failure), else
the beat's status.
Whoever started the new session (``ckpt train --resume``, the watchdog's resume of a dead
deployment run, Retry of the same flow run, a resume from the form), the new flow run says so: a
log line, the tags ``resumed`` and ``resumes:<id prefix>`` on its flow run, and a line in its
summary artifact linking the predecessor's page. A Retry (the same flow run again) is its own
predecessor and gets none of these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ckptlib.heartbeat import read_heartbeat
from ckptlib.store import Store
from trainrun.documents import CoordinatorInfo
from trainrun.layout import COORDINATOR


@dataclass(frozen=True)
class Predecessor:
    """The session before this one: its flow run, how its coordinator last beat, and when."""

    flow_run_id: str | None
    # the beat's: running (it died: nobody ended it) | finished | failed | fenced; or the flow run's final
    # state from the API: completed | failed | cancelled | crashed
    status: str
    last_beat: float
    error: str | None = None
    name: str | None = None

    @property
    def dead(self) -> bool:
        return self.status == "running"

    def describe(self, now: float | None = None) -> str:
        age = (now or time.time()) - self.last_beat
        who = f"flow run {self.name or self.flow_run_id}" if self.flow_run_id else "a session without a flow run"
        how = ("it died (its coordinator still said running)" if self.dead else
               f"it ended {self.status}" + (f": {self.error}" if self.error else ""))
        return f"{who}, whose coordinator last beat {age:.0f} s before this session: {how}"

    def to_dict(self) -> dict[str, Any]:
        return {"flow_run_id": self.flow_run_id, "name": self.name, "status": self.status,
                "last_beat": self.last_beat, "error": self.error}


def find_predecessor(store: Store, own_flow_run_id: str | None) -> Predecessor | None:
    """The session whose coordinator beat last in this run, unless it is this very flow run (a Retry)."""
    beat = read_heartbeat(store, COORDINATOR)
    if beat is None:
        return None
    info = CoordinatorInfo.of_beat(beat)
    flow_run_id = info.flow_run_id if info is not None else None
    if own_flow_run_id and flow_run_id == own_flow_run_id:
        return None
    return Predecessor(flow_run_id=flow_run_id, status=beat.status, last_beat=beat.time, error=beat.error)


def announce(pred: Predecessor, own_flow_run_id: str | None, logger: Any) -> Predecessor:
    """Name the predecessor and say how it ended (its flow run's name and final state from the API),
    log it and tag this flow run; best effort."""
    name, status, error = None, pred.status, pred.error
    if pred.flow_run_id or own_flow_run_id:
        try:
            from uuid import UUID

            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                if pred.flow_run_id:
                    run = client.read_flow_run(UUID(pred.flow_run_id))
                    name = run.name
                    if run.state is not None and run.state.is_final():  # the truth; the beat is its guess
                        status, error = run.state.type.value.lower(), run.state.message or pred.error
                if own_flow_run_id:
                    own = client.read_flow_run(UUID(own_flow_run_id))
                    tags = ["resumed"] + ([f"resumes:{pred.flow_run_id[:8]}"] if pred.flow_run_id else [])
                    client.update_flow_run(own.id, tags=sorted({*own.tags, *tags}))
        except Exception as e:  # noqa: BLE001 - the UI's picture; the run goes on without it
            logger.warning("could not name or tag the predecessor flow run %s: %s", pred.flow_run_id, e)
    pred = Predecessor(pred.flow_run_id, status, pred.last_beat, error, name)
    logger.info("this session continues %s", pred.describe())
    return pred
