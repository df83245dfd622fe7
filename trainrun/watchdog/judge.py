"""The watchdog's rules: the state of every part of one run at one moment, from its beats and fences.

What counts as dead (one shard attempt)
---------------------------------------
The failures a watchdog's timeout sees (``trainrun.failures.WATCHDOG_KINDS``): the part's state,
then the ``state`` of the fence it gets and the ``kind`` of its rerun's recovery row.

``silent``   its last beat (status running) is older than ``timeout_s`` (``start_timeout_s`` while it
             is still starting: its beat has no ``round_step`` until the attempt has loaded the cut
             and built its workload, which take seconds in a fresh process on a busy machine; a
             group beats each start phase, ``trainrun.beats.START_PHASES``, and each phase is timed
             from its own beat, at least ``START_PHASE_FLOOR_S`` of it), or another rank of its
             group (of this attempt and session) is;
``stalled``  it beats, but its step (or start phase) has not changed for ``timeout_s`` (needs a
             watchdog that has looked at it before: its ``Memory`` keeps the first beat with that
             step, per attempt and start time: never a predecessor's);
``lost``     it was fenced and rerun, and the new generation has not beaten for ``start_timeout_s``
             after the fence (the rerun never started: e.g. the watchdog that fenced died);
``missing``  the coordinator has been waiting for this round's shards for ``start_timeout_s`` and this
             shard never beat in it (the task never started).

An attempt whose fragment for its round is already written is ``done``, whatever its beat says. A
beat older than the coordinator's session (a previous run of the same run id) is ignored. In a run
without a coordinator beat (ckptlib used directly), a shard silent for ``abandoned_after(timeout)``
is ``abandoned``, not dead: nobody would gather its rerun. The run is ``dead`` when the coordinator
is silent for ``coordinator_timeout_s``. A dead part's ``reason`` names the rank (of a group), the
step its last beat was at (the watchdog adds a drill's true step and rank), the last beat's age and
when that step was reached. A watchdog that watches one session only (the one beside
``ckpt train``) ignores every beat written before that session began (``since``): a resumed run's
predecessor died, this session did not.

Pure but for the store reads: the clock is a parameter (``now``), so the rules are tested with
beats written by hand (``tests/test_watchdog.py``). ``ckpt status`` shows these views.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptlib import commit
from ckptlib.errors import StoreError
from ckptlib.heartbeat import Beat, read_heartbeats, read_rank_heartbeats
from ckptlib.store import Store

from ..beats import start_phase
from ..documents import CoordinatorInfo
from ..failures import WATCHDOG_KINDS, FailureKind
from ..layout import COORDINATOR, run_name, shard_part
from .decisions import read_fence
from .memory import Memory

DEFAULT_TIMEOUT_S = 30.0  # the default workload beats every 2 s and steps every few ms: 15 beats missed
DEFAULT_POLL_S = 2.0
BEAT_READERS = 32  # beats read at once: a look at 1,000 shards on S3 is ~1,000 GETs, latency-bound
ABANDONED_AFTER_MIN_S = 600.0
# The least time each start phase of a group (trainrun.beats.START_PHASES) is given, whatever the
# start timeout: measured on 2 cores shared by 5 test runs (load 6-8), a 2-rank group of tinylm took
# spawn (python, torch import) 8.3 s, rendezvous (waits for the slower rank's import) 1.5 s, load
# 0.1-0.4 s, build (workload, DDP's first broadcast) 3.6-5.0 s; a busier machine took over 40 s in
# all. About five times each (the rendezvous as the spawn: it waits for the slowest rank's import).
START_PHASE_FLOOR_S = {"spawn": 45.0, "rendezvous": 45.0, "load": 20.0, "build": 30.0}
# A beat this much older than the coordinator's session start belongs to a previous session.
SESSION_SLACK_S = 1.0


def start_timeout_for(timeout_s: float) -> float:
    """How long a task may take to start (first beat) before it counts as never started."""
    return max(2 * timeout_s, timeout_s + 30.0)


def abandoned_after(timeout_s: float) -> float:
    """A shard of a run without a coordinator beat, silent this long, belongs to an abandoned run."""
    return max(10 * timeout_s, ABANDONED_AFTER_MIN_S)


@dataclass
class PartView:
    """The watchdog's view of one part (a shard or the coordinator) at one look."""

    part: str
    state: str  # running | finished | failed | fenced | replaced | waiting | done | abandoned | silent | stalled | lost | missing | dead
    live: int  # live generation
    generation: int | None = None  # generation of the attempt whose beat this is
    status: str | None = None  # the beat's own status
    round: int | None = None
    step: int | None = None
    round_step: int | None = None
    steps_per_round: int | None = None
    attempt: int | None = None
    age_s: float | None = None  # since the last beat
    pid: int | None = None
    host: str | None = None
    reason: str | None = None  # why dead (or what it waits for)
    failure_time: float | None = None  # best estimate of when it stopped (wall time)
    beat: Beat | None = field(default=None, repr=False)

    @classmethod
    def of(cls, part: str, state: str, live: int, beat: Beat | None = None, now: float | None = None) -> PartView:
        if beat is None:
            return cls(part, state, live)
        return cls(part, state, live, generation=beat.generation, status=beat.status, round=beat.round,
                   step=beat.step, round_step=beat.round_step, steps_per_round=beat.steps_per_round,
                   attempt=beat.attempt, age_s=None if now is None else beat.age(now), pid=beat.pid,
                   host=beat.host, beat=beat)

    @property
    def dead(self) -> bool:
        return self.state in WATCHDOG_KINDS

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("beat")
        return d


