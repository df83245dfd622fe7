"""What a watchdog decides, as documents: ``Decision`` (each one, for logs, events and artifacts) and
``Fence`` (the fence document ``fences/<part>/<gen>`` it leaves in the store), and one line of
text per decision (``describe``).

Kinds of decision: ``fenced`` (a dead shard's generation bumped; ``rerun`` says whether this
watchdog reruns it), ``lost-race`` (another watchdog fenced first), ``running-again`` (the rerun
beats), ``rerun-failed``, ``gave-up`` (reruns of one round died ``MAX_RERUNS`` times),
``cannot-rerun`` (no cut, no trusted spec, a workload not allowed: reported, nothing run),
``run-dead`` (the coordinator is silent), ``resumed`` and ``resume-failed`` (a dead deployment run
started again, or not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ckptlib import commit
from ckptlib.documents import Document, DocumentError
from ckptlib.store import Store

from ..resume_point import ShardCheckpointRef

Kind = Literal["fenced", "lost-race", "running-again", "rerun-failed", "gave-up", "cannot-rerun", "run-dead",
               "resumed", "resume-failed"]
# Decisions worth a markdown artifact and a warning (the others are logged as info).
NOTABLE: tuple[Kind, ...] = ("fenced", "run-dead", "resumed", "resume-failed", "gave-up", "cannot-rerun",
                             "rerun-failed")
# What a run's own summary lists (``ckpt train``): what the watchdog did to it, and when each fenced
# shard ran again. Left out: ``lost-race`` (another watchdog acted; this one did nothing).
SUMMARY: tuple[Kind, ...] = (*NOTABLE, "running-again")


@dataclass(frozen=True)
class RerunInfo(Document):
    """Which task run a fence decision started: shard ``shard`` of round ``round`` as attempt offset + 1."""

    KIND = "rerun"

    shard: int
    round: int
    attempt_offset: int


@dataclass(frozen=True)
class Resumed(Document):
    """The flow run that continues a dead deployment run."""

    KIND = "resumed run"

    flow_run_id: str
    flow_run_name: str
    reason: str


@dataclass(frozen=True)
class Decision(Document):
    """One decision of a watchdog about one part of one run (see the module docstring for kinds)."""

    KIND = "watchdog decision"

    kind: Kind
    run: str
    run_url: str
    part: str
    state: str
    detected: float  # wall time of the decision
    failure_time: float  # best estimate of when the part stopped
    detection_latency_s: float
    by: str
    shard: int | None = None
    reason: str | None = None
    round: int | None = None
    step: int | None = None
    round_step: int | None = None
    steps_per_round: int | None = None
    dead_generation: int | None = None
    dead_attempt: int | None = None
    generation: int | None = None  # the new generation (fenced)
    last_beat: float | None = None
    steps_lost: int | None = None
    won: bool = False  # this watchdog created the fence
    strike_time: float | None = None  # a chaos drill: the true moment and kind of the failure
    strike_kind: str | None = None
    strike_latency_s: float | None = None
    rerun: RerunInfo | None = None
    running_again_time: float | None = None
    running_again_s: float | None = None
    restart_s: float | None = None
    flow_run_id: str | None = None  # run-dead: the dead flow run and where it came from
    deployment_id: str | None = None
    run_id: str | None = None
    committed: int | None = None
    resumed: Resumed | None = None

    def scalars(self) -> dict[str, Any]:
        """The fields that are plain JSON scalars (an event's payload)."""
        return {k: v for k, v in self.to_dict().items() if isinstance(v, (str, int, float, bool, type(None)))}


@dataclass(frozen=True)
class Fence(Document):
    """``fences/<part>/<generation>``: who fenced the part, when, why, and the decision's measures."""

    KIND = "fence"

    part: str
    generation: int
    reason: str = ""
    by: str = ""
    time: float | None = None
    state: str | None = None
    run: str | None = None
    dead_generation: int | None = None
    dead_attempt: int | None = None
    round: int | None = None
    step: int | None = None
    round_step: int | None = None
    steps_per_round: int | None = None
    last_beat: float | None = None
    failure_time: float | None = None
    detected: float | None = None
    detection_latency_s: float | None = None
    rerun: bool | None = None
    by_flow_run_id: str | None = None  # the Prefect flow run of the watchdog that fenced (a link in the UI)
    # the fenced generation's newest shard checkpoint when it was fenced: where the rerun continues
    resume: ShardCheckpointRef | None = None

    @staticmethod
    def details(d: Decision, *, rerun: bool) -> dict[str, Any]:
        """What ``commit.fence`` stores beside part, generation, reason, by and time."""
        keys = ("state", "dead_generation", "dead_attempt", "round", "step", "round_step", "steps_per_round",
                "last_beat", "failure_time", "detected", "detection_latency_s", "run")
        full = d.to_dict()
        return {**{k: full[k] for k in keys}, "rerun": rerun}


def read_fence(store: Store, part: str, generation: int) -> Fence | None:
    """The fence of ``part``'s ``generation``; None if there is none. One that does not parse keeps
    its part and generation (a fence exists whatever its document says) and says why in ``reason``."""
    doc = commit.read_fence(store, part, generation)
    if doc is None:
        return None
    try:
        return Fence.from_dict(doc, commit.fence_key(part, generation))
    except DocumentError as e:
        return Fence(part, generation, reason=f"unreadable fence document: {e}")


def read_fences(store: Store, part: str) -> list[Fence]:
    """Every fence of ``part``, oldest first."""
    fences = (read_fence(store, part, gen) for gen in range(1, commit.live_generation(store, part) + 1))
    return [f for f in fences if f is not None]


def describe(d: Decision) -> str:
    """One line per decision, for logs and the CLI."""
    where = f"{d.part} of run {d.run}" + (f" round {d.round}" if d.round is not None else "")
    if d.kind == "fenced":
        # a drill knows the step it struck at, later than the last beat: the steps to redo count from it
        extra = (f"; the drill struck at step {d.steps_lost}/{d.steps_per_round}, {d.strike_latency_s:.1f} s ago"
                 if d.strike_latency_s is not None else "")
        return (f"{where}: {d.reason} -> fenced generation {d.generation} ({d.detection_latency_s:.1f} s "
                f"after its last sign of life{extra}); "
                + (f"rerun as attempt {d.rerun.attempt_offset + 1}" if d.rerun else "not rerun here"))
    if d.kind == "running-again":
        return f"{where}: {d.reason} (restart {d.restart_s or 0:.1f} s after the decision)"
    if d.kind == "lost-race":
        return f"{where}: {d.reason}"
    return f"{where}: {d.kind}: {d.reason}"
