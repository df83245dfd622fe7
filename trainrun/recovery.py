"""What each recovery of a shard cost: recognising one (``recognise_failure``), its row (``Recovery``), where rows are kept.

A shard attempt that starts where an earlier attempt of the same round failed is a recovery. It
recognises that from what it finds before its own first beat (``Failure.recognise``): the earlier
attempt's last beat (``heartbeats/<part>.json``), the fence of its own generation when a watchdog
fenced the earlier one, and the chaos strike that hit it in a drill. The row's ``kind`` is a
``trainrun.failures.FailureKind`` (what failed, how it was seen, what was decided):

``crash``         the earlier attempt raised (its last beat says ``failed``); Prefect retried the task.
                  Also a group whose rank died or crashed: its supervisor ends the group, writes the
                  final beats the ranks did not (``trainrun.rank_group.finish_failed_beats``) and raises
``preempted``     the earlier attempt was asked to stop (SIGTERM, a cancel): it checkpointed where it
                  was and raised ``Preempted`` (its last beat says ``failed``, ``Preempted: ...``)
``process-died``  its last beat says ``running`` and no newer generation exists: its process died
                  (a killed Dask worker, a shard task killed with its ranks); Dask or Prefect ran the
                  task again
``silent``, ``stalled``, ``lost``, ``missing``
                  a watchdog judged it so, fenced it and reran the shard as a new generation (the
                  fence's ``state``; ``fenced`` when its fence names none: the quorum flow's)
``run-died``      the whole run died mid-round and was resumed (``flows/summary.py`` writes these rows,
                  from the beats the dead run left, since a resumed attempt may start several rounds
                  earlier)

Once the attempt trains again it writes its row, ``recoveries/<round>/<part>.g<gen>.a<attempt>.json``:
the round step it failed at (the newest of its last beat, its chaos strike and its last checkpoint),
the step it resumed at, the steps recomputed, and two durations: ``detect_s`` from the failure (its chaos strike, else
the dead attempt's last beat) to the moment it was noticed, and ``back_to_training_s`` from then
until the
attempt trained again (retry delay, task start, loading the shard checkpoint, building the
workload). The run's summary, its artifact and ``ckpt train``'s live table list the rows.

Where each failure is noticed (measured on 2 shared cores, docs/watchdog.md): a raised error, in
the attempt itself, by its final ``failed`` beat (3-9 ms); a rank of a group that exits, by its
supervisor at that exit (a pidfd wakes it; the final beats carry that moment: 0.03 s, was 0.17-0.20
s with a 0.2 s poll); a process whose beat says ``running`` (a killed Dask worker, a killed shard
flow run) only when its task runs again, so its ``detect_s`` includes the rescheduling; a hang or a
stall, by a watchdog after its timeout. Torch-free.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from ckptlib import commit
from ckptlib.documents import Document, DocumentError
from ckptlib.errors import ObjectNotFound, StoreError
from ckptlib.heartbeat import Beat, read_heartbeat
from ckptlib.store import Store

from .chaos import read_strike
from .documents import ShardInfo
from .errors import Preempted
from .failures import FailureKind, kind_of_fence
from .layout import COORDINATOR, recovery_key, shard_index

log = logging.getLogger("trainrun.recovery")

# A beat older than the coordinator's session by this much belongs to an earlier session (a dead run).
SESSION_SLACK_S = 1.0


@dataclass(frozen=True)
class Recovery(Document):
    """One recovery of one shard (see the module docstring): the row of the run's summary."""

    KIND = "recovery"

    shard: int
    round: int
    kind: str
    failed_at_step: int
    resumed_at_step: int
    steps_recomputed: int
    detect_s: float | None
    back_to_training_s: float | None
    part: str = ""
    generation: int = 0
    attempt: int | None = None
    cause: str | None = None  # the chaos kind that struck, in a drill
    source: str = "cut"  # where the state came from: cut | store | local (the local tier)
    checkpoint: str | None = None  # the shard checkpoint it continued from
    failed_at: float | None = None  # wall times: the failure, the start of recovery, training again
    detected_at: float | None = None
    training_at: float | None = None

    ROW = ("shard", "round", "kind", "failed_at_step", "resumed_at_step", "steps_recomputed", "detect_s",
           "back_to_training_s")

    def row(self) -> dict:
        """The summary's row: the issue's eight fields first, then the rest."""
        d = self.to_dict()
        return {**{k: d[k] for k in self.ROW}, **{k: v for k, v in d.items() if k not in self.ROW}}


