"""One shard's round, without Prefect: start (the cut, or a shard checkpoint), train with beats and shard checkpoints, write the fragment.

``tasks/shard.py`` wraps ``train_shard_round`` as the Prefect task ``train-shard``; everything it
exchanges is small (URLs, ints, a ``Cut``), never tensors. What the fragment holds is the contract
in ``docs/run-layout.md``.

The round is a short driver over named steps, each a function of the attempt (``ShardAttempt``:
which shard, which round, from which cut, as which generation)::

    failure = recognise_failure(attempt)       # an earlier attempt of this round failed? (trainrun.recovery)
    hb      = start_heartbeat(attempt)         # heartbeats/shard-<i>.json, its meta a ShardInfo
    start   = start_round(attempt, ...)        # its newest shard checkpoint (trainrun.resume_point), else the cut
    wl      = build_workload_from(attempt, start.state)
    loss    = train_steps(attempt, wl, hb, start, saver)   # the rest of the round: beats, shard checkpoints, chaos
    frag    = write_round_fragment(attempt, wl, loss, clock)   # fragments/<round>/shard-<i>.g<gen>.json

Guarantees
----------
* Determinism: a round is a pure function of the cut it starts from and ``RunSpec``. Data order
  and every random number derive from (seed, shard, round/position); nothing reads the global
  RNGs, the time, the host or the thread. So a retried, resumed or re-run round writes the same
  fragment (same digest) and ``put_fragment`` finds it identical. An attempt that continues from a
  shard checkpoint at step k (``trainrun.shard_checkpoint``) runs steps k+1.. exactly as the attempt
  that wrote it would have: the result depends neither on the checkpoint cadence nor on where a
  failure struck. Bit-exactness holds for one torch build and thread count (``torch_threads`` is
  part of the spec).
* Non-deterministic values (wall times, host, attempt) go into the fragment's ``meta``, which the
  digest does not cover.
* A round starts from a cut (a committed manifest, or between published cuts, ``checkpoint_every >
  1``, the fragments the coordinator combined, named by generation), or from a shard checkpoint of
  that very cut written by a live generation of the shard.
* The round's fragment is a delta against the cut's part, as without shard checkpoints: the
  committed bytes and delta chains do not depend on them (an attempt that continued from one
  reads the cut's part again before it writes).
* A newer generation of the shard (a watchdog's fence) stops the attempt: ``FencedError`` from a
  beat, a shard checkpoint or the fragment write.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from ckptlib import Checkpointer, FencedError, commit
from ckptlib.distributed.documents import AnyFragment
from ckptlib.heartbeat import Beat, Heartbeat, read_heartbeat

from . import preemption
from .chaos import Chaos, strike
from .documents import Cut, ShardInfo
from .errors import Preempted
from .layout import COORDINATOR, shard_part
from .local_tier import LocalTier
from .metrics import finite_metrics
from .recovery import Failure, write_recovery
from .reshard import cut_shards, reshard_state
from .results import ShardResult
from .resume_point import resume_point
from .shard_attempt import ShardAttempt, ShardRNG
from .shard_checkpoint import Every, ShardCheckpoints, Start, cut_signature, load_checkpoint
from .spec import RunSpec
from .timing import Stopwatch

if TYPE_CHECKING:
    from workloads import Workload

log = logging.getLogger("trainrun.shard_round")


def apply_threads(spec: RunSpec) -> None:
    """``torch.set_num_threads`` is process-wide: every task of a run sets the same value."""
    if torch.get_num_threads() != spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)


def read_cut_part(ck: Checkpointer, cut: Cut, part: str) -> Any:
    """``part``'s state in ``cut``; it becomes ``ck``'s delta base for ``part`` (the next write of
    ``part`` is a delta against it)."""
    if cut.committed:
        return ck.restore(cut.step, part=part, keep_base=True)
    return ck.read_fragment(cut.step, part, generation=cut.generations.get(part), adopt=True)


def train_shard_round(ck: Checkpointer, spec: RunSpec, shard: int, round_no: int, cut: Cut, *,
                      attempt: int = 1, chaos: Sequence[Chaos] = (), heartbeat_every_s: float = 2.0,
                      on_beat: Callable[[Beat], None] | None = None, checkpoint_every: Every = "auto",
                      local_tier: LocalTier | None = None) -> ShardResult:
    """Train shard ``shard``'s round ``round_no`` (from its newest shard checkpoint of this round,
    else from ``cut``), checkpointing it every ``checkpoint_every`` steps (``"auto"``: at about 2%
    of the training time; 0: never), then write its fragment of step ``round_no`` with its live
    generation. ``local_tier``: where shard checkpoints are also kept on this host (None: not).
    Returns the loss, sizes and timings (``finished``).

    Raises FencedError (from a heartbeat, a shard checkpoint or the fragment write) when a newer
    attempt owns the shard.
    """
    clock = Stopwatch()
    started_at = time.time()
    spec = spec.trajectory()
    apply_threads(spec)
    a = ShardAttempt(ck, spec, shard, round_no, cut, ck.live_generation(shard_part(shard)), attempt, chaos)
    failure = recognise_failure(a)  # before this attempt's first beat replaces the earlier attempt's last
    # a SIGTERM waits (within its grace) until this attempt has checkpointed and said where it stopped
    with preemption.training():
        hb = start_heartbeat(a, every_s=heartbeat_every_s, on_beat=on_beat)
        loss = float("nan")
        saver: ShardCheckpoints | None = None
        try:
            start, signature = start_round(a, checkpoint_every, local_tier)
            clock.lap("load")
            wl = build_workload_from(a, start.state)
            rng = ShardRNG(spec.seed, shard, round_no)
            if start.rng is not None:
                rng.set_state(start.rng)
            saver = ShardCheckpoints(a, checkpoint_every, signature, local_tier, start.round_step)
            del start.state
            # loaded and built: say so now (its round step), so that a watchdog times the steps from here
            # (before this beat it allows the start timeout: loading is slow in a fresh process)
            hb.rebase(int(wl.data_position) - start.round_step)
            hb.beat(step=int(wl.data_position), force=True)
            training_at = time.time()
            clock.lap("build")
            if failure is not None:
                write_recovery(ck.store, failure.recovery(
                    part=a.part, round_no=round_no, generation=a.generation, attempt=attempt, started_at=started_at,
                    training_at=training_at, resumed_at_step=start.round_step, source=start.source,
                    checkpoint=start.checkpoint.key if start.checkpoint else None))
            loss = train_steps(a, wl, hb, start, rng, saver)
            saver.finish()
            clock.lap("train")
            if start.round_step:
                with clock.timing("load_base"):
                    base_from_cut(a)
            frag = write_round_fragment(a, wl, loss, clock, start, saver)
            clock.lap("write")
        except BaseException as e:
            if saver is not None:
                saver.abandon()
            hb.finish("fenced" if isinstance(e, FencedError) else "failed", error=f"{type(e).__name__}: {e}")
            raise
        hb.finish("finished", loss=loss)
    if local_tier is not None:
        local_tier.drop(a.part)  # the next round starts from the cut
    return ShardResult(shard=shard, round=round_no, part=a.part, status="finished", generation=a.generation,
                       attempt=attempt, loss=loss, data_position=int(wl.data_position),
                       bytes_written=frag.bytes_written, logical_bytes=frag.logical_bytes, chunks=dict(frag.stats),
                       digest=frag.digest, seconds={**clock.seconds(), "ckpt_blocked": round(saver.blocked_s, 4),
                                                    "ckpt_write": round(saver.write_s, 4)},
                       resumed_at_step=start.round_step, start_source=start.source,
                       shard_checkpoints=saver.count, shard_checkpoint_bytes=saver.bytes_written,
                       started_at=started_at, training_at=training_at)


def recognise_failure(a: ShardAttempt) -> Failure | None:
    """The failure of an earlier attempt of this round that this attempt recovers from, if any
    (``trainrun.recovery``): read before this attempt beats."""
    try:
        prior = read_heartbeat(a.ck.store, a.part)
        if prior is None or prior.round != a.round_no:
            return None
        coordinator = read_heartbeat(a.ck.store, COORDINATOR)
        fence = commit.read_fence(a.ck.store, a.part, a.generation) if a.generation > 0 else None
        return Failure.recognise(a.ck.store, prior, coordinator, round_no=a.round_no, cut_step=a.cut.step,
                                 generation=a.generation, fence=fence)
    except Exception as e:  # noqa: BLE001 - a report: it must never stop the recovery itself
        log.warning("%s round %d: cannot tell whether this attempt is a recovery: %s", a.part, a.round_no, e)
        return None


def start_round(a: ShardAttempt, checkpoint_every: Every,
                local_tier: LocalTier | None) -> tuple[Start, dict[str, Any]]:
    """Where the attempt starts (its newest usable shard checkpoint of this round, else the cut)
    and the cut's signature its own checkpoints record."""
    signature = cut_signature(a)
    ref = resume_point(a.ck.store, a.part, a.round_no, a.generation) if checkpoint_every != 0 else None
    start = load_checkpoint(a, ref, signature, local_tier) if ref is not None else None
    if start is not None:
        log.info("%s round %d: continues from its shard checkpoint at step %d (%s, from %s)", a.part, a.round_no,
                 start.round_step, ref.key if ref else "", start.source)
        return start, signature
    return Start(load_cut(a)), signature