@dataclass
class RunView:
    url: str
    run: str
    coordinator: PartView | None
    shards: list[PartView]
    committed: int | None = None  # latest committed step
    info: CoordinatorInfo | None = None  # what the coordinator's beat carries

    @property
    def state(self) -> str:
        """running | finished | failed | dead | unknown (no coordinator beat)."""
        if self.coordinator is None:
            return "unknown"
        return self.coordinator.state


def assess_run(store: Store, url: str, *, timeout_s: float, start_timeout_s: float | None = None,
               coordinator_timeout_s: float | None = None, now: float | None = None,
               memory: Memory | None = None, with_committed: bool = True, since: float | None = None) -> RunView:
    """Judge every part of one run at wall time ``now`` (default: the clock). ``memory`` (the
    caller's, kept between looks) enables ``stalled``; without it only silence counts. ``since``:
    beats older than this wall time are not looked at (a previous session's).

    What one look costs, on S3, for N shards: a listing of ``heartbeats/`` and N beat reads (in
    parallel), one listing of ``fences/`` (every part's generation), one listing of the current
    round's ``fragments/<round>/`` when a shard beats as running, and a fence read per replaced
    shard; listings are one request per 1,000 keys. Nothing depends on how many rounds the run has
    had, but ``with_committed`` (the latest committed step, for ``ckpt status``: a listing of
    ``manifests/``, one request per 1,000 checkpoints); the watchdog leaves it out."""
    now = time.time() if now is None else now
    start_timeout_s = start_timeout_for(timeout_s) if start_timeout_s is None else start_timeout_s
    coordinator_timeout_s = timeout_s if coordinator_timeout_s is None else coordinator_timeout_s
    beats = read_heartbeats(store, threads=BEAT_READERS)
    if since is not None:
        beats = {part: beat for part, beat in beats.items() if beat.time >= since}
    cbeat = beats.pop(COORDINATOR, None)
    coordinator, info, session_start = None, None, None
    if cbeat is not None:
        session_start = cbeat.started or None
        info = CoordinatorInfo.of_beat(cbeat)
        state = cbeat.status if cbeat.status in ("finished", "failed") else "running"
        coordinator = PartView.of(COORDINATOR, state, cbeat.generation, cbeat, now)
        age = cbeat.age(now)
        if cbeat.status == "running" and age > coordinator_timeout_s:
            coordinator.state = "dead"
            coordinator.reason = f"the coordinator has not beaten for {age:.1f} s (timeout {coordinator_timeout_s:g} s)"
            coordinator.failure_time = cbeat.time
    if info is not None and info.spec is not None:
        parts = [shard_part(i) for i in range(info.spec.shards)]
    else:
        parts = sorted(beats, key=lambda p: (len(p), p))
    active = coordinator is None or coordinator.state == "running"
    look = _Look(store)
    shards = []
    for part in parts:
        beat = beats.get(part)
        if beat is not None and session_start is not None and beat.time < session_start - SESSION_SLACK_S:
            beat = None  # a beat of a previous run of this run id
        shards.append(_assess_shard(look, part, beat, coordinator, info, now=now, timeout_s=timeout_s,
                                    start_timeout_s=start_timeout_s, memory=memory if active else None, url=url))
    committed = latest_committed(store) if with_committed else None
    return RunView(url, run_name(url), coordinator, shards, committed, info)


def latest_committed(store: Store) -> int | None:
    """The run's latest committed step (None: none, or the store cannot be read now)."""
    try:
        steps = commit.committed_steps(store)
    except StoreError:
        return None
    return steps[-1] if steps else None