@dataclass(frozen=True)
class Failure:
    """What an attempt found of the earlier attempt it replaces: how it failed, where and when."""

    kind: str
    failed_at_step: int
    failed_at: float
    detected_at: float | None  # None: when this attempt started (nothing noticed it earlier)
    cause: str | None

    @classmethod
    def recognise(cls, store: Store, prior: Beat | None, coordinator: Beat | None, *, round_no: int, cut_step: int,
                  generation: int, fence: dict | None) -> Failure | None:
        """The failure this attempt recovers from, from the earlier attempt's last beat ``prior``
        (read before this attempt's first beat), the coordinator's beat (its session) and the fence
        of this attempt's generation; None when this attempt is not a recovery."""
        if prior is None or prior.round != round_no or prior.status == "finished":
            return None
        info = ShardInfo.of_beat(prior)
        if info is None or info.cut.step != cut_step:
            return None
        if coordinator is not None and coordinator.started and prior.time < coordinator.started - SESSION_SLACK_S:
            return None  # an earlier session's: the resumed run reports it (run-died)
        strike = read_strike(store, prior.part, round_no, prior.attempt) if prior.attempt is not None else None
        steps = [prior.round_step or 0] + ([strike.round_step] if strike is not None else [])
        failed_at = strike.time if strike is not None else prior.time
        cause = strike.kind if strike is not None else None
        if prior.generation < generation:  # a watchdog fenced it and reran the shard
            f = fence or {}
            steps.append(int(f.get("round_step") or 0))
            if strike is None and f.get("failure_time") is not None:
                failed_at = float(f["failure_time"])
            detected = f.get("detected", f.get("time"))
            return cls(kind_of_fence(f.get("state")), max(steps), failed_at,
                       float(detected) if detected is not None else None, cause)
        if prior.status == "failed":  # it raised: a preemption says so in its final beat
            stopped = (prior.error or "").startswith(f"{Preempted.__name__}:")
            return cls(FailureKind.PREEMPTED if stopped else FailureKind.CRASH, max(steps), failed_at, prior.time,
                       cause)
        return cls(FailureKind.PROCESS_DIED, max(steps), failed_at, None, cause)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Failure:
        """What ``to_dict`` wrote (a group's supervisor recognises the failure and tells its rank 0)."""
        return cls(kind=str(d["kind"]), failed_at_step=int(d["failed_at_step"]), failed_at=float(d["failed_at"]),
                   detected_at=None if d.get("detected_at") is None else float(d["detected_at"]),
                   cause=None if d.get("cause") is None else str(d["cause"]))

    def recovery(self, *, part: str, round_no: int, generation: int, attempt: int, started_at: float,
                 training_at: float, resumed_at_step: int, source: str, checkpoint: str | None) -> Recovery:
        """The row of this failure, recovered by an attempt that started at ``started_at`` and
        trained again at ``training_at`` from round step ``resumed_at_step``."""
        detected = self.detected_at if self.detected_at is not None else started_at
        failed_at_step = max(self.failed_at_step, resumed_at_step)
        return Recovery(shard=shard_index(part) or 0, round=round_no, kind=self.kind, failed_at_step=failed_at_step,
                        resumed_at_step=resumed_at_step, steps_recomputed=failed_at_step - resumed_at_step,
                        detect_s=round(max(0.0, detected - self.failed_at), 3),
                        back_to_training_s=round(max(0.0, training_at - detected), 3), part=part,
                        generation=generation, attempt=attempt, cause=self.cause, source=source,
                        checkpoint=checkpoint, failed_at=self.failed_at, detected_at=detected, training_at=training_at)


