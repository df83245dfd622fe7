"""The watchdog as a state machine, without Prefect: find runs, judge them, fence the dead, ask for reruns.

``flows/watchdog.py`` is the Prefect flow around this (logs, events, artifacts, the rerun as a
``train-shard`` task run, the resume as a deployment run); ``docs/watchdog.md`` is the user's view.

Who calls what
--------------
::

    wd = Watchdog(url, storage_options, timeout_s=30, rerun=submit, resume=start_again, by="watchdog@host")
    while ...:
        for decision in wd.poll():      # one look at every run under url; fences and reruns happen inside
            publish(decision)           # (log line, Prefect event, artifact)
        wd.rerun_done(key, ok)          # when a rerun the watchdog asked for has ended
        time.sleep(poll_s)

What it does with a dead shard (``judge`` says who is dead)
------------------------------------------------------------
``fence``: ``commit.fence(part, live + 1, ...)``, put-if-absent: of several watchdogs exactly one
wins; a loser does nothing more (``lost-race``). The fence document (a ``Fence``) records why,
when, by whom, the dead attempt's last beat and the detection latency. Then the winner calls
``rerun(request)`` with a ``RerunRequest`` (``rerun.plan_rerun``: the run's cut, a trusted spec,
its settings, ``attempt_offset``). The rerun's own first beat is then reported as ``running-again``
(time from failure to the shard running again, steps lost). A shard that cannot be rerun here (no
cut known, a workload the watchdog does not trust) is reported as ``cannot-rerun`` and not fenced.

A dead run (the coordinator silent) is reported once across watchdogs (``watchdog/run-dead-<id>.json``,
put-if-absent), its shards are left alone (their reruns would have nobody to gather them), and
``resume(decision)`` is asked to start it again (the flow does that when it came from a deployment).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import Any

from ckptlib import Checkpointer, commit
from ckptlib.errors import StoreError
from ckptlib.heartbeat import read_heartbeat
from ckptlib.store import Store

from ..chaos import Strike, parse_chaos, read_strike
from ..failures import FailureKind
from ..layout import COORDINATOR, child_url, find_runs, run_dead_key, run_name, shard_index
from ..results import ShardResult
from ..resume import stored_config
from ..resume_point import resume_point
from ..spec import RunSpec
from .decisions import Decision, Fence, Kind, RerunInfo, Resumed
from .judge import DEFAULT_TIMEOUT_S, PartView, RunView, assess_run, latest_committed, start_timeout_for
from .memory import Memory
from .rerun import RerunRefused, RerunRequest, plan_rerun

log = logging.getLogger("trainrun.watchdog")

MAX_RERUNS = 3  # per part and round: a rerun that keeps dying is reported, not retried forever


def watchdog_name() -> str:
    return f"watchdog@{socket.gethostname()}:{os.getpid()}"


class Watchdog:
    """Looks at every run under ``url`` on each ``poll()``; fences dead shards and asks for reruns.

    ``rerun(request) -> key`` starts a rerun (the flow submits a ``train-shard`` task) and returns a
    key the caller later passes to ``rerun_done``; None = fence only (an external actor reruns).
    ``resume(decision) -> Resumed | None`` restarts a dead run (None = report only).
    ``specs`` maps a run's URL to its spec as this process knows it; ``allow_workloads`` lists the
    ``module:factory`` workloads a spec read from the store may name (``rerun.py``). ``by`` names this
    watchdog in fences and decisions; ``by_flow_run_id`` is its Prefect flow run (fences link to it).
    ``since``: beats written before this wall time are ignored (``judge.assess_run``): the watchdog
    beside one session of a run, which must not take a dead predecessor for its own run.
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 start_timeout_s: float | None = None, coordinator_timeout_s: float | None = None,
                 rerun: Callable[[RerunRequest], Any] | None = None,
                 resume: Callable[[Decision], Resumed | None] | None = None,
                 specs: Mapping[str, RunSpec] | None = None, allow_workloads: Collection[str] = (),
                 by: str | None = None, by_flow_run_id: str | None = None, discover_every_s: float = 15.0,
                 clock: Callable[[], float] = time.time, since: float | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = url
        self.root = Store.from_url(url, storage_options)
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = start_timeout_for(timeout_s) if start_timeout_s is None else float(start_timeout_s)
        self.coordinator_timeout_s = self.timeout_s if coordinator_timeout_s is None else float(coordinator_timeout_s)
        self.rerun, self.resume = rerun, resume
        self.specs = {u.rstrip("/"): s.trajectory() for u, s in (specs or {}).items()}
        self.allow_workloads = frozenset(allow_workloads)
        self.by = by or watchdog_name()
        self.by_flow_run_id = by_flow_run_id
        self.discover_every_s = discover_every_s
        self.clock = clock
        self.since = since
        self.memory = Memory()
        self.runs: dict[str, Store] = {}
        self.views: dict[str, RunView] = {}
        self.decisions: list[Decision] = []
        self._discovered_at = float("-inf")
        self._recovering: dict[tuple[str, str], Decision] = {}  # (run url, part) -> fence decision awaiting a beat
        self._reruns: dict[Any, Decision] = {}  # rerun key -> fence decision
        self._reran: dict[tuple[str, str, int], int] = {}  # (run url, part, round) -> reruns so far

    # --- the look ----------------------------------------------------------------------------------

    def discover(self) -> list[str]:
        if self.clock() - self._discovered_at >= self.discover_every_s or not self.runs:
            self._discovered_at = self.clock()
            for prefix in find_runs(self.root):
                url = child_url(self.url, prefix)
                if url not in self.runs:
                    self.runs[url] = self.root.child(prefix) if prefix else self.root
        return list(self.runs)

    def poll(self) -> list[Decision]:
        """One look at every run; returns the decisions it made (also kept in ``decisions``)."""
        out: list[Decision] = []
        for url in self.discover():
            try:
                if not self._settled(url, self.runs[url]):
                    out += self._poll_run(url, self.runs[url])
            except Exception as e:  # noqa: BLE001 - one unreadable run must not blind the watchdog to the others
                log.warning("watchdog: cannot judge run %s: %s: %s", url, type(e).__name__, e)
        self.decisions += out
        return out

    def active(self) -> bool:
        """Whether any watched run is still running (or a rerun is in flight)."""
        return bool(self._reruns) or any(v.state in ("running", "unknown") and not _all_settled(v)
                                         for v in self.views.values())

    def _settled(self, url: str, store: Store) -> bool:
        """A run that had finished, failed or died at the last look, and whose coordinator has not
        beaten since, costs one read per look (a store root holds many finished runs)."""
        prev = self.views.get(url)
        c = prev.coordinator if prev is not None else None
        if c is None or c.state not in ("finished", "failed", "dead") or any(k[0] == url for k in self._recovering):
            return False
        beat = read_heartbeat(store, COORDINATOR)
        return beat is not None and c.beat is not None and (beat.time, beat.status) == (c.beat.time, c.beat.status)

    def _poll_run(self, url: str, store: Store) -> list[Decision]:
        now = self.clock()
        view = assess_run(store, url, timeout_s=self.timeout_s, start_timeout_s=self.start_timeout_s,
                          coordinator_timeout_s=self.coordinator_timeout_s, now=now, memory=self.memory,
                          with_committed=False, since=self.since)  # a look must not grow with the run's history
        self.views[url] = view
        out = self._running_again(url, view)
        if view.coordinator is not None and view.coordinator.state == "dead":
            return out + self._run_dead(url, store, view)
        if view.coordinator is not None and view.coordinator.state != "running":
            return out
        for pv in view.shards:
            if pv.dead:
                out += self._shard_dead(url, store, view, pv, now)
        return out

    # --- a dead shard ------------------------------------------------------------------------------

    def _shard_dead(self, url: str, store: Store, view: RunView, pv: PartView, now: float) -> list[Decision]:
        request = None
        if self.rerun is not None:
            try:
                request = plan_rerun(view, pv, known=self.specs.get(url.rstrip("/")), allowed=self.allow_workloads,
                                     committed_config=lambda: _committed_config(store))
            except RerunRefused as e:  # reported once, and the shard is left as it is
                if not self.memory.first_time("cannot-rerun", url, pv.part, pv.round):
                    return []
                return [self._decision("cannot-rerun", url, pv, now, reason=f"{pv.reason}; cannot rerun it: {e}")]
            rkey = (url, pv.part, request.round)
            if self._reran.get(rkey, 0) >= MAX_RERUNS:
                if not self.memory.first_time("gave-up", *rkey):
                    return []
                return [self._decision("gave-up", url, pv, now, reason=f"{pv.reason}; {MAX_RERUNS} reruns of "
                                       f"round {request.round} already died: giving up on {pv.part}")]
        new_gen = pv.live + 1
        decision = self._decision("fenced", url, pv, now, generation=new_gen)
        # what the rerun continues from: the dead generation's newest shard checkpoint, looked up
        # BEFORE the fence exists, so nothing it writes after the fence (a zombie's) is ever used
        resume = resume_point(store, pv.part, pv.round, pv.live) if pv.round is not None else None
        if resume is not None and decision.steps_lost is not None:
            decision = replace(decision, steps_lost=max(0, decision.steps_lost - resume.round_step))
        won = commit.fence(store, pv.part, new_gen, reason=decision.reason or pv.state, by=self.by,
                           details={**Fence.details(decision, rerun=request is not None),
                                    "by_flow_run_id": self.by_flow_run_id,
                                    "resume": resume.to_dict() if resume is not None else None})
        if not won:
            return [replace(decision, kind="lost-race", reason=f"{pv.reason}; generation {new_gen} was already "
                            "fenced by another watchdog: nothing to do")]
        decision = replace(decision, won=True)
        if request is None:
            return [decision]
        attempt = pv.attempt or 1
        # a lost rerun never beat: its attempt number is the one after the dead attempt's
        request = replace(request, generation=new_gen,
                          attempt_offset=attempt if pv.state != FailureKind.LOST else attempt + 1)
        self._reran[(url, pv.part, request.round)] = self._reran.get((url, pv.part, request.round), 0) + 1
        try:
            key = self.rerun(request)  # type: ignore[misc]  # not None: checked above
        except Exception as e:  # noqa: BLE001
            return [decision, self._decision("rerun-failed", url, pv, now, generation=new_gen,
                                             reason=f"could not start the rerun: {type(e).__name__}: {e}")]
        decision = replace(decision, rerun=RerunInfo(request.shard, request.round, request.attempt_offset))
        self._recovering[(url, pv.part)] = decision
        if key is not None:
            self._reruns[key] = decision
        return [decision]

    def rerun_done(self, key: Any, ok: bool, error: str | None = None,
                   result: ShardResult | None = None) -> list[Decision]:
        """The rerun started for ``key`` has ended (``ok``: its fragment is written, or it was fenced);
        ``result`` is the shard task's (its ``seconds["total"]`` dates the start when no look saw it run)."""
        fence = self._reruns.pop(key, None)
        if fence is None:
            return []
        out: list[Decision] = []
        recovering = (fence.run_url, fence.part)
        if self._recovering.get(recovering) is fence:
            total = result.seconds.get("total") if result is not None else None
            if ok and result is not None and total is not None:
                del self._recovering[recovering]
                out.append(self._again(fence, self.clock() - float(total), result.attempt,
                                       "dated from the rerun's own duration"))
        if not ok:
            out.append(replace(fence, kind="rerun-failed", detected=self.clock(),
                               reason=f"the rerun of {fence.part} round {fence.round} (generation "
                                      f"{fence.generation}) failed: {error}"))
        self.decisions += out
        return out

    def _running_again(self, url: str, view: RunView) -> list[Decision]:
        out = []
        for pv in view.shards:
            fence = self._recovering.get((url, pv.part))
            beat = pv.beat
            if fence is None or beat is None or fence.generation is None or beat.generation < fence.generation:
                continue
            if beat.round != fence.round and any(f is fence for f in self._reruns.values()):
                continue  # a later round already: the rerun's end (rerun_done) dates its start
            del self._recovering[(url, pv.part)]
            out.append(self._again(fence, beat.started or beat.time, beat.attempt, "seen beating"))
        return out

    def _again(self, fence: Decision, started: float, attempt: Any, how: str) -> Decision:
        failed_at = fence.strike_time or fence.failure_time
        return replace(fence, kind="running-again", running_again_time=started,
                       running_again_s=round(started - failed_at, 3), restart_s=round(started - fence.detected, 3),
                       reason=f"{fence.part} generation {fence.generation} runs again (attempt {attempt}, {how}), "
                              f"{started - failed_at:.1f} s after the failure; {fence.steps_lost} steps to redo")

    # --- a dead run --------------------------------------------------------------------------------

    def _run_dead(self, url: str, store: Store, view: RunView) -> list[Decision]:
        c = view.coordinator
        assert c is not None
        info = view.info
        ident = (info.flow_run_id if info else None) or str(int(c.beat.started if c.beat else 0))
        if not self.memory.first_time("run-dead", url, ident):
            return []
        d = replace(self._decision("run-dead", url, c, self.clock()),
                    flow_run_id=info.flow_run_id if info else None, deployment_id=info.deployment_id if info else None,
                    committed=latest_committed(store), run_id=(info.run_id if info else "") or view.run)
        try:
            first = store.put_if_absent(run_dead_key(ident), d.to_json())
        except StoreError as e:
            log.warning("watchdog: could not record the death of %s: %s", url, e)
            first = True
        if not first:
            return []  # another watchdog reported it (and resumed it if it could)
        out = [d]
        if self.resume is not None:
            try:
                started = self.resume(d)
            except Exception as e:  # noqa: BLE001
                out.append(replace(d, kind="resume-failed", reason=f"could not start the run again: {type(e).__name__}: {e}"))
            else:
                if started is not None:
                    out.append(replace(d, kind="resumed", reason=started.reason, resumed=started))
        return out

    # --- decisions ---------------------------------------------------------------------------------

    def _decision(self, kind: Kind, url: str, pv: PartView, now: float, *, generation: int | None = None,
                  reason: str | None = None) -> Decision:
        failure_time = pv.failure_time if pv.failure_time is not None else now
        d = Decision(kind=kind, run=run_name(url), run_url=url, part=pv.part, shard=shard_index(pv.part),
                     state=pv.state, reason=reason or pv.reason, round=pv.round, step=pv.step,
                     round_step=pv.round_step, steps_per_round=pv.steps_per_round, dead_generation=pv.generation,
                     dead_attempt=pv.attempt, generation=generation, last_beat=pv.beat.time if pv.beat else None,
                     failure_time=failure_time, detected=now, detection_latency_s=round(now - failure_time, 3),
                     steps_lost=(pv.round_step or 0) if pv.state in (FailureKind.SILENT, FailureKind.STALLED) else 0,
                     by=self.by)
        store = self.runs.get(url)
        if store is not None and pv.round is not None and pv.attempt is not None and shard_index(pv.part) is not None:
            strike = read_strike(store, pv.part, pv.round, pv.attempt)
            if strike is not None:  # a chaos drill: the true moment, step and rank of the failure
                d = replace(d, strike_time=strike.time, strike_kind=strike.kind,
                            strike_latency_s=round(now - strike.time, 3), steps_lost=strike.round_step,
                            reason=f"{d.reason}; {struck(strike, pv.steps_per_round, now)}")
        return d


def struck(strike: Strike, steps_per_round: int | None, now: float) -> str:
    """What a drill's strike says of the failure: its kind, the rank it hit and the true step (the
    last beat may be older: beats are written every few seconds, steps every few milliseconds)."""
    try:
        rank = parse_chaos(strike.spec).rank
    except ValueError:
        rank = None
    who = f"rank {rank} of {strike.part}" if rank is not None else strike.part
    return (f"the drill's {strike.kind} struck {who} at step {strike.round_step}/{steps_per_round} "
            f"{now - strike.time:.1f} s ago")


def _all_settled(view: RunView) -> bool:
    return view.coordinator is None and all(p.state in ("finished", "failed", "fenced", "done", "abandoned")
                                            for p in view.shards)


def _committed_config(store: Store) -> dict | None:
    steps = commit.committed_steps(store)
    if not steps:
        return None
    with Checkpointer(store) as ck:
        return stored_config(ck, steps[-1])
