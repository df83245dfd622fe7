"""The watchdog's logic, without Prefect: find runs, judge their heartbeats, fence the dead, ask for reruns.

``flows/watchdog.py`` is the Prefect flow around this (logs, events, artifacts, the rerun as a
``train-shard`` task run, the resume as a deployment run); ``ckpt status`` uses ``assess_run`` for
its table; the training flow uses ``CoordinatorBeat`` and ``wait_for_shards``. ``docs/watchdog.md``
is the user's view.

Who calls what
--------------
::

    wd = Watchdog(url, storage_options, timeout_s=30, rerun=submit, resume=start_again, by="watchdog@host")
    while ...:
        for decision in wd.poll():      # one look at every run under url; fences and reruns happen inside
            publish(decision)           # (log line, Prefect event, artifact)
        wd.rerun_done(key, ok)          # when a rerun the watchdog asked for has ended
        time.sleep(poll_s)

What counts as dead (one shard attempt, judged from ``heartbeats/<part>.json`` and the fences)
---------------------------------------------------------------------------------------------
``silent``   its last beat (status running) is older than ``timeout_s``;
``stalled``  it beats, but its step has not changed for ``timeout_s`` (needs a watchdog that has
             looked at it before: memory of the first beat with that step);
``lost``     it was fenced and rerun, and the new generation has not beaten for ``start_timeout_s``
             after the fence (the rerun never started: e.g. the watchdog that fenced died);
``missing``  the coordinator has been waiting for this round's shards for ``start_timeout_s`` and this
             shard never beat in it (the task never started).
An attempt whose fragment for its round is already written is done, whatever its beat says. A beat
older than the coordinator's session (a previous run of the same run id) is ignored. In a run
without a coordinator beat (ckptlib used directly), a shard silent for ``abandoned_after(timeout)``
(10 x timeout, at least 10 minutes) is ``abandoned``, not dead: nobody would gather its rerun.

The run as a whole is dead when the coordinator (``heartbeats/coordinator.json``, beaten by the
training flow from a thread every ``heartbeat_every_s``) is silent for ``coordinator_timeout_s``:
then its shards are left alone (their reruns would have nobody to gather them), the death is
reported once (``watchdog/run-dead-<key>.json``, put-if-absent: one report across watchdogs), and
``resume`` is asked to start it again (the flow does that when the run came from a deployment).

What the watchdog does with a dead shard
----------------------------------------
``fence``: ``commit.fence(part, live + 1, ...)``, put-if-absent: of several watchdogs exactly one
wins; a loser does nothing more (the decision says ``won: False``). The fence document records
why, when, by whom, the dead attempt's last beat and the detection latency. Then the winner calls
``rerun(request)`` with everything the shard task needs (run URL, spec, shard, round, the cut it
starts from, heartbeat settings, chaos specs, ``attempt_offset``). The rerun's own first beat is
then reported as ``running-again`` (time from failure to the shard running again, steps lost).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ckptlib import commit
from ckptlib.errors import FencedError, ObjectNotFound, StoreError
from ckptlib.heartbeat import Heartbeat, read_heartbeats
from ckptlib.store import Store

log = logging.getLogger("tasks.watchdog")

COORDINATOR = "coordinator"
DEFAULT_TIMEOUT_S = 30.0  # the default workload beats every 2 s and steps every few ms: 15 beats missed
DEFAULT_POLL_S = 2.0
DEAD_STATES = ("silent", "stalled", "lost", "missing")
MAX_RERUNS = 3  # per part and round: a rerun that keeps dying is reported, not retried forever


def start_timeout_for(timeout_s: float) -> float:
    """How long a task may take to start (first beat) before it counts as never started."""
    return max(2 * timeout_s, timeout_s + 30.0)


def abandoned_after(timeout_s: float) -> float:
    """A shard of a run without a coordinator beat, silent this long, belongs to an abandoned run."""
    return max(10 * timeout_s, 600.0)


def watchdog_name() -> str:
    return f"watchdog@{socket.gethostname()}:{os.getpid()}"


# --- runs under a URL --------------------------------------------------------------------------------

def is_run(store: Store) -> bool:
    """A run is a prefix holding ``heartbeats/`` or ``manifests/``."""
    return bool(store.list("heartbeats")) or bool(store.list("manifests"))


def subfolders(store: Store) -> list[str]:
    """Names of the folders directly under the store's root (one non-recursive listing)."""
    from ckptlib.store import LocalStore, MemoryStore, S3Store

    if isinstance(store, LocalStore):
        try:
            return sorted(e.name for e in os.scandir(store.root) if e.is_dir() and not e.name.startswith("."))
        except FileNotFoundError:
            return []
    if isinstance(store, S3Store):
        prefix = f"{store.prefix}/" if store.prefix else ""
        names, token = [], {}
        try:
            while True:
                page = store.fs.call_s3("list_objects_v2", Bucket=store.bucket, Prefix=prefix, Delimiter="/", **token)
                names += [p["Prefix"][len(prefix):].strip("/") for p in page.get("CommonPrefixes", [])]
                if not page.get("IsTruncated"):
                    break
                token = {"ContinuationToken": page["NextContinuationToken"]}
        except Exception as e:
            raise StoreError(f"cannot list the folders of {store.url}: {e}") from e
        return sorted(n for n in names if n)
    if isinstance(store, MemoryStore):
        try:
            entries = store.fs.ls(store.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")
    return sorted({k.split("/", 1)[0] for k in store.list() if "/" in k})


def find_runs(url: str, storage_options: dict | None = None, store: Store | None = None) -> list[str]:
    """``url`` itself when it is a run, else the runs directly under it (``<url>/<run id>``)."""
    store = store or Store.from_url(url, storage_options)
    if is_run(store):
        return [url]
    return [f"{url.rstrip('/')}/{name}" for name in subfolders(store) if is_run(store.child(name))]


def run_name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


# --- the coordinator's heartbeat (written by the training flow) ---------------------------------------

class CoordinatorBeat:
    """``heartbeats/coordinator.json`` of a training run, every ``every_s`` from a daemon thread.

    The flow calls ``update(round=..., phase=..., source=...)`` as it goes (written at once) and
    ``finish("finished" | "failed")`` at the end. ``meta`` carries what a watchdog needs to rerun a
    shard and to restart the run: the spec, the cut each round starts from, heartbeat settings,
    chaos specs, the Prefect flow run and deployment ids. A thread, unlike the shards' in-loop beats:
    the coordinator mostly waits (for shard tasks, for fragments), and what matters is that its
    process and flow run are alive."""

    def __init__(self, store: Store, *, every_s: float, meta: dict[str, Any], round: int = 0):
        self.store = store
        generation = commit.live_generation(store, COORDINATOR)
        self.hb = Heartbeat(store, COORDINATOR, generation=generation, round=round, every_s=every_s,
                            meta={"phase": "setup", "phase_time": time.time(), **meta})
        self.every_s = every_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-coordinator-beat", daemon=True)

    def start(self) -> "CoordinatorBeat":
        self.hb.start(step=self.hb.round)
        self._thread.start()
        return self

    def update(self, *, round: int | None = None, **meta: Any) -> None:
        with self._lock:
            if round is not None:
                self.hb.round = int(round)
            if "phase" in meta:
                meta.setdefault("phase_time", time.time())
            self.hb.meta.update(meta)
            self._beat(force=True)

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

    def finish(self, status: str = "finished", **extra: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            self.hb.meta.update(phase="done", phase_time=time.time())
            self.hb.finish(status, **extra)


# --- judging one run ---------------------------------------------------------------------------------

@dataclass
class PartView:
    """The watchdog's view of one part (a shard or the coordinator) at one look."""

    part: str
    state: str  # running | finished | failed | fenced | replaced | waiting | done | silent | stalled | lost | missing | dead
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
    doc: dict | None = field(default=None, repr=False)

    @property
    def dead(self) -> bool:
        return self.state in DEAD_STATES

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("doc")
        return d


@dataclass
class RunView:
    url: str
    run: str
    coordinator: PartView | None
    shards: list[PartView]
    committed: int | None = None  # latest committed step

    @property
    def state(self) -> str:
        """running | finished | failed | dead | unknown (no coordinator beat)."""
        if self.coordinator is None:
            return "unknown"
        return self.coordinator.state


def _fresh_beat(doc: dict | None, session_start: float | None) -> dict | None:
    """The beat, unless it is older than the coordinator's session (a previous run of the run id)."""
    if doc is None:
        return None
    if session_start is not None and float(doc.get("time") or 0) < session_start - 1.0:
        return None
    return doc


def _beat_fields(doc: dict) -> dict[str, Any]:
    return {k: doc.get(k) for k in ("generation", "status", "round", "step", "round_step", "steps_per_round",
                                   "attempt", "pid", "host")}


def assess_run(store: Store, url: str, *, timeout_s: float, start_timeout_s: float | None = None,
               coordinator_timeout_s: float | None = None, now: float | None = None,
               memory: dict | None = None) -> RunView:
    """Judge every part of one run (see the module docstring). ``memory`` (a dict the caller keeps
    between looks) enables ``stalled``; without it only silence counts."""
    now = time.time() if now is None else now
    start_timeout_s = start_timeout_for(timeout_s) if start_timeout_s is None else start_timeout_s
    coordinator_timeout_s = timeout_s if coordinator_timeout_s is None else coordinator_timeout_s
    beats = read_heartbeats(store)
    cdoc = beats.pop(COORDINATOR, None)
    coordinator = None
    session_start = None
    cmeta: dict[str, Any] = {}
    if cdoc is not None:
        session_start = float(cdoc.get("started") or 0) or None
        cmeta = cdoc.get("meta") or {}
        age = now - float(cdoc.get("time") or 0)
        status = cdoc.get("status")
        state = status if status in ("finished", "failed") else "running"
        reason = None
        if status == "running" and age > coordinator_timeout_s:
            state, reason = "dead", f"the coordinator has not beaten for {age:.1f} s (timeout {coordinator_timeout_s:g} s)"
        coordinator = PartView(COORDINATOR, state, live=int(cdoc.get("generation") or 0), age_s=age, reason=reason,
                               failure_time=float(cdoc.get("time") or 0) if state == "dead" else None, doc=cdoc,
                               **_beat_fields(cdoc))
    spec = cmeta.get("spec") or {}
    n = spec.get("shards")
    parts = [f"shard-{i}" for i in range(int(n))] if n else sorted(beats, key=lambda p: (len(p), p))
    shards = []
    active = coordinator is None or coordinator.state == "running"
    for part in parts:
        doc = _fresh_beat(beats.get(part), session_start)
        shards.append(_assess_shard(store, part, doc, coordinator, cmeta, now=now, timeout_s=timeout_s,
                                    start_timeout_s=start_timeout_s, memory=memory if active else None,
                                    url=url))
    committed = None
    try:
        steps = commit.committed_steps(store)
        committed = steps[-1] if steps else None
    except StoreError:
        pass
    return RunView(url, run_name(url), coordinator, shards, committed)


def _assess_shard(store: Store, part: str, doc: dict | None, coordinator: PartView | None, cmeta: dict, *,
                  now: float, timeout_s: float, start_timeout_s: float, memory: dict | None, url: str) -> PartView:
    live = commit.live_generation(store, part)
    coord_running = coordinator is not None and coordinator.state == "running"
    c_round = coordinator.round if coordinator is not None else None
    if doc is not None and coord_running and c_round is not None and doc.get("round") is not None \
            and int(doc["round"]) < int(c_round):
        prior = doc  # a beat of an earlier round: this round has not started here yet
        doc = None
    else:
        prior = None
    if doc is None:
        view = PartView(part, "waiting", live)
        if prior is not None:
            view = PartView(part, "waiting", live, age_s=now - float(prior.get("time") or 0), doc=prior,
                            **_beat_fields(prior))
        if coord_running and cmeta.get("phase") == "shards":
            waited = now - float(cmeta.get("phase_time") or now)
            if _fragment_done(store, int(c_round), part, live):
                view.state = "done"
            elif waited > start_timeout_s:
                view.state = "missing"
                view.round = int(c_round)
                view.reason = (f"round {c_round} started {waited:.1f} s ago and {part} has not beaten in it "
                               f"(start timeout {start_timeout_s:g} s)")
                view.failure_time = float(cmeta.get("phase_time") or now)
        elif not coord_running and coordinator is not None:
            view.state = coordinator.state if coordinator.state in ("finished", "failed") else "waiting"
        return view
    view = PartView(part, "running", live, age_s=now - float(doc.get("time") or 0), doc=doc, **_beat_fields(doc))
    gen = int(doc.get("generation") or 0)
    status = doc.get("status")
    if gen < live:  # the beat is a fenced attempt's: the live generation has not beaten yet
        fence = commit.read_fence(store, part, live) or {}
        since = float(fence.get("time") or doc.get("time") or now)
        view.state, view.reason = "replaced", f"generation {gen} was fenced; waiting for generation {live} to beat"
        if memory is not None:
            seen = memory.get(("beat", url, part, live))
            if seen is not None:
                since = max(since, seen)
        if doc.get("round") is not None and _fragment_done(store, int(doc["round"]), part, live):
            view.state, view.reason = "done", None
        elif (coordinator is None or coord_running) and now - since > start_timeout_s:
            view.state = "lost"
            view.reason = (f"generation {live} was started {now - since:.1f} s ago and never beat "
                           f"(start timeout {start_timeout_s:g} s)")
            view.failure_time = since
        return view
    if memory is not None:
        memory[("beat", url, part, gen)] = float(doc.get("time") or now)
    if status in ("finished", "failed", "fenced"):
        view.state = status
        return view
    if coordinator is not None and not coord_running:
        view.state = coordinator.state if coordinator.state in ("finished", "failed") else "waiting"
        return view
    if doc.get("round") is not None and _fragment_done(store, int(doc["round"]), part, gen):
        view.state = "done"  # it wrote its fragment; only its final beat is missing
        return view
    beat_time = float(doc.get("time") or 0)
    if coordinator is None and view.age_s > abandoned_after(timeout_s):
        view.state = "abandoned"  # no coordinator says the run goes on, and this died long ago: leave it
        view.reason = f"no heartbeat for {view.age_s:.0f} s and no coordinator: an abandoned run, not rerun"
        return view
    if view.age_s > timeout_s:
        view.state = "silent"
        view.reason = f"no heartbeat for {view.age_s:.1f} s (timeout {timeout_s:g} s) {_where(doc)}"
        view.failure_time = beat_time
        return view
    if memory is not None:
        key = ("progress", url, part, gen, doc.get("attempt"), doc.get("round"))
        step = doc.get("step")
        first = memory.get(key)
        if first is None or first[0] != step:
            memory[key] = (step, beat_time)
        elif beat_time - first[1] > timeout_s:
            view.state = "stalled"
            view.reason = f"beats but no progress for {beat_time - first[1]:.1f} s (timeout {timeout_s:g} s) {_where(doc)}"
            view.failure_time = first[1]
    return view


def _where(doc: dict) -> str:
    if doc.get("round_step") is None:
        return f"in round {doc.get('round')}, its last beat from before its first step (loading the cut)"
    return f"at step {doc.get('round_step')}/{doc.get('steps_per_round')} of round {doc.get('round')}"


def _fragment_done(store: Store, step: int, part: str, generation: int) -> bool:
    try:
        return store.exists(commit.fragment_key(step, part, generation))
    except StoreError:
        return False


# --- the watchdog ------------------------------------------------------------------------------------

Decision = dict  # JSON: see Watchdog._decision


class Watchdog:
    """Looks at every run under ``url`` on each ``poll()``; fences dead shards and asks for reruns.

    ``rerun(request) -> key`` starts a rerun (the flow submits a ``train-shard`` task) and returns a
    key the caller later passes to ``rerun_done``; None = fence only (an external actor reruns).
    ``resume(decision) -> dict | None`` restarts a dead run (None = report only).
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 start_timeout_s: float | None = None, coordinator_timeout_s: float | None = None,
                 rerun: Callable[[dict], Any] | None = None, resume: Callable[[dict], dict | None] | None = None,
                 by: str | None = None, discover_every_s: float = 15.0, clock: Callable[[], float] = time.time):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = url
        self.storage_options = storage_options
        self.root = Store.from_url(url, storage_options)
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = start_timeout_for(timeout_s) if start_timeout_s is None else float(start_timeout_s)
        self.coordinator_timeout_s = self.timeout_s if coordinator_timeout_s is None else float(coordinator_timeout_s)
        self.rerun, self.resume = rerun, resume
        self.by = by or watchdog_name()
        self.discover_every_s = discover_every_s
        self.clock = clock
        self.memory: dict = {}
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
            for url in find_runs(self.url, self.storage_options, store=self.root):
                if url not in self.runs:
                    self.runs[url] = self.root if url == self.url else self.root.child(url[len(self.url.rstrip("/")) + 1:])
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
        from ckptlib.heartbeat import read_heartbeat

        doc = read_heartbeat(store, COORDINATOR)
        return doc is not None and c.doc is not None and (doc.get("time"), doc.get("status")) == (
            c.doc.get("time"), c.doc.get("status"))

    def _poll_run(self, url: str, store: Store) -> list[Decision]:
        now = self.clock()
        view = assess_run(store, url, timeout_s=self.timeout_s, start_timeout_s=self.start_timeout_s,
                          coordinator_timeout_s=self.coordinator_timeout_s, now=now, memory=self.memory)
        self.views[url] = view
        out: list[Decision] = []
        out += self._running_again(url, view)
        if view.coordinator is not None and view.coordinator.state == "dead":
            out += self._run_dead(url, store, view)
            return out
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
                request = rerun_request(url, store, view, pv, storage_options=self.storage_options)
            except Exception as e:  # noqa: BLE001 - reported, and the shard is left as it is
                key = ("no-recipe", url, pv.part, pv.round)
                if key not in self.memory:
                    self.memory[key] = True
                    return [self._decision("cannot-rerun", url, pv, now, reason=f"{pv.reason}; cannot rerun it: {e}")]
                return []
            rkey = (url, pv.part, int(request["round"]))
            if self._reran.get(rkey, 0) >= MAX_RERUNS:
                mkey = ("gave-up",) + rkey
                if mkey not in self.memory:
                    self.memory[mkey] = True
                    return [self._decision("gave-up", url, pv, now, reason=f"{pv.reason}; {MAX_RERUNS} reruns of "
                                           f"round {request['round']} already died: giving up on {pv.part}")]
                return []
        new_gen = pv.live + 1
        decision = self._decision("fenced", url, pv, now, generation=new_gen)
        details = {k: decision[k] for k in ("state", "dead_generation", "dead_attempt", "round", "step", "round_step",
                                            "steps_per_round", "last_beat", "failure_time", "detected",
                                            "detection_latency_s", "run")}
        details["rerun"] = request is not None
        won = commit.fence(store, pv.part, new_gen, reason=pv.reason or pv.state, by=self.by, details=details)
        if not won:
            decision["kind"] = "lost-race"
            decision["reason"] = f"{pv.reason}; generation {new_gen} was already fenced by another watchdog: nothing to do"
            return [decision]
        decision["won"] = True
        out = [decision]
        if request is None:
            return out
        request["generation"] = new_gen
        request["attempt_offset"] = int(pv.attempt or 1) if pv.state != "lost" else int(pv.attempt or 1) + 1
        self._reran[(url, pv.part, int(request["round"]))] = self._reran.get((url, pv.part, int(request["round"])), 0) + 1
        try:
            key = self.rerun(request)
        except Exception as e:  # noqa: BLE001
            out.append(self._decision("rerun-failed", url, pv, now, generation=new_gen,
                                      reason=f"could not start the rerun: {type(e).__name__}: {e}"))
            return out
        decision["rerun"] = {k: request[k] for k in ("shard", "round", "attempt_offset")}
        self._recovering[(url, pv.part)] = decision
        if key is not None:
            self._reruns[key] = decision
        return out

    def rerun_done(self, key: Any, ok: bool, error: str | None = None,
                   result: dict | None = None) -> list[Decision]:
        """The rerun started for ``key`` has ended (``ok``: its fragment is written, or it was fenced);
        ``result`` is the shard task's (its ``seconds.total`` dates the start when no look saw it run)."""
        fence = self._reruns.pop(key, None)
        if fence is None:
            return []
        out: list[Decision] = []
        recovering = (fence["run_url"], fence["part"])
        if self._recovering.get(recovering) is fence:
            total = ((result or {}).get("seconds") or {}).get("total")
            if ok and total is not None:
                del self._recovering[recovering]
                now = self.clock()
                out.append(self._again(fence, now - float(total), (result or {}).get("attempt"),
                                       "dated from the rerun's own duration"))
        if not ok:
            out.append(dict(fence, kind="rerun-failed", detected=self.clock(),
                            reason=f"the rerun of {fence['part']} round {fence['round']} (generation "
                                   f"{fence['generation']}) failed: {error}"))
        self.decisions += out
        return out

    def _running_again(self, url: str, view: RunView) -> list[Decision]:
        out = []
        for pv in view.shards:
            fence = self._recovering.get((url, pv.part))
            doc = pv.doc
            if fence is None or doc is None or int(doc.get("generation") or 0) < fence["generation"]:
                continue
            if doc.get("round") != fence["round"] and any(f is fence for f in self._reruns.values()):
                continue  # a later round already: the rerun's end (rerun_done) dates its start
            del self._recovering[(url, pv.part)]
            out.append(self._again(fence, float(doc.get("started") or doc.get("time") or self.clock()),
                                   doc.get("attempt"), "seen beating"))
        return out

    def _again(self, fence: Decision, started: float, attempt: Any, how: str) -> Decision:
        failed_at = fence.get("strike_time") or fence["failure_time"]
        d = dict(fence, kind="running-again", running_again_time=started,
                 running_again_s=round(started - failed_at, 3), restart_s=round(started - fence["detected"], 3),
                 reason=f"{fence['part']} generation {fence['generation']} runs again (attempt {attempt}, {how}), "
                        f"{started - failed_at:.1f} s after the failure; {fence.get('steps_lost')} steps to redo")
        d.pop("won", None)
        return d

    # --- a dead run --------------------------------------------------------------------------------

    def _run_dead(self, url: str, store: Store, view: RunView) -> list[Decision]:
        c = view.coordinator
        meta = (c.doc or {}).get("meta") or {}
        ident = meta.get("flow_run_id") or str(int(float((c.doc or {}).get("started") or 0)))
        mkey = ("run-dead", url, ident)
        if mkey in self.memory:
            return []
        self.memory[mkey] = True
        now = self.clock()
        d = self._decision("run-dead", url, c, now)
        d.update(flow_run_id=meta.get("flow_run_id"), deployment_id=meta.get("deployment_id"),
                 committed=view.committed, run_id=meta.get("run_id") or view.run)
        try:
            first = store.put_if_absent(f"watchdog/run-dead-{_safe(ident)}.json", json.dumps(d, default=str).encode())
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
                out.append(dict(d, kind="resume-failed", reason=f"could not start the run again: {type(e).__name__}: {e}"))
            else:
                if started:
                    out.append(dict(d, kind="resumed", reason=started.get("reason", "started again with resume"),
                                    resumed=started))
        return out

    # --- decisions ---------------------------------------------------------------------------------

    def _decision(self, kind: str, url: str, pv: PartView, now: float, *, generation: int | None = None,
                  reason: str | None = None) -> Decision:
        failure_time = pv.failure_time if pv.failure_time is not None else now
        d: Decision = {
            "kind": kind, "run": run_name(url), "run_url": url, "part": pv.part,
            "shard": int(pv.part.split("-", 1)[1]) if pv.part.startswith("shard-") else None,
            "state": pv.state, "reason": reason or pv.reason, "round": pv.round, "step": pv.step,
            "round_step": pv.round_step, "steps_per_round": pv.steps_per_round, "dead_generation": pv.generation,
            "dead_attempt": pv.attempt, "generation": generation, "last_beat": (pv.doc or {}).get("time"),
            "failure_time": failure_time, "detected": now, "detection_latency_s": round(now - failure_time, 3),
            "steps_lost": (pv.round_step or 0) if pv.state in ("silent", "stalled") else 0, "by": self.by, "won": False,
        }
        strike = _strike_record(self.runs.get(url), pv)
        if strike is not None:  # a chaos drill: the true moment and step of the failure
            d.update(strike_time=strike.get("time"), strike_kind=strike.get("kind"),
                     strike_latency_s=round(now - float(strike["time"]), 3), steps_lost=strike.get("round_step"))
        return d


def _strike_record(store: Store | None, pv: PartView) -> dict | None:
    if store is None or pv.round is None or pv.attempt is None or not pv.part.startswith("shard-"):
        return None
    from .chaos import strike_record_key

    try:
        return json.loads(store.get(strike_record_key(pv.part, int(pv.round), int(pv.attempt))))
    except (ObjectNotFound, StoreError, ValueError):
        return None


def _all_settled(view: RunView) -> bool:
    return view.coordinator is None and all(p.state in ("finished", "failed", "fenced", "done", "abandoned")
                                            for p in view.shards)


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in str(text))[:100]


# --- what a rerun needs --------------------------------------------------------------------------------

def rerun_request(url: str, store: Store, view: RunView, pv: PartView, *,
                  storage_options: dict | None = None) -> dict[str, Any]:
    """The arguments of the ``train-shard`` task that redoes ``pv``'s round: from the coordinator's
    beat (spec, the round's cut, heartbeat settings, chaos) or, without one, from the dead attempt's
    beat (the cut it started from) and the run's committed config."""
    cmeta = ((view.coordinator.doc or {}).get("meta") or {}) if view.coordinator else {}
    doc_meta = (pv.doc or {}).get("meta") or {}
    round_ = pv.round if pv.round is not None else (view.coordinator.round if view.coordinator else None)
    if round_ is None:
        raise ValueError(f"{pv.part}: no round known")
    source = None
    if view.coordinator is not None and view.coordinator.round == round_ and cmeta.get("source"):
        source = cmeta["source"]
    elif doc_meta.get("source") and (pv.doc or {}).get("round") == round_:
        source = doc_meta["source"]
    if source is None:
        raise ValueError(f"the cut round {round_} of {pv.part} starts from is unknown (no coordinator beat for it)")
    spec = cmeta.get("spec")
    if spec is None:
        spec = _committed_config(store)
        if spec is None:
            raise ValueError("the run's configuration is unknown (no coordinator beat, no committed config)")
    if doc_meta.get("config_hash"):
        from .rounds import RunSpec

        if RunSpec.from_dict(spec).config_hash() != doc_meta["config_hash"]:
            raise ValueError("the dead attempt's config hash differs from the run's configuration")
    return {
        "run_url": url, "spec": spec, "shard": int(pv.part.split("-", 1)[1]), "round": int(round_), "source": source,
        "storage_options": storage_options, "keyframe_every": int(cmeta.get("keyframe_every", 32)),
        "chaos": list(cmeta.get("chaos") or []), "heartbeat_every_s": float(cmeta.get("heartbeat_every_s", 2.0)),
        "heartbeat_events": bool(cmeta.get("heartbeat_events", False)),
        "retries": int(cmeta.get("shard_retries", 2)), "retry_delay_s": float(cmeta.get("retry_delay_s", 1.0)),
    }


def _committed_config(store: Store) -> dict | None:
    from ckptlib import Checkpointer

    from .rounds import stored_config

    steps = commit.committed_steps(store)
    if not steps:
        return None
    ck = Checkpointer(store)
    try:
        return stored_config(ck, steps[-1])
    finally:
        ck.close()


# --- the training flow's side: wait for the shards, but not for the dead ones -------------------------

def superseded(store: Store, part: str, round: int, generation: int) -> int | None:
    """The live generation if it is newer than ``generation`` and has written its fragment of ``round``."""
    live = commit.live_generation(store, part)
    if live > generation and store.exists(commit.fragment_key(round, part, live)):
        return live
    return None


def wait_for_shards(futures: list[Any], store: Store, round: int, generations: list[int], *,
                    poll_s: float = 0.25) -> list[dict[str, Any]]:
    """The shard tasks' results, in order. A task whose attempt was fenced is not waited for once
    the live generation has written its fragment (a hung thread or a stopped process may never
    return); a task that failed after being fenced is not an error (the live generation owns the
    shard and the cut waits for its fragment). Anything else that fails raises, as before."""
    results: list[dict[str, Any] | None] = [None] * len(futures)
    pending = set(range(len(futures)))
    while pending:
        for i in sorted(pending):
            f, part = futures[i], f"shard-{i}"
            if _done(f):
                pending.discard(i)
                try:
                    res = f.result()
                except Exception as e:  # noqa: BLE001
                    if commit.live_generation(store, part) > generations[i]:
                        results[i] = {"shard": i, "round": round, "part": part, "status": "replaced",
                                      "generation": generations[i], "error": f"{type(e).__name__}: {e}"}
                        continue
                    raise
                live = commit.live_generation(store, part)
                if res.get("status") == "finished" and int(res.get("generation") or 0) < live:
                    res = {**res, "status": "superseded"}  # a zombie that believed it was live
                results[i] = res
                continue
            live = superseded(store, part, round, generations[i])
            if live is not None:
                pending.discard(i)
                results[i] = {"shard": i, "round": round, "part": part, "status": "replaced",
                              "generation": generations[i], "live_generation": live}
        if pending:
            _wait_any([futures[i] for i in pending], poll_s)
    return [r for r in results if r is not None]


def _done(future: Any) -> bool:
    wrapped = getattr(future, "wrapped_future", None)  # threads: concurrent.futures; dask: distributed.Future
    if wrapped is not None and hasattr(wrapped, "done"):
        return bool(wrapped.done())
    try:
        future.wait(timeout=0)
        return future.state.is_final()
    except Exception:  # noqa: BLE001 - a future that cannot even report its state: look at the store
        return False


def _wait_any(futures: list[Any], timeout: float) -> None:
    import concurrent.futures as cf

    wrapped = [getattr(f, "wrapped_future", None) for f in futures]
    if wrapped and all(isinstance(w, cf.Future) for w in wrapped):
        cf.wait(wrapped, timeout=timeout, return_when=cf.FIRST_COMPLETED)
    else:
        time.sleep(timeout)
