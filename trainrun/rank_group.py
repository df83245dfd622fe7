"""A shard's round trained by a group of rank processes (``--ranks-per-shard`` R > 1), supervised.

The shard task calls ``train_shard_group`` instead of ``train_shard_round``. Per round::

    group = the shard's warm group of its previous round, if alive   # else a fresh one:
            store = a FileStore in its own 0700 folder                #   a private rendezvous
            ranks = R processes `python -m trainrun.rank_round`      #   (trainrun.rank_round)
    each rank its job on stdin (a JSON line)
    watch them: their exits as they happen, every 0.2 s their done files, every beat period the shard's fence and rank 0's beat
    the result: rank 0's (the group's fragment, written collectively); the group kept warm

A group that finished its round waits for the shard's next one (``_WARM``, in this process): the
ranks' processes, torch imported, the rendezvous made, so a round no longer pays the group's start
(decision 53). It is ended by ``end_groups`` (the train flow, when its rounds end), at this
process's exit, or by its ranks themselves after ``IDLE_S`` without a job. A failed attempt's group
is never kept: a retry starts a fresh group.

The group talks only to its own ranks: its rendezvous is a ``torch.distributed.FileStore`` in the
group's folder (``tempfile``: mode 0700, this user's alone; no listening socket, no port a stranger
may take or write to), and every rank binds gloo to the loopback interface
(``trainrun.rank_round.LOOPBACK``): no socket of the group listens off 127.0.0.1 (docs/security.md).

The group is the unit of failure: when one rank exits with an error (killed, crashed, could not
join the rendezvous), or the shard's generation is fenced (a watchdog declared the group dead:
a hung or stalled rank stops the whole group's beats at its next collective), every other rank
is killed (SIGKILL: a rank blocked in a collective cannot be asked) and waited for, so no process
of a failed or fenced group lives on. A failure raises ``RankGroupFailed`` (Prefect retries the
task: a fresh group from the same cut) or ``RankGroupRefused`` (a rank refused its work: not
retried), after the supervisor wrote the final ``failed`` beat of every rank that had not written
its own (``finish_failed_beats``: rank 0's is the shard's, so the retry's recovery row says
``crash`` and a watchdog does not take the group for a silent one); a fence raises ``FencedError``. A shard task killed outright takes its ranks with it (each rank asks
the kernel for ``SIGKILL`` when its supervisor ends: ``PR_SET_PDEATHSIG``). A fenced group's fragment, had one of its ranks written
it, is of the old generation: never gathered, never committed.

A preemption stops the group together: this process asked to stop (its SIGTERM, a cancel:
``trainrun.preemption``) sends SIGTERM to every rank; a rank that gets SIGTERM, from here or from
outside, makes its whole group stop after one step the ranks agree on, checkpoint there and exit
``RankExit.PREEMPTED`` (``trainrun.rank_round``); this raises ``Preempted``. While the group trains,
this process counts as a training loop, so its own SIGTERM waits for that stop (within the grace).

Rank 0 beats as the shard (``heartbeats/<part>.json``, so the watchdog judges the group as it
judges a shard), every other rank under ``heartbeats/ranks/<part>/<rank>.json``; the task's
``on_beat`` callback (progress, events) gets rank 0's beats, read back from the store.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from ckptlib import Checkpointer, FencedError
from ckptlib.heartbeat import Beat, Heartbeat, heartbeat_key, read_heartbeat

from . import preemption
from .beats import start_meta, starting
from .documents import Cut
from .errors import LauncherError, Preempted, RankGroupFailed, RankGroupRefused
from .failures import RankExit
from .layout import shard_part
from .local_tier import LocalTier
from .rank_launcher import LaunchedRank, launch_rank, launcher_supported
from .rank_round import RankJob
from .recovery import recognise_failure
from .results import ShardResult
from .resume_point import resume_point
from .shard_checkpoint import Every
from .spec import RunSpec

log = logging.getLogger("trainrun.rank_group")

# how long a rank waits in a collective (the rendezvous included) for a rank that hangs; a watchdog
# usually fences a hung group sooner (its timeout: 30 s by default)
GROUP_TIMEOUT_S = 120.0
POLL_S = 0.2
PREEMPTED_MAX_BYTES = 64 << 10  # rank 0's word on where its group stopped
IDLE_S = 300.0  # a warm group waits this long for its shard's next round, then its ranks end
REFUSALS = ("ValueError", "TypeError", "RankGroupRefused", "ImportError", "ModuleNotFoundError")


def rendezvous_path(workdir: Path) -> Path:
    """The group's FileStore: in its folder, which ``tempfile`` made mode 0700 (this user's alone)."""
    return workdir / "rendezvous"


RankProcess = subprocess.Popen[bytes] | LaunchedRank


@dataclass
class Rank:
    """One rank process of the group and where its stderr goes."""

    rank: int
    process: RankProcess
    stderr_path: Path

    def error_tail(self, lines: int = 3) -> str:
        try:
            text = self.stderr_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text[-lines:])


def start_ranks(jobs: Sequence[RankJob], workdir: Path) -> list[Rank]:
    """One process per job, started from the long-lived ``_SPAWNER`` thread: a rank's
    ``PR_SET_PDEATHSIG`` fires when the thread that started it ends, and a warm group outlives the
    task thread that started it. The first job goes on its stdin, which stays open for the next."""
    return _SPAWNER.submit(_start_rank_processes, jobs, workdir).result()


def _start_rank_processes(jobs: Sequence[RankJob], workdir: Path) -> list[Rank]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    ranks = []
    for job in jobs:
        err = workdir / f"rank-{job.rank}.stderr"
        with open(err, "wb") as stderr:
            ranks.append(Rank(job.rank, _start_rank(env, stderr), err))
    send_jobs(ranks, jobs)
    return ranks


def _start_rank(env: dict[str, str], stderr: IO[bytes]) -> RankProcess:
    """A rank forked by this process's launcher (torch imported once: ``trainrun.rank_launcher``);
    where there is none (not Linux) or it cannot start, ``python -m trainrun.rank_round``."""
    global _LAUNCHER_BROKEN
    if launcher_supported() and not _LAUNCHER_BROKEN:
        try:
            return launch_rank(env, stderr.fileno())
        except LauncherError as e:
            _LAUNCHER_BROKEN = True
            log.warning("rank groups: %s; ranks start as their own processes from now on (1-2 s each)", e)
    return subprocess.Popen([sys.executable, "-m", "trainrun.rank_round"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=stderr, env=env)


def send_jobs(ranks: Sequence[Rank], jobs: Sequence[RankJob]) -> None:
    """Each rank its job, one JSON line on its stdin."""
    for r, job in zip(ranks, jobs, strict=True):
        assert r.process.stdin is not None
        try:
            r.process.stdin.write(job.to_json().encode() + b"\n")
            r.process.stdin.flush()
        except OSError as e:  # a warm rank that ended between two rounds (its pipe is closed)
            raise RankGroupFailed(f"rank {r.rank} of the group ended before it could be sent its job ({e}); a "
                                  "retry starts a fresh group from the same cut") from e


def end_ranks(ranks: Sequence[Rank]) -> None:
    """Kill every rank still running and wait for each: no process of the group outlives it."""
    _signal_live(ranks, signal.SIGKILL)
    for r in ranks:
        r.process.wait()
        if r.process.stdin is not None:
            try:
                r.process.stdin.close()
            except OSError:  # a pipe whose reader died
                pass


@dataclass
class Group:
    """A live group of rank processes: its working directory (0700: its rendezvous, stderr, results),
    the jobs it was sent. Between rounds it waits, warm, in ``_WARM``."""

    key: tuple[Any, ...]
    workdir: tempfile.TemporaryDirectory
    ranks: list[Rank] = field(default_factory=list)
    jobs: int = 0
    idle_since: float = 0.0

    def alive(self) -> bool:
        return all(r.process.poll() is None for r in self.ranks)

    def end(self) -> None:
        """Kill and wait for its ranks, remove its directory."""
        end_ranks(self.ranks)
        self.workdir.cleanup()


# groups that finished their last job, kept for the shard's next round (key: group_key); a group is
# taken out while it trains, so two attempts of one shard never share one
_WARM: dict[tuple[Any, ...], Group] = {}
_WARM_LOCK = threading.Lock()
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank-groups")
_LAUNCHER_BROKEN = False  # the launcher failed to start once: plain processes from then on


def group_key(ck: Checkpointer, part: str, spec: RunSpec, group_timeout_s: float) -> tuple[Any, ...]:
    """What a warm group must share with the round it takes: the run and shard, and what its ranks
    fixed when they started (their number, the rendezvous timeout); the rest travels in each job."""
    return (ck.url, part, spec.ranks_per_shard, group_timeout_s)


def take_warm(key: tuple[Any, ...]) -> Group | None:
    """The warm group of ``key``, if one is alive and was idle for less than its ranks wait (with a
    margin: a rank that is about to end on its own is not sent a job). Others past it are ended."""
    now = time.monotonic()
    with _WARM_LOCK:
        group = _WARM.pop(key, None)
        stale = [k for k, g in _WARM.items() if now - g.idle_since > IDLE_S]
        old = [_WARM.pop(k) for k in stale]
    for g in old:
        g.end()
    if group is not None and (now - group.idle_since > IDLE_S or not group.alive()):
        group.end()
        return None
    return group


def keep_warm(group: Group) -> None:
    group.idle_since = time.monotonic()
    with _WARM_LOCK:
        old = _WARM.pop(group.key, None)
        _WARM[group.key] = group
    if old is not None:
        old.end()


def end_groups(url: str | None = None) -> int:
    """End the warm groups of the run at ``url`` (None: every run's); how many. The train flow calls
    it when its rounds end; a group nobody ends ends itself after ``IDLE_S`` without a job."""
    with _WARM_LOCK:
        keys = [k for k in _WARM if url is None or k[0] == url]
        groups = [_WARM.pop(k) for k in keys]
    for g in groups:
        g.end()
    return len(groups)


atexit.register(end_groups)


def train_shard_group(ck: Checkpointer, storage_options: dict[str, Any] | None, spec: RunSpec, shard: int,
                      round_no: int, cut: Cut, *, attempt: int = 1, chaos: Sequence[str] = (),
                      heartbeat_every_s: float = 2.0, on_beat: Callable[[Beat], None] | None = None,
                      group_timeout_s: float = GROUP_TIMEOUT_S, checkpoint_every: Every = "auto",
                      local_tier: LocalTier | None = None, warm: bool = False) -> ShardResult:
    """Train shard ``shard``'s round ``round_no`` with ``spec.ranks_per_shard`` rank processes, from
    the shard's newest shard checkpoint of the round (``trainrun.resume_point``), else from ``cut``;
    the group checkpoints at ``checkpoint_every`` (``auto``: at the steps its ranks agree on; each rank also keeps its
    units in ``local_tier``, where a rerun of the group on this host reads them) and writes the shard's
    fragment. ``warm``: the shard's group of its previous round trains this one if it is still
    alive, and the group is kept for the next (the caller ends it: ``end_groups``); else a group is
    started and ended here. Raises FencedError, RankGroupFailed, RankGroupRefused or Preempted (module
    docstring); no rank of a group that failed or stopped lives on when it raises."""
    part = shard_part(shard)
    generation = ck.live_generation(part)
    resume = resume_point(ck.store, part, round_no, generation) if checkpoint_every else None  # the same start for every rank
    key = group_key(ck, part, spec, group_timeout_s)
    # the failure it recovers from: recognised before any beat of the group (its spawn beat) hides it
    failure = recognise_failure(ck.store, part, round_no, cut.step, generation)
    group = take_warm(key) if warm else None
    t0 = time.perf_counter()
    if group is None:
        group = Group(key, tempfile.TemporaryDirectory(prefix=f"ckpt-{part}-"))
    rendezvous = str(rendezvous_path(Path(group.workdir.name)))
    group.jobs += 1
    result_path = Path(group.workdir.name) / f"result-{group.jobs}.json"
    jobs = [RankJob(url=ck.url, storage_options=storage_options, spec=spec.trajectory().to_dict(), shard=shard,
                    round_no=round_no, cut=cut.to_dict(), generation=generation, attempt=attempt,
                    chaos=list(chaos), heartbeat_every_s=heartbeat_every_s, rank=r, ranks=spec.ranks_per_shard,
                    rendezvous=rendezvous, group_timeout_s=group_timeout_s, result_path=str(result_path),
                    supervisor_pid=os.getpid(), checkpoint_every=checkpoint_every,
                    resume=resume.to_dict() if resume is not None else None,
                    local_tier=str(local_tier.root) if local_tier is not None else None,
                    local_tier_max_bytes=local_tier.max_bytes if local_tier is not None else None, idle_s=IDLE_S,
                    failure=failure.to_dict() if failure is not None else None)
            for r in range(spec.ranks_per_shard)]
    try:
        with preemption.training():  # this process's SIGTERM waits (within its grace) for the group's stop
            run_group(ck, part, generation, group, jobs, cut, spec, attempt, heartbeat_every_s, on_beat)
        result = ShardResult.from_json(result_path.read_bytes())
    except BaseException as e:
        group.end()  # a failed group is never kept
        if not isinstance(e, FencedError):  # fenced: the watchdog owns the shard now, its fence says what happened
            finish_failed_beats(ck, part, generation, attempt, len(group.ranks), e, on_beat,
                                at=getattr(e, "detected_at", None))
        raise
    result_path.unlink(missing_ok=True)
    if warm:
        keep_warm(group)
    else:
        group.end()
    return ShardResult.from_dict({**result.to_dict(), "seconds": {**result.seconds,
                                                                  "group": round(time.perf_counter() - t0, 4)}})


def run_group(ck: Checkpointer, part: str, generation: int, group: Group, jobs: Sequence[RankJob], cut: Cut,
              spec: RunSpec, attempt: int, heartbeat_every_s: float, on_beat: Callable[[Beat], None] | None) -> None:
    """Send the group its jobs (a fresh group: start its ranks with them) and supervise it."""
    if group.ranks:
        send_jobs(group.ranks, jobs)
    else:  # a fresh group: its start is timed phase by phase from this beat on (trainrun.beats)
        starting(Heartbeat(ck.store, part, generation=generation, round=jobs[0].round_no,
                           steps_per_round=spec.steps_per_round, every_s=heartbeat_every_s, attempt=attempt, rank=0,
                           meta=start_meta(cut, spec)), "spawn")
        group.ranks = start_ranks(jobs, Path(group.workdir.name))
    supervise(ck, part, generation, group.ranks, jobs, every_s=heartbeat_every_s, on_beat=on_beat)


def supervise(ck: Checkpointer, part: str, generation: int, ranks: Sequence[Rank], jobs: Sequence[RankJob], *,
              every_s: float, on_beat: Callable[[Beat], None] | None) -> None:
    """Return once every rank is done with its job; raise at the first rank that failed (or ended
    before its job was done), when fenced, or Preempted once every rank stopped on a preemption.
    A rank's exit is seen when it happens (``ExitWatch``); the error raised carries that moment
    (``detected_at``), the detection a recovery row measures. This process asked to stop
    (``trainrun.preemption``): the request goes on to every rank as SIGTERM."""
    next_look = 0.0
    last_beats = -1
    forwarded = False
    preempted_since: float | None = None
    with ExitWatch(ranks) as exits:
        while True:
            # a rank the forwarded SIGTERM caught before its handler was set ended as SIGTERM ends a process
            stopped = (RankExit.PREEMPTED, -signal.SIGTERM) if forwarded else (RankExit.PREEMPTED,)
            codes = [r.process.poll() for r in ranks]
            failed = [(r, c) for r, c in zip(ranks, codes, strict=True) if c is not None and c not in stopped]
            if failed:
                # a watchdog fences a group, then ends its ranks: one may exit before the next look
                if fenced_since(ck, part, generation):
                    raise fenced_error(part, generation, ranks)
                # the first to exit first: the others often failed because it did (a closed connection)
                failed.sort(key=lambda rc: getattr(rc[0].process, "exit_order", None) or 0)
                raise detected(group_error(part, generation, ranks, failed))
            if all(c in stopped for c in codes):
                raise preempted(part, jobs[0])
            if any(c in stopped for c in codes):  # the others are finishing the group's stop
                preempted_since = preempted_since or time.monotonic()
                if time.monotonic() - preempted_since > preemption.grace_s():
                    raise preempted(part, jobs[0])
            if all(os.path.exists(job.done_path) for job in jobs):
                return
            if not forwarded and preemption.requested() is not None:
                forwarded = True
                forward_sigterm(ranks)
            now = time.monotonic()
            if now >= next_look:
                next_look = now + every_s
                if ck.live_generation(part) > generation:
                    raise fenced_error(part, generation, ranks)
                beat = read_heartbeat(ck.store, part)
                if on_beat is not None and beat is not None and beat.generation == generation \
                        and beat.beats != last_beats:
                    last_beats = beat.beats
                    on_beat(beat)
            exits.wait(POLL_S)


def fenced_error(part: str, generation: int, ranks: Sequence[Rank]) -> FencedError:
    return FencedError(f"{part} generation {generation} was fenced while its group of {len(ranks)} ranks trained; "
                       "every rank of the group was ended")


def fenced_since(ck: Checkpointer, part: str, generation: int) -> bool:
    """Whether a newer generation than ``generation`` owns ``part`` now; a store that cannot say is
    taken for no (the group's own failure is then the error raised)."""
    try:
        return ck.live_generation(part) > generation
    except Exception as e:  # noqa: BLE001 - the group failed either way; its error must be raised
        log.warning("%s: whether its group was fenced could not be read: %s", part, e)
        return False


class ExitWatch:
    """Wakes the supervisor the moment a rank exits (Linux pidfds, readable once the process ended),
    not at its next poll; elsewhere a plain sleep of the poll period."""

    def __init__(self, ranks: Sequence[Rank]):
        self.fds: list[int] = []
        if hasattr(os, "pidfd_open"):
            for r in ranks:
                try:
                    self.fds.append(os.pidfd_open(r.process.pid))
                except OSError:  # already reaped: its poll says so
                    pass

    def __enter__(self) -> ExitWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds:
            os.close(fd)

    def wait(self, timeout: float) -> None:
        if self.fds:
            select.select(self.fds, [], [], timeout)
        else:
            time.sleep(timeout)


def detected(error: BaseException) -> BaseException:
    """``error``, stamped with the wall time its failure was seen (the group's final beats say it)."""
    error.detected_at = time.time()  # type: ignore[attr-defined]
    return error


def forward_sigterm(ranks: Sequence[Rank]) -> None:
    """This process was asked to stop: each rank gets SIGTERM, and the group stops together."""
    log.warning("preemption: SIGTERM forwarded to the %d ranks of a group", len(ranks))
    _signal_live(ranks, signal.SIGTERM)


def _signal_live(ranks: Sequence[Rank], sig: signal.Signals) -> None:
    """``sig`` to every rank still running (one that ended meanwhile is skipped)."""
    for r in ranks:
        if r.process.poll() is None:
            try:
                r.process.send_signal(sig)
            except ProcessLookupError:
                pass


def preempted(part: str, job: RankJob) -> Preempted:
    """The group stopped on a preemption: the Preempted rank 0 raised (``RankJob.preempted_path``,
    written by this group's own rank in its 0700 folder, its size bounded), else a plain one."""
    why = preemption.requested()
    try:
        with open(job.preempted_path, "rb") as f:
            doc = json.loads(f.read(PREEMPTED_MAX_BYTES))
        message, reason = str(doc["message"]), str(why or doc["reason"])
        # the ranks know only the SIGTERM this process forwarded; the request itself may be a cancel
        message = message.replace(f"({doc['reason']})", f"({reason})", 1)
        return Preempted(message, part=part, round_no=job.round_no, round_step=int(doc["round_step"]), reason=reason)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Preempted(f"{part} round {job.round_no}: its group stopped on a preemption but rank 0 did not say "
                         f"where ({type(e).__name__}: {e}); a rerun continues from its newest shard checkpoint",
                         part=part, round_no=job.round_no, reason=why or "SIGTERM")


def finish_failed_beats(ck: Checkpointer, part: str, generation: int, attempt: int, ranks: int,
                        error: BaseException, on_beat: Callable[[Beat], None] | None, at: float | None = None) -> None:
    """The group's attempt failed and every rank has ended: each rank's beat of this attempt that
    still says ``running`` becomes ``failed``, with the group's error. A rank writes its own final
    beat when it gets to it, but the supervisor kills the ranks as soon as one fails, so rank 0
    (killed itself, or still failing its collective, waiting for its checkpoint write in flight)
    may not have: the shard's last beat would then say ``running``, and the next attempt would
    take the failure for a process that died (``process-died``), or a watchdog, seeing no beat for
    its timeout while the retry's fresh group starts, would fence the shard as ``silent``. To
    Prefect the attempt raised, so it is a ``crash`` (``trainrun.recovery``), whichever rank failed
    and however fast. Each final beat's time is ``at``, when the failure was seen (a rank's exit),
    else now: the retry's recovery row measures its detection from it. Nothing is written once the part is fenced (a newer generation owns its beat);
    a store that cannot be written is logged: the group's own error is the one raised."""
    try:
        if ck.live_generation(part) > generation:
            return
        for r in range(ranks):
            beat = read_heartbeat(ck.store, part, r)
            if beat is None or beat.status != "running" or (beat.generation, beat.attempt) != (generation, attempt):
                continue  # it wrote its own final beat, or never beat in this attempt
            final = replace(beat, status="failed", time=at or time.time(), beats=beat.beats + 1,
                            error=f"{type(error).__name__}: {error}")
            ck.store.put(heartbeat_key(part, r), final.to_json())
            if r == 0 and on_beat is not None:
                on_beat(final)
    except Exception as e:  # noqa: BLE001 - a report; the group's error is raised anyway
        log.warning("%s: the final beats of its failed group were not written: %s", part, e)


def group_error(part: str, generation: int, ranks: Sequence[Rank], failed: list[tuple[Rank, int]]) -> BaseException:
    """The error of a group whose ranks ``failed`` exited with these codes: the first (in time) named."""
    if all(code == RankExit.FENCED for _, code in failed):
        return FencedError(f"{part} generation {generation} was fenced: its ranks found a newer generation")
    first, code = next(((r, c) for r, c in failed if c != RankExit.FENCED), failed[0])
    tail = first.error_tail()
    how = (f"was killed by signal {-code}" if code < 0 else f"exited with {code}" if code else
           "ended before its job was done")
    message = (f"{part}: rank {first.rank} of its group of {len(ranks)} {how} (generation {generation})"
               f"{': ' + tail if tail else ''}; the group's other ranks were ended")
    last = tail.rsplit(" | ", 1)[-1]
    if any(last.startswith(kind + ":") or f" {kind}: " in last for kind in REFUSALS) and "rendezvous" not in tail:
        return RankGroupRefused(message + ". Fix what the rank refused, then resume")
    return RankGroupFailed(message + ". A retry starts a fresh group from the same cut")
