"""Fault injection for drills and tests: ``--chaos KIND:key=value,...`` (repeatable).

    crash:shard=1,round=2          shard 1 raises ChaosCrash in round 2, on its first attempt only
    crash:shard=0,round=3,step=5   ... after 5 steps of the round (default: half the round)
    crash:shard=1,round=2,attempt=2  ... on the second attempt (so the first retry fails too)
    hang:shard=0,round=2           shard 0 stops beating and progressing; its thread lives on
    zombie:shard=1,round=3         shard 1's heartbeats stop reaching the store; it keeps computing and
                                   later writes its fragment (which must never be committed)
    kill:shard=1,round=2           shard 1's process dies at once (SIGKILL; needs --task-runner dask)
    stop:shard=1,round=2           shard 1's process freezes (SIGSTOP; needs --task-runner dask) until
                                   it has been fenced, then wakes and finds its fence
    stall:shard=0,round=2          shard 0 keeps beating, but its step no longer advances
    preempt:shard=1,round=2        shard 1's process gets SIGTERM (a preemption): its shards checkpoint
                                   at the step they are at and stop; with threads that is the whole run
    kill:shard=1,round=2,rank=1    rank 1 of shard 1's group (--ranks-per-shard > 1) dies at once: only
                                   that rank's process (so any task runner will do)
    preempt:shard=1,round=2,rank=1 rank 1 of shard 1's group gets SIGTERM: the whole group checkpoints at
                                   one step its ranks agree on and stops (trainrun.rank_round)

Keys: ``shard`` and ``round`` (required), ``rank`` (with ``--ranks-per-shard`` R > 1: the rank of
the shard's group it strikes, default 0), ``attempt`` (default 1: the first attempt only, so a
retry or the watchdog's rerun succeeds), ``step`` (the round-local step after which it strikes;
default half the round). A spec is plain text, so it travels as a flow parameter.

The kinds and who recovers (``docs/watchdog.md``):

``crash``   a loud failure: the task raises, Prefect retries it from the same cut.
``hang``    silent: no more beats, no more steps. The hung loop still looks at its fence every
            half second (as a loop stuck in a collective with a timeout would): the watchdog
            fences it, reruns the shard, and the hung attempt then ends itself (FencedError), so
            the flow's thread is freed. (A loop that never looks would be abandoned by the flow.)
``zombie``  a partition: from the strike on, the attempt's heartbeat writes and fence reads fail
            (it believes it is still live) while it trains on. It holds its fragment back until the
            watchdog has fenced it (looked up on the real store: the drill makes sure the write
            comes *after* the fence), then writes it through its stale view of the fences, i.e.
            exactly the check-then-write race ``write_fragment`` cannot close. The fragment lands
            under the old generation; the coordinator's ``gather`` takes the live one; GC removes it.
``stall``   alive but not advancing: it beats every 0.1 s at the same step; the watchdog sees no
            progress for the timeout, fences it, and the beat that finds the fence ends it.
``kill``    ``SIGKILL`` of the shard's own process: with ``--task-runner dask`` a Dask worker dies
            (the nanny starts a new one); with threads it would kill the whole run, so the CLI
            refuses that combination (``check_runner``).
``preempt`` ``SIGTERM`` of the shard's own process, as a spot instance, a Kubernetes eviction or a
            worker shut down sends it (``trainrun.preemption``): every shard loop of the process
            checkpoints at the step it is at and stops (``Preempted``) within the grace; a rerun
            continues from there and recomputes nothing. With threads the process is the whole run
            (it ends; ``ckpt train --resume`` continues it). With ``rank=K`` only rank K's process
            of the shard's group gets it, and the group stops together (``trainrun.rank_round``).
``stop``    ``SIGSTOP`` of the shard's own process: a frozen host or paused VM. Dask notices nothing
            before its worker TTL (minutes); the watchdog sees the beats stop, fences and reruns
            the shard. A helper process started just before the stop sends ``SIGCONT`` once the
            fence is on the store (as a paused VM resumes some time later); the woken attempt
            finds its fence at its next beat and ends itself (FencedError). Needs dask too.

Each strike first creates ``chaos/<part>.r<round>.a<attempt>.json`` (a ``Strike``: kind, wall time,
round step) with put-if-absent, so a spec strikes at most once per run (a task Dask runs again after
its worker died keeps its attempt number) and drills can measure from the true moment of failure.

A soak (``ckpt soak``) strikes at random moments: ``soak_schedule`` turns a seeded stream of
failure times (exponential gaps, ``fail_every_s`` apart on average) over a clean run's rounds into
these very specs (a round, a shard, a step, the attempt it will be).

Nothing here knows Prefect; the shard task passes the attempt number.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptlib import commit
from ckptlib.documents import Document, DocumentError
from ckptlib.errors import FencedError, ObjectNotFound, StoreError
from ckptlib.store import Store, WrapperStore

from .errors import ChaosCrash
from .layout import strike_key

if TYPE_CHECKING:
    from ckptlib import Checkpointer
    from ckptlib.heartbeat import Heartbeat

log = logging.getLogger("trainrun.chaos")

# kind -> what it does (for messages and --help)
KINDS: dict[str, str] = {
    "crash": "the shard task raises ChaosCrash (a loud failure: Prefect retries it)",
    "hang": "the shard stops beating and progressing, its thread lives (the watchdog fences and reruns it)",
    "zombie": "the shard's heartbeats stop reaching the store, it keeps computing and later writes a "
              "fragment that must never be committed (the watchdog fences and reruns it)",
    "kill": "the shard's process dies at once, SIGKILL (needs a process-based task runner: dask)",
    "stall": "the shard keeps beating but makes no progress (the watchdog sees the same step, fences and "
             "reruns it)",
    "preempt": "the shard's process gets SIGTERM (a preemption): its shards checkpoint where they are and stop; "
               "a rerun recomputes nothing (with threads: the whole run, continue it with --resume)",
    "stop": "the shard's process freezes (SIGSTOP) until the watchdog has fenced it, then wakes (SIGCONT) "
            "and ends itself at its next beat (needs dask)",
}
# kinds that stop or kill the process the shard runs in
PROCESS_KINDS = ("kill", "stop")
_INT_KEYS = ("shard", "round", "attempt", "step", "rank")
# how long a hung or partitioned attempt waits for its fence before it gives up (a drill without a watchdog)
MAX_WAIT_S = 900.0


@dataclass(frozen=True)
class Chaos:
    kind: str
    shard: int
    round: int
    attempt: int = 1
    step: int | None = None  # round-local step after which it strikes; None = half the round
    rank: int | None = None  # the rank of the shard's group (None: the shard's process, rank 0 of a group)

    def __str__(self) -> str:
        text = f"{self.kind}:shard={self.shard},round={self.round}"
        if self.attempt != 1:
            text += f",attempt={self.attempt}"
        if self.step is not None:
            text += f",step={self.step}"
        if self.rank is not None:
            text += f",rank={self.rank}"
        return text

    def strikes(self, shard: int, round_no: int, attempt: int, rank: int = 0) -> bool:
        return (self.shard, self.round, self.attempt, self.rank or 0) == (shard, round_no, attempt, rank)

    def strike_step(self, steps_per_round: int) -> int:
        """The round-local step count after which this strikes (at least 1, at most the round)."""
        step = steps_per_round // 2 if self.step is None else self.step
        return max(1, min(step, steps_per_round))


def parse_chaos(spec: str) -> Chaos:
    """``"crash:shard=1,round=2"`` -> Chaos; a malformed spec raises ValueError saying what is wrong."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"chaos spec {spec!r} must look like KIND:key=value,..., e.g. crash:shard=1,round=2")
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"unknown chaos kind {kind!r} in {spec!r}; known kinds: {', '.join(sorted(KINDS))}")
    values: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _INT_KEYS:
            raise ValueError(f"bad item {item!r} in chaos spec {spec!r}: use key=value with keys {list(_INT_KEYS)}")
        if key in values:
            raise ValueError(f"key {key!r} given twice in chaos spec {spec!r}")
        try:
            values[key] = int(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} in chaos spec {spec!r} is not an integer") from None
    missing = [k for k in ("shard", "round") if k not in values]
    if missing:
        raise ValueError(f"chaos spec {spec!r} lacks {missing}, e.g. {kind}:shard=1,round=2")
    if (values["shard"] < 0 or values["round"] < 1 or values.get("attempt", 1) < 1 or values.get("step", 1) < 1
            or values.get("rank", 0) < 0):
        raise ValueError(f"chaos spec {spec!r}: need shard >= 0, round >= 1, attempt >= 1, step >= 1, rank >= 0")
    return Chaos(kind, **values)