class _Look:
    """What one look reads once for every shard: the live generations (one listing of ``fences/``)
    and, per round asked about, which fragments exist (one listing of ``fragments/<round>/``)."""

    def __init__(self, store: Store):
        self.store = store
        self._live: dict[str, int] | None = None
        self._fragments: dict[int, set[str]] = {}

    def live(self, part: str) -> int:
        if self._live is None:
            self._live = commit.live_generations(self.store)
        return self._live.get(part, 0)

    def fragment_done(self, step: int, part: str, generation: int) -> bool:
        if step not in self._fragments:
            try:
                self._fragments[step] = set(self.store.list(f"fragments/{step}"))
            except StoreError:
                self._fragments[step] = set()
        return commit.fragment_key(step, part, generation) in self._fragments[step]


def _assess_shard(look: _Look, part: str, beat: Beat | None, coordinator: PartView | None,
                  info: CoordinatorInfo | None, *, now: float, timeout_s: float, start_timeout_s: float,
                  memory: Memory | None, url: str) -> PartView:
    live = look.live(part)
    coord_running = coordinator is not None and coordinator.state == "running"
    c_round = coordinator.round if coordinator is not None else None
    if beat is not None and coord_running and c_round is not None and beat.round < c_round:
        return _waiting(look, part, live, beat, coordinator, info, now=now, start_timeout_s=start_timeout_s)
    if beat is None:
        return _waiting(look, part, live, None, coordinator, info, now=now, start_timeout_s=start_timeout_s)
    view = PartView.of(part, "running", live, beat, now)
    if beat.generation < live:  # the beat is a fenced attempt's: the live generation has not beaten yet
        return _replaced(look, view, beat, coordinator, now=now, start_timeout_s=start_timeout_s,
                         memory=memory, url=url)
    if memory is not None:
        memory.saw(url, part, beat)
    if beat.status in ("finished", "failed", "fenced"):
        view.state = beat.status
        return view
    if coordinator is not None and not coord_running:
        view.state = coordinator.state if coordinator.state in ("finished", "failed") else "waiting"
        return view
    if look.fragment_done(beat.round, part, beat.generation):
        view.state = "done"  # it wrote its fragment; only its final beat is missing
        return view
    age = beat.age(now)
    if coordinator is None and age > abandoned_after(timeout_s):
        view.state = "abandoned"  # no coordinator says the run goes on, and this died long ago: leave it
        view.reason = f"no heartbeat for {age:.0f} s and no coordinator: an abandoned run, not rerun"
        return view
    # since when it has been where its beat says (its step, or its start phase): this attempt's own
    # beats only (Memory keys progress by the attempt's start), never a predecessor's
    since = memory.progress_since(url, part, beat) if memory is not None else None
    # an attempt still starting (no round_step yet: it beats round_step 0 once loaded and built) is
    # judged phase by phase (trainrun.beats.START_PHASES), each phase against the start timeout
    limit = _limit(beat, timeout_s, start_timeout_s)
    if age > limit:
        view.state = FailureKind.SILENT
        view.reason = f"no heartbeat for {age:.1f} s ({_limit_text(beat, limit)}): {_evidence(beat, now, since)}"
        view.failure_time = beat.time
        return view
    if beat.rank is not None:  # a group's rank 0 beats, another rank may not: the group is as dead
        session_start = coordinator.beat.started if coordinator is not None and coordinator.beat is not None else None
        lagging = _silent_rank(look.store, beat, now, timeout_s, start_timeout_s, session_start)
        if lagging is not None:
            view.state = FailureKind.SILENT
            view.reason = (f"no heartbeat for {lagging.age(now):.1f} s "
                           f"({_limit_text(lagging, _limit(lagging, timeout_s, start_timeout_s))}): "
                           f"{_evidence(lagging, now, None)}")
            view.failure_time = lagging.time
            return view
    since = beat.time if since is None else since
    if beat.time - since > timeout_s:
        view.state = FailureKind.STALLED
        view.reason = (f"beats but no progress for {beat.time - since:.1f} s (timeout {timeout_s:g} s): "
                       f"{_evidence(beat, now, since)}")
        view.failure_time = since
    return view


def _limit(beat: Beat, timeout_s: float, start_timeout_s: float) -> float:
    """How long ``beat`` may stay the attempt's last: while it starts, the start timeout but at
    least its phase's floor (each start phase begins with a beat: a start that goes on is never
    timed as a whole), else the timeout."""
    if beat.round_step is not None:
        return timeout_s
    return max(start_timeout_s, START_PHASE_FLOOR_S.get(start_phase(beat) or "", 0.0))


