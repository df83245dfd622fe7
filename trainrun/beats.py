"""The heartbeats of a training run: what each carries for a watchdog, and the coordinator's beat.

ckptlib's ``Heartbeat`` writes ``heartbeats/<part>.json`` (a ``Beat``); its ``meta`` is ours:

* ``shard-<i>``: a ``documents.ShardInfo``, the cut the attempt started from and its spec's hash, so
  a watchdog can rerun the round even when no coordinator beats (ckptlib used without the flow);
* ``coordinator``: a ``documents.CoordinatorInfo``, beaten by the training flow from a thread
  (``CoordinatorBeat``): the round, its phase and the cut it starts from, the spec and settings,
  the Prefect flow run and deployment. What a watchdog needs to rerun a shard or restart the run.

A watchdog never runs code the store names: it takes a spec from here only when its workload is on
the watchdog's allow-list (``trainrun.watchdog.rerun``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from ckptlib import commit
from ckptlib.errors import FencedError
from ckptlib.heartbeat import Beat, Heartbeat
from ckptlib.store import Store

from .documents import CoordinatorInfo, Cut, Phase, ShardInfo
from .layout import COORDINATOR

if TYPE_CHECKING:
    from .spec import RunSpec

log = logging.getLogger("trainrun.beats")


class CoordinatorBeat:
    """``heartbeats/coordinator.json`` of a training run, every ``every_s`` from a daemon thread.

    The flow calls ``update(round_no=..., phase=..., cut=...)`` as it goes (written at once) and
    ``finish("finished" | "failed")`` at the end. A thread, unlike the shards' in-loop beats: the
    coordinator mostly waits (for shard tasks, for fragments), and what matters is that its process
    and flow run are alive."""

    def __init__(self, store: Store, info: CoordinatorInfo, *, every_s: float, round_no: int = 0):
        self.info = replace(info, phase="setup", phase_time=time.time())
        generation = commit.live_generation(store, COORDINATOR)
        self.hb = Heartbeat(store, COORDINATOR, generation=generation, round=round_no, every_s=every_s,
                            meta=self.info.to_dict())
        self.every_s = every_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-coordinator-beat", daemon=True)

    def start(self) -> CoordinatorBeat:
        self.hb.start(step=self.hb.round)
        self._thread.start()
        return self

    def update(self, *, round_no: int | None = None, phase: Phase | None = None, cut: Cut | None = None) -> None:
        with self._lock:
            if round_no is not None:
                self.hb.round = int(round_no)
            changes: dict[str, Any] = {} if cut is None else {"cut": cut}
            if phase is not None:
                changes.update(phase=phase, phase_time=time.time())
            self._set(replace(self.info, **changes))
            self._beat(force=True)

    def _set(self, info: CoordinatorInfo) -> None:
        self.info = info
        self.hb.meta = info.to_dict()

    def _beat(self, force: bool = False) -> None:
        try:
            self.hb.beat(step=self.hb.round, force=force)
        except FencedError as e:  # nobody fences the coordinator today; if someone does, stop beating
            log.warning("coordinator heartbeat stops: %s", e)
            self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s / 2):
            with self._lock:
                self._beat()

    def finish(self, status: Literal["finished", "failed"] = "finished", error: str | None = None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            self._set(replace(self.info, phase="done", phase_time=time.time()))
            self.hb.finish(status, error=error)


# --- a group's start, phase by phase ------------------------------------------------------------------

# What a fresh group of rank processes does before its first step, in order; each phase begins with
# a "starting" beat (``meta["starting"]``, no round step yet), so a watchdog times each phase on its
# own and a start that progresses is never taken for a dead one (``watchdog.judge``):
#   spawn       the supervisor starts the rank processes (python, torch imported, the job read)
#   rendezvous  a rank joins the group's gloo rendezvous
#   load        the group reads its start (the cut or a shard checkpoint)
#   build       the group builds its workload (DDP's first broadcast)
START_PHASES = ("spawn", "rendezvous", "load", "build")


def starting(hb: Heartbeat, phase: str) -> None:
    """Beat that ``hb``'s attempt enters start phase ``phase`` (a beat without a round step: it is
    still loading). Raises FencedError when fenced, as every beat does."""
    if phase not in START_PHASES:
        raise ValueError(f"unknown start phase {phase!r}: one of {START_PHASES}")
    hb.meta["starting"] = phase
    hb.start()


def start_meta(cut: Cut, spec: RunSpec) -> dict[str, Any]:
    """A group rank's beat meta: what a watchdog needs to rerun the round (``ShardInfo``), the group's size."""
    return {**ShardInfo(cut=cut, config_hash=spec.config_hash()).to_dict(), "ranks": spec.ranks_per_shard}


def started(hb: Heartbeat) -> None:
    """The attempt's start is over: its next beats carry round steps, not a start phase."""
    hb.meta.pop("starting", None)


def start_phase(beat: Beat) -> str | None:
    """The start phase ``beat`` says its attempt is in (None: not starting, or a phase unknown here)."""
    phase = beat.meta.get("starting") if beat.round_step is None else None
    return phase if phase in START_PHASES else None