def parse_all(specs: list[str] | None) -> list[Chaos]:
    return [parse_chaos(s) for s in specs or []]


def for_attempt(specs: list[str] | None, shard: int, round_no: int, attempt: int, rank: int = 0) -> list[Chaos]:
    """The specs that strike this shard's attempt in round ``round_no`` (in rank ``rank`` of its group)."""
    return [c for c in parse_all(specs) if c.strikes(shard, round_no, attempt, rank)]


def check_runner(specs: list[str] | None, task_runner: str, ranks_per_shard: int = 1) -> None:
    """Refuse chaos that needs a process-based task runner when shards run as threads of the flow
    (a shard of ``ranks_per_shard`` > 1 trains in rank processes of its own: any runner will do).
    A ``rank`` beyond the group is refused too."""
    parsed = parse_all(specs)
    beyond = [str(c) for c in parsed if (c.rank or 0) >= ranks_per_shard]
    if beyond:
        raise ValueError(f"chaos {', '.join(beyond)} names a rank the shard's group does not have (ranks 0.."
                         f"{ranks_per_shard - 1}): lower its rank=, or raise --ranks-per-shard")
    bad = [str(c) for c in parsed if c.kind in PROCESS_KINDS]
    if bad and task_runner == "threads" and ranks_per_shard == 1:
        raise ValueError(
            f"chaos {', '.join(bad)} kills or stops the shard's process, which with --task-runner threads is the whole "
            "run (coordinator and watchdog included); use --task-runner dask, or crash/hang/zombie with threads")