def recognise_failure(store: Store, part: str, round_no: int, cut_step: int, generation: int) -> Failure | None:
    """The failure of an earlier attempt of ``part``'s round ``round_no`` (from the cut of step
    ``cut_step``) that an attempt of ``generation`` recovers from, if any: read before the attempt
    beats (its first beat replaces the earlier attempt's last). A store that cannot be read gives
    None, logged: the report must never stop the recovery itself."""
    try:
        prior = read_heartbeat(store, part)
        if prior is None or prior.round != round_no:
            return None
        coordinator = read_heartbeat(store, COORDINATOR)
        fence = commit.read_fence(store, part, generation) if generation > 0 else None
        return Failure.recognise(store, prior, coordinator, round_no=round_no, cut_step=cut_step,
                                 generation=generation, fence=fence)
    except Exception as e:  # noqa: BLE001 - a report: it must never stop the recovery itself
        log.warning("%s round %d: cannot tell whether this attempt is a recovery: %s", part, round_no, e)
        return None


def write_recovery(store: Store, rec: Recovery) -> None:
    """Keep ``rec`` in the store for the run's summary (a failure to write is logged: it is a report)."""
    try:
        store.put(recovery_key(rec.round, rec.part, rec.generation, rec.attempt or 0), rec.to_json())
    except StoreError as e:
        log.warning("recovery of %s round %d not recorded: %s", rec.part, rec.round, e)


def read_recoveries(store: Store, round_no: int | None = None) -> list[Recovery]:
    """The recoveries recorded for round ``round_no`` (None: every round), by round and time; an
    unreadable row is logged and left out."""
    prefix = "recoveries" if round_no is None else f"recoveries/{round_no}"
    rows = []
    for info in store.scan(prefix):
        try:
            rows.append(Recovery.read(store, info.key))  # with its kind's cap
        except (DocumentError, ObjectNotFound, StoreError) as e:
            log.warning("recovery row %s ignored: %s", info.key, e)
    return sorted(rows, key=lambda r: (r.round, r.failed_at or 0.0, r.part))


def fence_recoveries(store: Store, round_no: int, known: set[tuple[str, int]], *, since: float) -> list[Recovery]:
    """A row for each fence of round ``round_no`` (made at or after wall time ``since``) whose rerun
    wrote none: a shard fenced before it beat in the round (``missing``, or a group fenced while it
    started) leaves its rerun no earlier attempt to recognise, yet it was a recovery. ``known``: the
    (part, generation) pairs already counted, added to here (each fence is read once per session).
    Its steps recomputed are those its fence says were lost; its time back to training is unknown."""
    rows = []
    for part, live in commit.live_generations(store).items():
        for generation in range(1, live + 1):
            if (part, generation) in known or shard_index(part) is None:
                continue
            doc = commit.read_fence(store, part, generation) or {}
            if doc.get("round") != round_no:
                continue
            known.add((part, generation))
            fenced_at = float(doc.get("detected") or doc.get("time") or 0.0)
            if fenced_at < since:
                continue  # an earlier session's
            failed_at = float(doc.get("failure_time") or fenced_at)
            step = int(doc.get("round_step") or 0)
            rows.append(Recovery(shard=shard_index(part) or 0, round=round_no, kind=kind_of_fence(doc.get("state")),
                                 failed_at_step=step, resumed_at_step=0, steps_recomputed=step,
                                 detect_s=round(max(0.0, fenced_at - failed_at), 3), back_to_training_s=None,
                                 part=part, generation=generation, failed_at=failed_at, detected_at=fenced_at))
    return rows