def _limit_text(beat: Beat, limit: float) -> str:
    if beat.round_step is not None:
        return f"timeout {limit:g} s"
    phase = start_phase(beat)
    return f"start timeout {limit:g} s" + (f" for its {phase} phase" if phase else "")


def _evidence(beat: Beat, now: float, since: float | None) -> str:
    """Who, where and since when: the rank, the step its last beat was at and when the step last
    advanced (``since``: the first look that saw it there; None: not known)."""
    who = (f"rank {beat.rank} of {beat.part}" if beat.rank is not None else beat.part) + f" (pid {beat.pid})"
    if beat.round_step is None:
        phase = start_phase(beat)
        where = (f"starting round {beat.round} ({phase})" if phase else
                 f"in round {beat.round}, its last beat from before its first step (loading the cut)")
        return f"{who} {where}, last beat {beat.age(now):.1f} s ago"
    moved = f", step reached {now - since:.1f} s ago" if since is not None else ""
    return (f"{who} at step {beat.round_step}/{beat.steps_per_round} of round {beat.round} (data position "
            f"{beat.step}), last beat {beat.age(now):.1f} s ago{moved}")


def _waiting(look: _Look, part: str, live: int, prior: Beat | None, coordinator: PartView | None,
             info: CoordinatorInfo | None, *, now: float, start_timeout_s: float) -> PartView:
    """No beat in this round yet (``prior``: a beat of an earlier round): waiting, done or missing."""
    view = PartView.of(part, "waiting", live, prior, now)
    coord_running = coordinator is not None and coordinator.state == "running"
    if coord_running and coordinator is not None and coordinator.round is not None and info is not None \
            and info.phase == "shards":
        c_round = coordinator.round
        waited = now - info.phase_time
        if look.fragment_done(c_round, part, live):
            view.state = "done"
        elif waited > start_timeout_s:
            view.state = FailureKind.MISSING
            view.round = c_round
            view.reason = (f"round {c_round} started {waited:.1f} s ago and {part} has not beaten in it "
                           f"(start timeout {start_timeout_s:g} s)")
            view.failure_time = info.phase_time
    elif not coord_running and coordinator is not None:
        view.state = coordinator.state if coordinator.state in ("finished", "failed") else "waiting"
    return view


def _replaced(look: _Look, view: PartView, beat: Beat, coordinator: PartView | None, *, now: float,
              start_timeout_s: float, memory: Memory | None, url: str) -> PartView:
    """A fenced attempt's beat: replaced until the live generation beats, then lost if it never does."""
    live, part = view.live, view.part
    fence = read_fence(look.store, part, live)
    since = fence.time if fence is not None and fence.time is not None else beat.time
    view.state, view.reason = "replaced", f"generation {beat.generation} was fenced; waiting for generation {live} to beat"
    seen = memory.last_seen(url, part, live) if memory is not None else None
    if seen is not None:
        since = max(since, seen)
    coord_running = coordinator is not None and coordinator.state == "running"
    if look.fragment_done(beat.round, part, live):
        view.state, view.reason = "done", None
    elif (coordinator is None or coord_running) and now - since > start_timeout_s:
        view.state = FailureKind.LOST
        view.reason = (f"generation {live} was started {now - since:.1f} s ago and never beat "
                       f"(start timeout {start_timeout_s:g} s)")
        view.failure_time = since
    return view


def _silent_rank(store: Store, beat: Beat, now: float, timeout_s: float, start_timeout_s: float,
                 session_start: float | None) -> Beat | None:
    """The stalest other rank of ``beat``'s group attempt (same generation and attempt, running, of
    this session: a dead session's attempt had the same numbers) silent longer than its limit (each
    rank starts on its own, and rank 0 may be done first); None otherwise. One listing and a read per rank."""
    ranks = [b for r, b in read_rank_heartbeats(store, beat.part).items() if r != 0 and b.status == "running"
             and (b.generation, b.attempt) == (beat.generation, beat.attempt)
             and (session_start is None or b.time >= session_start - SESSION_SLACK_S)]
    silent = [b for b in ranks if b.age(now) > _limit(b, timeout_s, start_timeout_s)]
    return min(silent, key=lambda b: b.time, default=None)


def superseded(store: Store, part: str, round_no: int, generation: int, live: int | None = None) -> int | None:
    """The live generation if it is newer than ``generation`` and has written its fragment of ``round_no``:
    the training flow then stops waiting for the attempt of ``generation`` (it may never return).
    ``live``: the part's live generation when the caller has just read it (``commit.live_generations``:
    one listing for all shards), else it is read here."""
    live = commit.live_generation(store, part) if live is None else live
    if live > generation and store.exists(commit.fragment_key(round_no, part, live)):
        return live
    return None
