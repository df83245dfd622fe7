"""A shard's round trained by a group of rank processes (``--ranks-per-shard`` R > 1), supervised.

The shard task calls ``train_shard_group`` instead of ``train_shard_round``. Per attempt::

    port  = a free loopback port                      # a rendezvous of this attempt's own
    ranks = R processes `python -m trainrun.rank_round` (trainrun.rank_round), the job on stdin
    watch them: every 0.2 s their exits; every beat period the shard's fence and rank 0's beat
    the result: rank 0's (the group's fragment, written collectively)

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

Rank 0 beats as the shard (``heartbeats/<part>.json``, so the watchdog judges the group as it
judges a shard), every other rank under ``heartbeats/ranks/<part>/<rank>.json``; the task's
``on_beat`` callback (progress, events) gets rank 0's beats, read back from the store.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptlib import Checkpointer, FencedError
from ckptlib.heartbeat import Beat, heartbeat_key, read_heartbeat

from .documents import Cut
from .errors import RankGroupFailed, RankGroupRefused
from .layout import shard_part
from .local_tier import LocalTier
from .rank_round import EXIT_FENCED, RankJob
from .results import ShardResult
from .resume_point import resume_point
from .shard_checkpoint import Every, group_cadence
from .spec import RunSpec

log = logging.getLogger("trainrun.rank_group")

# how long a rank waits in a collective (the rendezvous included) for a rank that hangs; a watchdog
# usually fences a hung group sooner (its timeout: 30 s by default)
GROUP_TIMEOUT_S = 120.0
POLL_S = 0.2
REFUSALS = ("ValueError", "TypeError", "RankGroupRefused", "ImportError", "ModuleNotFoundError")


def free_port() -> int:
    """A loopback port free now (the OS's choice); the attempt's rendezvous. Another process may take
    it before rank 0 binds it: then the rendezvous fails, named as such, and a retry picks another."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Rank:
    """One rank process of the group and where its stderr goes."""

    rank: int
    process: subprocess.Popen
    stderr_path: Path

    def error_tail(self, lines: int = 3) -> str:
        try:
            text = self.stderr_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text[-lines:])


