"""How one attempt at a shard's round runs, wherever it runs: the one driver of both hosts.

An attempt (``trainrun.shard_attempt.ShardAttempt``: which shard, round, cut, generation) runs
in-process (a shard task: ``trainrun.shard_round``) or as one rank of the shard's group of processes
(``trainrun.rank_round``). ``run_attempt`` is the attempt's steps, the same for both; the ``Host``
holds the few that differ, as callables::

    start = host.start(signature)        # its newest shard checkpoint of the round, else the cut (a group: agreed)
    wl    = host.build(start.state)      # the shard's workload holding it (a rank: trained as that rank)
    rng   = the shard's generators, continued from the start
    saver = ShardCheckpoints(...)        # host.copy: its name in the local tier; host.agree: a group's steps
    beat that it trains (its round step), then the recovery row when it recovers from a failure
    loss  = host.loss(train_steps(...))  # a beat after each step, shard checkpoints, chaos, host.stop_vote
    saver.finish(); host.read_base()     # continued from a checkpoint: the cut's part again, as the delta base
    frag  = write_round_fragment(...)    # fragments/<round>/<part>.g<gen>.json, host.meta in its meta
    hb.finish("finished")                # or, on any error, once the write in flight settled: failed / fenced

The guarantees are the round's (``trainrun.shard_round``): a round is a pure function of its cut
and spec, whatever the host, the checkpoint cadence or where a failure struck; a newer generation
of the shard stops the attempt (``FencedError``); a preemption stops it between two steps after a
shard checkpoint of that state (``Preempted``).
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from ckptlib import FencedError
from ckptlib.distributed.documents import AnyFragment
from ckptlib.heartbeat import Heartbeat

from .beats import started
from .chaos import strike
from .errors import Preempted
from .metrics import finite_metrics
from .recovery import Failure, write_recovery
from .results import ShardResult
from .shard_attempt import ShardAttempt, ShardRNG
from .shard_checkpoint import Every, ShardCheckpoints, Start, cut_signature
from .timing import Stopwatch

if TYPE_CHECKING:
    from workloads import Workload

    from .local_tier import LocalTier


def _same(loss: float) -> float:
    return loss


def _no_phase(hb: Heartbeat, phase: str) -> None:
    """An attempt in its own process beats no start phases: its start is timed as a whole."""


def _no_meta(clock: Stopwatch) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Host:
    """Where an attempt runs: what differs between a shard task's process and a rank of a group."""

    start: Callable[[dict[str, Any]], Start]  # where it starts, given the cut's signature
    build: Callable[[dict[str, Any]], Workload]  # the shard's workload holding a start's state
    stop_vote: Callable[[], str | None]  # before each step: why the attempt stops now (a preemption), or None
    read_base: Callable[[], None]  # the cut's part again, as the round fragment's delta base
    loss: Callable[[float], float] = _same  # the round's loss from this process's mean (a group's: over its ranks)
    phase: Callable[[Heartbeat, str], None] = _no_phase  # beat a start phase (``trainrun.beats.START_PHASES``)
    copy: str | None = None  # this process's name in the local tier (None: the part's)
    agree: Callable[[int], int] | None = None  # a group's ranks agree on the steps of its shard checkpoints
    meta: Callable[[Stopwatch], dict[str, Any]] = _no_meta  # the round fragment's extra meta
    kept_in: str = "its state is in a shard checkpoint"  # where a preempted attempt's state is, for its message


def run_attempt(a: ShardAttempt, host: Host, hb: Heartbeat, *, failure: Failure | None, every: Every,
                tier: LocalTier | None, clock: Stopwatch, started_at: float) -> ShardResult:
    """Train ``a`` as ``host`` runs it (the module docstring's steps): ``hb`` is its heartbeat, started;
    ``failure`` what it recovers from (its row is written once it trains); shard checkpoints every
    ``every`` steps (``"auto"``, 0: never), also kept in ``tier``. ``clock`` and ``started_at``: since
    the attempt began. Returns the finished round's ``ShardResult``; raises FencedError (a newer
    generation owns the shard), Preempted, or whatever stopped it, after its final beat."""
    loss = float("nan")
    saver: ShardCheckpoints | None = None
    try:
        signature = cut_signature(a)
        start = host.start(signature)
        clock.lap("load")
        host.phase(hb, "build")
        wl = host.build(start.state)
        del start.state
        rng = ShardRNG(a.spec.seed, a.shard, a.round_no)
        if start.rng is not None:
            rng.set_state(start.rng)
        saver = ShardCheckpoints(a, every, signature, tier, start.round_step, copy=host.copy, agree=host.agree)
        clock.lap("build")
        # loaded and built: say so now (its round step), so that a watchdog times the steps from here
        # (before this beat it allows the start timeout: loading is slow in a fresh process)
        started(hb)
        hb.rebase(int(wl.data_position) - start.round_step)
        hb.beat(step=int(wl.data_position), force=True)
        training_at = time.time()
        if failure is not None:
            write_recovery(a.ck.store, failure.recovery(
                part=a.part, round_no=a.round_no, generation=a.generation, attempt=a.attempt, started_at=started_at,
                training_at=training_at, resumed_at_step=start.round_step, source=start.source,
                checkpoint=start.checkpoint.key if start.checkpoint else None))
        loss = host.loss(train_steps(a, host, wl, hb, start, rng, saver))
        saver.finish()
        clock.lap("train")
        if start.round_step:
            with clock.timing("load_base"):
                host.read_base()
        frag = write_round_fragment(a, host, wl, loss, clock, start, saver)
        clock.lap("write")
    except BaseException as e:
        if saver is not None:
            saver.abandon()
        hb.finish("fenced" if isinstance(e, FencedError) else "failed", error=f"{type(e).__name__}: {e}")
        raise
    hb.finish("finished", loss=loss)
    if tier is not None:
        tier.drop(saver.copy)  # the next round starts from the cut
    return ShardResult(shard=a.shard, round=a.round_no, part=a.part, status="finished", generation=a.generation,
                       attempt=a.attempt, loss=loss, data_position=int(wl.data_position),
                       bytes_written=frag.bytes_written, logical_bytes=frag.logical_bytes, chunks=dict(frag.stats),
                       digest=frag.digest, seconds={**clock.seconds(), "ckpt_blocked": round(saver.blocked_s, 4),
                                                    "ckpt_write": round(saver.write_s, 4)},
                       resumed_at_step=start.round_step, start_source=start.source,
                       shard_checkpoints=saver.count, shard_checkpoint_bytes=saver.bytes_written,
                       started_at=started_at, training_at=training_at)