def base_from_cut(a: ShardAttempt) -> None:
    """An attempt that continued from a shard checkpoint reads its part of the cut again, as the
    base of its round's fragment: the fragment then is the delta a clean attempt writes."""
    if cut_shards(a.ck, a.cut) == a.spec.shards:
        read_cut_part(a.ck, a.cut, a.part)


def start_heartbeat(a: ShardAttempt, *, every_s: float, on_beat: Callable[[Beat], None] | None) -> Heartbeat:
    """The attempt's heartbeat, started. Its meta is what a watchdog needs to rerun this very round
    without a coordinator beat (``ShardInfo``: the cut, the spec's hash)."""
    hb = Heartbeat(a.ck.store, a.part, generation=a.generation, round=a.round_no,
                   steps_per_round=a.spec.steps_per_round, every_s=every_s, attempt=a.attempt, on_beat=on_beat,
                   meta=ShardInfo(cut=a.cut, config_hash=a.spec.config_hash()).to_dict())
    hb.start()
    return hb


def load_cut(a: ShardAttempt) -> dict[str, Any]:
    """The state the shard starts its round from: its own part of the cut with the coordinator's
    model. A cut of another shard count (a run resumed with new ``--shards``) is merged or split
    (``trainrun.reshard``)."""
    coord = read_cut_part(a.ck, a.cut, COORDINATOR)
    if cut_shards(a.ck, a.cut) == a.spec.shards:
        mine = read_cut_part(a.ck, a.cut, a.part)
    else:
        mine = reshard_state(a.ck, a.cut, a.shard, a.spec.shards)
    return {**mine, "model": coord["model"]}