def start_ranks(jobs: Sequence[RankJob], workdir: Path) -> list[Rank]:
    """One process per job; the job goes on its stdin (credentials never on a command line)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    ranks = []
    for job in jobs:
        err = workdir / f"rank-{job.rank}.stderr"
        with open(err, "wb") as stderr:
            p = subprocess.Popen([sys.executable, "-m", "trainrun.rank_round"], stdin=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        assert p.stdin is not None
        p.stdin.write(job.to_json().encode())
        p.stdin.close()
        ranks.append(Rank(job.rank, p, err))
    return ranks


def end_ranks(ranks: Sequence[Rank]) -> None:
    """Kill every rank still running and wait for each: no process of the group outlives it."""
    for r in ranks:
        if r.process.poll() is None:
            try:
                r.process.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
    for r in ranks:
        r.process.wait()


def train_shard_group(ck: Checkpointer, storage_options: dict[str, Any] | None, spec: RunSpec, shard: int,
                      round_no: int, cut: Cut, *, attempt: int = 1, chaos: Sequence[str] = (),
                      heartbeat_every_s: float = 2.0, on_beat: Callable[[Beat], None] | None = None,
                      group_timeout_s: float = GROUP_TIMEOUT_S, checkpoint_every: Every = "auto",
                      local_tier: LocalTier | None = None) -> ShardResult:
    """Train shard ``shard``'s round ``round_no`` with ``spec.ranks_per_shard`` rank processes, from
    the shard's newest shard checkpoint of the round (``trainrun.resume_point``), else from ``cut``;
    the group checkpoints every ``group_cadence(checkpoint_every)`` steps (each rank also keeps its
    units in ``local_tier``, where a rerun of the group on this host reads them) and writes the shard's
    fragment. Raises FencedError, RankGroupFailed or RankGroupRefused (module docstring); every
    rank has ended when it returns or raises."""
    part = shard_part(shard)
    generation = ck.live_generation(part)
    every = group_cadence(checkpoint_every)
    resume = resume_point(ck.store, part, round_no, generation) if every else None  # the same start for every rank
    port = free_port()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"ckpt-{part}-r{round_no}-") as tmp:
        workdir = Path(tmp)
        result_path = workdir / "result.json"
        jobs = [RankJob(url=ck.url, storage_options=storage_options, spec=spec.trajectory().to_dict(), shard=shard,
                        round_no=round_no, cut=cut.to_dict(), generation=generation, attempt=attempt,
                        chaos=list(chaos), heartbeat_every_s=heartbeat_every_s, rank=r, ranks=spec.ranks_per_shard,
                        port=port, group_timeout_s=group_timeout_s, result_path=str(result_path),
                        supervisor_pid=os.getpid(), checkpoint_every=every,
                        resume=resume.to_dict() if resume is not None else None,
                        local_tier=str(local_tier.root) if local_tier is not None else None,
                        local_tier_max_bytes=local_tier.max_bytes if local_tier is not None else None)
                for r in range(spec.ranks_per_shard)]
        ranks = start_ranks(jobs, workdir)
        failure: Exception | None = None
        try:
            supervise(ck, part, generation, ranks, every_s=heartbeat_every_s, on_beat=on_beat, port=port)
        except FencedError:
            raise  # the watchdog owns the shard now: its fence says what happened
        except Exception as e:
            failure = e
            raise
        finally:
            end_ranks(ranks)
            if failure is not None:
                finish_failed_beats(ck, part, generation, attempt, len(ranks), failure, on_beat)
        result = ShardResult.from_json(result_path.read_bytes())
    return ShardResult.from_dict({**result.to_dict(), "seconds": {**result.seconds,
                                                                  "group": round(time.perf_counter() - t0, 4)}})


def supervise(ck: Checkpointer, part: str, generation: int, ranks: Sequence[Rank], *, every_s: float,
              on_beat: Callable[[Beat], None] | None, port: int) -> None:
    """Return once every rank exited 0; raise at the first rank that failed, or when fenced."""
    next_look = 0.0
    last_beats = -1
    while True:
        codes = [r.process.poll() for r in ranks]
        failed = [(r, c) for r, c in zip(ranks, codes, strict=True) if c not in (None, 0)]
        if failed:
            raise group_error(part, generation, ranks, failed, port)
        if all(c == 0 for c in codes):
            return
        now = time.monotonic()
        if now >= next_look:
            next_look = now + every_s
            if ck.live_generation(part) > generation:
                raise FencedError(f"{part} generation {generation} was fenced while its group of {len(ranks)} ranks "
                                  "trained; every rank of the group was ended")
            beat = read_heartbeat(ck.store, part)
            if on_beat is not None and beat is not None and beat.generation == generation and beat.beats != last_beats:
                last_beats = beat.beats
                on_beat(beat)
        time.sleep(POLL_S)


def finish_failed_beats(ck: Checkpointer, part: str, generation: int, attempt: int, ranks: int,
                        error: BaseException, on_beat: Callable[[Beat], None] | None) -> None:
    """The group's attempt failed and every rank has ended: each rank's beat of this attempt that
    still says ``running`` becomes ``failed``, with the group's error. A rank writes its own final
    beat when it gets to it, but the supervisor kills the ranks as soon as one fails, so rank 0
    (killed itself, or still failing its collective, waiting for its checkpoint write in flight)
    may not have: the shard's last beat would then say ``running``, and the next attempt would
    take the failure for a process that died (``process-died``), or a watchdog, seeing no beat for
    its timeout while the retry's fresh group starts, would fence the shard as ``silent``. To
    Prefect the attempt raised, so it is a ``crash`` (``trainrun.recovery``), whichever rank failed
    and however fast. Nothing is written once the part is fenced (a newer generation owns its beat);
    a store that cannot be written is logged: the group's own error is the one raised."""
    try:
        if ck.live_generation(part) > generation:
            return
        for r in range(ranks):
            beat = read_heartbeat(ck.store, part, r)
            if beat is None or beat.status != "running" or (beat.generation, beat.attempt) != (generation, attempt):
                continue  # it wrote its own final beat, or never beat in this attempt
            final = replace(beat, status="failed", time=time.time(), beats=beat.beats + 1,
                            error=f"{type(error).__name__}: {error}")
            ck.store.put(heartbeat_key(part, r), final.to_json())
            if r == 0 and on_beat is not None:
                on_beat(final)
    except Exception as e:  # noqa: BLE001 - a report; the group's error is raised anyway
        log.warning("%s: the final beats of its failed group were not written: %s", part, e)


def group_error(part: str, generation: int, ranks: Sequence[Rank], failed: list[tuple[Rank, int]],
                port: int) -> BaseException:
    """The error of a group whose ranks ``failed`` exited with these codes: the first (in time) named."""
    if all(code == EXIT_FENCED for _, code in failed):
        return FencedError(f"{part} generation {generation} was fenced: its ranks found a newer generation")
    first, code = next(((r, c) for r, c in failed if c != EXIT_FENCED), failed[0])
    tail = first.error_tail()
    how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
    message = (f"{part}: rank {first.rank} of its group of {len(ranks)} {how} (generation {generation}, "
               f"rendezvous 127.0.0.1:{port}){': ' + tail if tail else ''}; the group's other ranks were ended")
    last = tail.rsplit(" | ", 1)[-1]
    if any(last.startswith(kind + ":") or f" {kind}: " in last for kind in REFUSALS) and "rendezvous" not in tail:
        return RankGroupRefused(message + ". Fix what the rank refused, then resume")
    return RankGroupFailed(message + ". A retry starts a fresh group from the same cut")