def train_steps(a: ShardAttempt, host: Host, wl: Workload, hb: Heartbeat, start: Start, rng: ShardRNG,
                saver: ShardCheckpoints) -> float:
    """The round's steps after ``start.round_step``, a beat after each (written at most every
    ``every_s``), a shard checkpoint when one is due (a group's: at the same steps on every rank, a
    collective write), the attempt's chaos striking at its step; this process's mean loss of the
    round (over all its steps: the losses of the steps before ``start`` come with it)."""
    strikes = {c.strike_step(a.spec.steps_per_round): c for c in a.chaos}
    losses = list(start.losses)
    for k in range(start.round_step + 1, a.spec.steps_per_round + 1):
        if (why := host.stop_vote()) is not None:  # between steps: the state is whole (a group: agreed)
            stop(a, host, wl, rng, saver, losses, k - 1, start.round_step, why)
        losses.append(float(wl.train_step()))
        if k in strikes:
            strike(strikes[k], part=a.part, round_step=k, heartbeat=hb, checkpointer=a.ck, generation=a.generation)
        hb.beat(step=int(wl.data_position), loss=losses[-1])
        if saver.due(k, wl):
            saver.take(k, wl, rng, losses)
            hb.meta["checkpoint_step"] = saver.newest
    return math.fsum(losses) / len(losses)


def stop(a: ShardAttempt, host: Host, wl: Workload, rng: ShardRNG, saver: ShardCheckpoints, losses: list[float],
         round_step: int, started_at: int, why: str) -> NoReturn:
    """The attempt is asked to stop after ``round_step`` steps (``trainrun.preemption``; a group's
    ranks all agreed): checkpoint that state (unless the newest checkpoint, or the start, holds
    it), wait for the write and raise Preempted: a rerun continues from exactly here."""
    saver.finish()  # the write in flight settled (a group: the same ``newest`` on every rank)
    if saver.enabled and round_step > started_at and saver.newest != round_step:
        saver.take(round_step, wl, rng, losses)
        saver.finish()  # stored (or FencedError: a newer generation owns the shard)
    kept = saver.newest if saver.newest is not None else started_at
    raise Preempted(f"{a.part} round {a.round_no} stopped at step {round_step} ({why}): {host.kept_in} at step "
                    f"{kept}; a rerun (ckpt train --resume, a retry, another worker) continues from there",
                    part=a.part, round_no=a.round_no, round_step=kept, reason=why)


def write_round_fragment(a: ShardAttempt, host: Host, wl: Workload, loss: float, clock: Stopwatch, start: Start,
                         saver: ShardCheckpoints) -> AnyFragment:
    """``fragments/<round>/<part>.g<generation>.json``: the workload's state, the shard's generators,
    its round and loss (``docs/run-layout.md``); timings, host and how the attempt started in
    ``meta``, outside the digest (a loss that is not finite is null there: JSON has no NaN)."""
    state = {**wl.checkpoint_state(), "rng": ShardRNG(a.spec.seed, a.shard, a.round_no).state(),
             "round": a.round_no, "loss": loss}
    return a.ck.write_fragment(a.round_no, a.part, state, generation=a.generation, config_hash=a.spec.config_hash(),
                               meta={"round": a.round_no, **finite_metrics(loss=loss), "attempt": a.attempt,
                                     "host": socket.gethostname(), "load_s": clock.spent("load"),
                                     "build_s": clock.spent("build"), "train_s": clock.spent("train"),
                                     "resumed_at_step": start.round_step, "start_source": start.source,
                                     **saver.stats(), **host.meta(clock)})