def build_workload_from(a: ShardAttempt, state: dict[str, Any]) -> Workload:
    """The shard's workload (model, data, optimizer) holding ``state``."""
    from workloads import build_workload

    wl = build_workload(a.spec.workload_config(), a.shard, a.spec.shards)
    wl.load_state_dict(state)
    return wl


def train_steps(a: ShardAttempt, wl: Workload, hb: Heartbeat, start: Start, rng: ShardRNG,
                saver: ShardCheckpoints) -> float:
    """The round's steps after ``start.round_step``, a beat after each (written at most every
    ``every_s``), a shard checkpoint when one is due, the attempt's chaos striking at its step; the
    round's mean loss (over all its steps: the losses of the steps before ``start`` come with it)."""
    strikes = {c.strike_step(a.spec.steps_per_round): c for c in a.chaos}
    losses = list(start.losses)
    for k in range(start.round_step + 1, a.spec.steps_per_round + 1):
        if (why := preemption.requested()) is not None:  # between steps: the state is whole
            stop_preempted(a, wl, rng, saver, losses, k - 1, start.round_step, why)
        losses.append(float(wl.train_step()))
        if k in strikes:
            strike(strikes[k], part=a.part, round_step=k, heartbeat=hb, checkpointer=a.ck, generation=a.generation)
        hb.beat(step=int(wl.data_position), loss=losses[-1])
        if saver.due(k, wl):
            saver.take(k, wl, rng, losses)
            hb.meta["checkpoint_step"] = saver.newest
    return math.fsum(losses) / len(losses)


def stop_preempted(a: ShardAttempt, wl: Workload, rng: ShardRNG, saver: ShardCheckpoints, losses: list[float],
                   round_step: int, started_at: int, why: str) -> NoReturn:
    """The process is asked to stop (``trainrun.preemption``): checkpoint the state after
    ``round_step`` steps (unless the attempt's newest checkpoint, or its start, already holds it),
    wait for the write, and raise Preempted: a rerun continues from exactly here."""
    if saver.enabled and round_step > started_at and saver.newest != round_step:
        saver.take(round_step, wl, rng, losses)
    saver.finish()  # stored (or FencedError: a newer generation owns the shard)
    kept = saver.newest if saver.newest is not None else started_at
    raise Preempted(f"{a.part} round {a.round_no} stopped at step {round_step} ({why}): its state is in a shard "
                    f"checkpoint at step {kept}; a rerun (ckpt train --resume, a retry, another worker) continues "
                    "from there", part=a.part, round_no=a.round_no, round_step=kept, reason=why)


def write_round_fragment(a: ShardAttempt, wl: Workload, loss: float, clock: Stopwatch, start: Start,
                         saver: ShardCheckpoints) -> AnyFragment:
    """``fragments/<round>/<part>.g<generation>.json``: the workload's state, the shard's generators,
    its round and loss (``docs/run-layout.md``); timings, host and how the attempt started in
    ``meta``, outside the digest."""
    state = {**wl.checkpoint_state(), "rng": ShardRNG(a.spec.seed, a.shard, a.round_no).state(),
             "round": a.round_no, "loss": loss}
    return a.ck.write_fragment(a.round_no, a.part, state, generation=a.generation, config_hash=a.spec.config_hash(),
                               meta={"round": a.round_no, **finite_metrics(loss=loss), "attempt": a.attempt,
                                     "host": socket.gethostname(), "load_s": clock.spent("load"),
                                     "build_s": clock.spent("build"), "train_s": clock.spent("train"),
                                     "resumed_at_step": start.round_step, "start_source": start.source,
                                     **saver.stats()})
