"""The failures vocabulary of a training run: what failed, how it was seen, what is decided; each name once.

Every failure the runtime tells apart is one ``FailureKind``::

    kind            what failed                  how it was seen                           what is decided
    crash           a shard attempt (a group's:   its own error: its final ``failed`` beat  retry (Prefect), from the same
                    one of its ranks failed)      (a group's: its supervisor writes it)     cut or its newest shard checkpoint
    preempted       a shard attempt (its process  its own stop: its final ``failed`` beat   retry, from the shard checkpoint
                    asked to stop: SIGTERM, a     says ``Preempted`` (a group's: its        it wrote as it stopped (0 steps
                    cancel)                       supervisor's)                             recomputed)
    process-died    a shard attempt               its process's end: its last beat still    retry (Dask or Prefect runs the
                                                  says ``running`` when the task runs again task again)
    silent          a shard attempt               a watchdog's timeout: no beat             fence and rerun
    stalled         a shard attempt               a watchdog's timeout: beats, no progress  fence and rerun
    lost            a watchdog's rerun            a watchdog's timeout: it never beat       fence and rerun
    missing         a shard attempt               a watchdog's timeout: it never beat in    fence and rerun
                                                  its round (the task never started)
    fenced          a shard attempt               a fence that gives no other kind (the     leave out of the cut (quorum), or
                                                  quorum flow's)                            as its fence says
    run-died        the whole run                 a resumed run finds its beats             resume the run

The kinds are the format where they are written: a recovery row's ``kind``
(``recoveries/...``: ``trainrun.recovery``) and a fence's ``state`` (``fences/<part>/<gen>``:
``trainrun.watchdog.decisions.Fence``; docs/run-layout.md). They are str-valued enums, so a member
*is* its string: written, compared and read back byte-identical.

A rank of a group says how it ended by its exit code (``RankExit``), which its supervisor
(``trainrun.rank_group``) turns into the group's error: a crash (retried), a refusal (not), a
fence (a newer generation owns the shard: stop) or a preemption (stop; a rerun continues from the
group's shard checkpoint). Torch-free, imports nothing of the project.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class Failed(StrEnum):
    """What failed."""

    ATTEMPT = "a shard attempt"  # a rank's failure is its group's attempt's: the group is the unit of failure
    RERUN = "a watchdog's rerun"
    RUN = "the whole run"


class Seen(StrEnum):
    """How the failure was seen."""

    OWN_ERROR = "its own error"  # the attempt raised: its final beat says failed (a group's: its supervisor's)
    EXIT = "its process's end"  # a process gone: a rank's exit, or a beat still 'running' when the task runs again
    TIMEOUT = "a watchdog's timeout"
    FENCE = "a fence"
    RESUME = "a resumed run"


class Decided(StrEnum):
    """What is done about it."""

    RETRY = "retry"
    RERUN = "fence and rerun"
    LEAVE_OUT = "leave out of the cut"
    RESUME = "resume the run"
    STOP = "stop"


class FailureKind(StrEnum):
    """One kind of failure (the module docstring's table): the recovery row's ``kind``, the fence's ``state``."""

    CRASH = "crash"
    PREEMPTED = "preempted"
    PROCESS_DIED = "process-died"
    SILENT = "silent"
    STALLED = "stalled"
    LOST = "lost"
    MISSING = "missing"
    FENCED = "fenced"
    RUN_DIED = "run-died"

    @property
    def failed(self) -> Failed:
        return _MEANING[self][0]

    @property
    def seen(self) -> Seen:
        return _MEANING[self][1]

    @property
    def decided(self) -> Decided:
        return _MEANING[self][2]


_MEANING: dict[FailureKind, tuple[Failed, Seen, Decided]] = {
    FailureKind.CRASH: (Failed.ATTEMPT, Seen.OWN_ERROR, Decided.RETRY),
    FailureKind.PREEMPTED: (Failed.ATTEMPT, Seen.OWN_ERROR, Decided.RETRY),
    FailureKind.PROCESS_DIED: (Failed.ATTEMPT, Seen.EXIT, Decided.RETRY),
    FailureKind.SILENT: (Failed.ATTEMPT, Seen.TIMEOUT, Decided.RERUN),
    FailureKind.STALLED: (Failed.ATTEMPT, Seen.TIMEOUT, Decided.RERUN),
    FailureKind.LOST: (Failed.RERUN, Seen.TIMEOUT, Decided.RERUN),
    FailureKind.MISSING: (Failed.ATTEMPT, Seen.TIMEOUT, Decided.RERUN),
    FailureKind.FENCED: (Failed.ATTEMPT, Seen.FENCE, Decided.LEAVE_OUT),
    FailureKind.RUN_DIED: (Failed.RUN, Seen.RESUME, Decided.RESUME),
}

# What a watchdog judges dead, fences and reruns (``trainrun.watchdog.judge``): a part's state.
WATCHDOG_KINDS: tuple[FailureKind, ...] = tuple(k for k in FailureKind if k.seen is Seen.TIMEOUT)


def kind_of_fence(state: object) -> str:
    """The failure kind a fence document's ``state`` names (read from the store, so any string is
    kept as it is); ``fenced`` when it names none (the quorum flow's fence)."""
    return str(state) if state else FailureKind.FENCED


class RankExit(IntEnum):
    """How a rank process of a group ended (its exit code) and so what its supervisor raises."""

    DONE = 0  # stdin closed or stayed idle: every job it was sent is done
    FAILED = 1  # anything else (its traceback on stderr): the group failed, RankGroupFailed (retried) or Refused
    FENCED = 3  # a newer generation owns the shard: FencedError, stop
    PREEMPTED = 4  # the group stopped on a preemption, its state checkpointed: Preempted, a rerun continues