@dataclass(frozen=True)
class Strike(Document):
    """``chaos/<part>.r<round>.a<attempt>.json``: when and where a chaos spec struck (once per run)."""

    KIND = "chaos strike"
    MAX_BYTES = 64 << 10

    kind: str
    spec: str
    part: str
    round: int
    attempt: int
    round_step: int
    time: float
    pid: int


def read_strike(store: Store, part: str, round_no: int, attempt: int) -> Strike | None:
    """The strike of this attempt, if a chaos spec struck it (None too when unreadable: it is for measures)."""
    key = strike_key(part, round_no, attempt)
    try:
        return Strike.read(store, key)
    except (ObjectNotFound, StoreError, DocumentError):
        return None


def strike(chaos: Chaos, *, part: str, round_step: int, heartbeat: Heartbeat | None = None,
           checkpointer: Checkpointer | None = None, generation: int | None = None) -> None:
    """Do what ``chaos`` says, now (called from the training loop once its step is reached).

    ``heartbeat`` (ckptlib Heartbeat), ``checkpointer`` and ``generation`` are the attempt's own:
    ``hang`` and ``zombie`` need them (``crash`` does not).
    """
    if checkpointer is not None and not _record(checkpointer.store, chaos, part, round_step):
        log.info("chaos %s already struck in this run: not again", chaos)
        return
    if chaos.kind == "crash":
        raise ChaosCrash(f"chaos {chaos}: {part} crashes on purpose after {round_step} steps of round "
                         f"{chaos.round} (attempt {chaos.attempt}); a retry starts again from the last cut")
    if checkpointer is None or generation is None:
        raise ValueError(f"chaos {chaos} needs the attempt's checkpointer and generation")
    store = checkpointer.store
    if chaos.kind == "kill":
        log.warning("chaos %s: %s kills its own process %d now (SIGKILL)", chaos, part, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # pragma: no cover - the signal is delivered before this returns
    if chaos.kind == "preempt":
        _preempt(chaos, part)
    elif chaos.kind == "stop":
        _freeze(chaos, checkpointer, part, generation)
    elif chaos.kind == "hang":
        _hang(chaos, store, part, generation)
    elif chaos.kind == "zombie":
        _partition(chaos, heartbeat, checkpointer, part, generation)
    elif chaos.kind == "stall":
        _stall(chaos, heartbeat, part)
    else:  # pragma: no cover
        raise ValueError(f"chaos kind {chaos.kind!r} has no action yet")


def _record(store: Store, chaos: Chaos, part: str, round_step: int) -> bool:
    """Record the strike (put-if-absent); False when this spec already struck in the run. A Dask
    worker that died mid-task has its task run again by Dask with the same Prefect attempt number:
    without this, ``kill`` would strike again in every worker that picks the task up."""
    doc = Strike(kind=chaos.kind, spec=str(chaos), part=part, round=chaos.round, attempt=chaos.attempt,
                 round_step=round_step, time=time.time(), pid=os.getpid())
    try:
        return store.put_if_absent(strike_key(part, chaos.round, chaos.attempt), doc.to_json())
    except Exception as e:  # noqa: BLE001 - the record is for measurements (and once-only): strike anyway
        log.warning("chaos %s: could not record the strike: %s", chaos, e)
        return True


def _fenced(store: Store, part: str, generation: int) -> bool:
    try:
        return commit.live_generation(store, part) > generation
    except Exception:  # noqa: BLE001 - a store hiccup is not a fence
        return False


def _wait_for_fence(chaos: Chaos, store: Store, part: str, generation: int, what: str) -> None:
    deadline = time.monotonic() + MAX_WAIT_S
    while not _fenced(store, part, generation):
        if time.monotonic() > deadline:
            raise ChaosCrash(f"chaos {chaos}: {part} {what} for {MAX_WAIT_S:.0f} s and nobody fenced it: is a "
                             "watchdog running? (ckpt watchdog URL, or ckpt train without --no-watchdog)")
        time.sleep(0.5)


def _preempt(chaos: Chaos, part: str) -> None:
    """SIGTERM to this process (a rank's: its group's); returns once its handler has asked the loops
    to stop (the loop, or the group, then checkpoints at this very step), or raises when nothing
    handled it within a few seconds."""
    from . import preemption

    log.warning("chaos %s: %s sends SIGTERM to its own process %d (a preemption)", chaos, part, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    while preemption.requested() is None:  # the handler runs on the main thread, soon
        if time.monotonic() > deadline:
            raise ChaosCrash(f"chaos {chaos}: {part}'s process {os.getpid()} got SIGTERM and no preemption "
                             "handler asked its loops to stop (trainrun.preemption.install in its main thread)")
        time.sleep(0.01)


def _hang(chaos: Chaos, store: Store, part: str, generation: int) -> None:
    log.warning("chaos %s: %s hangs (no beats, no steps) until a watchdog fences it", chaos, part)
    _wait_for_fence(chaos, store, part, generation, "hung")
    raise FencedError(f"chaos {chaos}: {part} generation {generation} hung and was fenced meanwhile; it stops")


# The helper that wakes a stopped attempt: its own process (the stopped one can do nothing), in its
# own session (a signal to the worker's group does not reach it). Arguments come on stdin, so
# storage credentials never show in a process listing.
_WAKER = "import sys; from trainrun.chaos import wake_when_fenced; wake_when_fenced(sys.stdin.read())"


def _freeze(chaos: Chaos, checkpointer: Checkpointer, part: str, generation: int) -> None:
    store = checkpointer.store
    job = {"url": store.url, "storage_options": getattr(store, "storage_options", None), "part": part,
           "generation": generation, "pid": os.getpid(), "max_wait_s": MAX_WAIT_S}
    waker = subprocess.Popen([sys.executable, "-c", _WAKER], stdin=subprocess.PIPE, start_new_session=True)
    assert waker.stdin is not None
    waker.stdin.write(json.dumps(job).encode())
    waker.stdin.close()
    log.warning("chaos %s: %s stops its own process %d now (SIGSTOP) until a watchdog fences it", chaos, part,
                os.getpid())
    os.kill(os.getpid(), signal.SIGSTOP)
    log.warning("chaos %s: %s woken (SIGCONT); its next beat looks at its fence", chaos, part)


def wake_when_fenced(job_json: str) -> None:
    """The waker's body: SIGCONT to ``pid`` once ``part``'s live generation is above ``generation``
    (or after ``max_wait_s``, so no drill leaves a process frozen for good)."""
    job = json.loads(job_json)
    store = Store.from_url(job["url"], job["storage_options"])
    deadline = time.monotonic() + float(job["max_wait_s"])
    while not _fenced(store, job["part"], int(job["generation"])) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        os.kill(int(job["pid"]), signal.SIGCONT)
    except ProcessLookupError:  # killed meanwhile (the Dask cluster closed): nothing to wake
        pass


def _stall(chaos: Chaos, heartbeat: Heartbeat | None, part: str) -> None:
    """Beats on at the same step (a loop stuck retrying something): the beat that finds the fence
    raises FencedError and ends the attempt."""
    if heartbeat is None:
        raise ValueError(f"chaos {chaos} needs the attempt's heartbeat")
    log.warning("chaos %s: %s stalls (it beats, its step does not move) until a watchdog fences it", chaos, part)
    step = heartbeat.document("running").step or 0
    deadline = time.monotonic() + MAX_WAIT_S
    while time.monotonic() < deadline:
        heartbeat.beat(step=step)  # raises FencedError once fenced
        time.sleep(0.1)
    raise ChaosCrash(f"chaos {chaos}: {part} stalled for {MAX_WAIT_S:.0f} s and nobody fenced it")


def _partition(chaos: Chaos, heartbeat: Heartbeat | None, checkpointer: Checkpointer, part: str,
               generation: int) -> None:
    """From now on the attempt's beats are lost and it cannot see newer fences; it trains on."""
    if heartbeat is None:
        raise ValueError(f"chaos {chaos} needs the attempt's heartbeat")
    real = checkpointer.store
    log.warning("chaos %s: %s is cut off from its heartbeats and fences (a zombie); it keeps training", chaos,
                part)
    heartbeat.store = Partitioned(real, lost=("heartbeats/", "fences/"))
    # The drill: the zombie is slow enough that the watchdog fences it before it writes its fragment.
    _wait_for_fence(chaos, real, part, generation, "was partitioned")
    checkpointer.store = StaleFences(real, part, generation)


# --- store views of a partitioned attempt -------------------------------------------------------------

class Partitioned(WrapperStore):
    """Every call on a key under one of ``lost`` fails as if the network were down."""

    def __init__(self, inner: Store, lost: tuple[str, ...] = ()):
        super().__init__(inner)
        self.lost = lost

    def _forward(self, op: str, key: str, *args: Any) -> Any:
        if key.startswith(self.lost):
            raise StoreError(f"chaos partition: {self.url}/{key} cannot be reached")
        return super()._forward(op, key, *args)

    def _wrap_child(self, inner_child: Store) -> Store:
        return Partitioned(inner_child, self.lost)


class StaleFences(WrapperStore):
    """Sees the fences of ``part`` as they were when it was live: none above ``generation``."""

    def __init__(self, inner: Store, part: str, generation: int):
        super().__init__(inner)
        self.part, self.generation = part, generation

    def list(self, prefix: str = "") -> list[str]:
        keys = super().list(prefix)
        if prefix.rstrip("/") != f"fences/{self.part}":
            return keys
        return [k for k in keys if not (k.rsplit("/", 1)[1].isdigit() and int(k.rsplit("/", 1)[1]) > self.generation)]

    def _wrap_child(self, inner_child: Store) -> Store:
        return StaleFences(inner_child, self.part, self.generation)


# --- the soak's schedule ----------------------------------------------------------------------------

@dataclass(frozen=True)
class RoundSpan:
    """When a round trained in a clean run: it began ``start_s`` after the first round, and its
    steps took ``train_s`` (the rest of ``wall_s`` is the cut and the task starts)."""

    round: int
    start_s: float
    wall_s: float
    train_s: float


def soak_schedule(rounds: list[RoundSpan], *, fail_every_s: float, kinds: list[str], shards: int,
                  steps_per_round: int, seed: int = 0, max_per_round: int = 2, count: int | None = None) -> list[Chaos]:
    """Failures at random moments of a run like the clean one that took ``rounds``: exponential gaps
    of ``fail_every_s`` on average (seeded; ``count``: instead exactly that many moments, uniform over
    the run), each a random kind of ``kinds`` on a random shard, at the step of its round that the
    clean run had reached then. Each failure of a shard in a round is that round's next attempt (a
    retry or a rerun is attempt n+1); at most ``max_per_round`` per shard and round, none after a
    ``kill`` in it (the task Dask runs again keeps its attempt number), and none at the round's last
    step (its fragment is written then), so that every one strikes (a moment that breaks these
    rules is dropped)."""
    if fail_every_s <= 0:
        raise ValueError(f"fail_every_s must be > 0, got {fail_every_s}")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"unknown chaos kinds {unknown or kinds}; known: {', '.join(sorted(KINDS))}")
    rng = random.Random(seed)
    end = max((r.start_s + r.wall_s for r in rounds), default=0.0)
    tried: dict[tuple[int, int], list[Chaos]] = {}
    moments = sorted(rng.uniform(0.0, end) for _ in range(count)) if count is not None else None
    t = moments.pop(0) if moments else (rng.expovariate(1.0 / fail_every_s) if moments is None else end)
    while t < end:
        span = next((r for r in rounds if r.start_s <= t < r.start_s + r.wall_s), None)
        kind, shard = rng.choice(kinds), rng.randrange(shards)
        if span is not None:
            into = min(1.0, max(0.0, t - span.start_s) / max(span.train_s, 1e-9))
            step = max(1, min(steps_per_round - 1, round(into * steps_per_round)))
            before = tried.setdefault((shard, span.round), [])
            if len(before) < max_per_round and not any(c.kind == "kill" for c in before) \
                    and all(c.step is not None and c.step < step for c in before):
                before.append(Chaos(kind, shard, span.round, attempt=len(before) + 1, step=step))
        if moments is None:
            t += rng.expovariate(1.0 / fail_every_s)
        else:
            t = moments.pop(0) if moments else end
    return sorted((c for cs in tried.values() for c in cs), key=lambda c: (c.round, c.step or 0, c.shard))
