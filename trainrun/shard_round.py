"""One shard's round, without Prefect: start (the cut, or a shard checkpoint), train with beats and shard checkpoints, write the fragment.

``tasks/shard.py`` wraps ``train_shard_round`` as the Prefect task ``train-shard``; everything it
exchanges is small (URLs, ints, a ``Cut``), never tensors. What the fragment holds is the contract
in ``docs/run-layout.md``.

The round is one attempt (``ShardAttempt``: which shard, which round, from which cut, as which
generation) run by ``trainrun.attempt.run_attempt`` in this process; what is this host's own::

    failure = recognise_failure(...)          # an earlier attempt of this round failed? (trainrun.recovery)
    hb      = start_heartbeat(attempt)        # heartbeats/shard-<i>.json, its meta a ShardInfo
    start   = start_round(attempt, ...)       # its newest shard checkpoint (trainrun.resume_point), else the cut
    wl      = build_workload_from(attempt, start.state)
    run_attempt(attempt, host, hb, ...)       # train with beats, shard checkpoints, chaos; write the fragment

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
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ckptlib import Checkpointer
from ckptlib.heartbeat import Beat, Heartbeat

from . import preemption
from .attempt import Host, run_attempt
from .chaos import Chaos
from .documents import Cut, ShardInfo
from .layout import COORDINATOR, shard_part
from .local_tier import LocalTier
from .recovery import recognise_failure
from .reshard import cut_shards, reshard_state
from .results import ShardResult
from .resume_point import resume_point
from .shard_attempt import ShardAttempt, apply_threads
from .shard_checkpoint import Every, Start, load_checkpoint
from .spec import RunSpec
from .timing import Stopwatch

if TYPE_CHECKING:
    from workloads import Workload

log = logging.getLogger("trainrun.shard_round")


def read_cut_part(ck: Checkpointer, cut: Cut, part: str) -> Any:
    """``part``'s state in ``cut``; it becomes ``ck``'s delta base for ``part`` (the next write of
    ``part`` is a delta against it)."""
    if cut.committed:
        return ck.restore(cut.step, part=part, keep_base=True)
    return ck.read_fragment(cut.step, part, generation=cut.generations.get(part), adopt=True)


def train_shard_round(ck: Checkpointer, spec: RunSpec, shard: int, round_no: int, cut: Cut, *,
                      attempt: int = 1, chaos: Sequence[Chaos] = (), heartbeat_every_s: float = 2.0,
                      on_beat: Callable[[Beat], None] | None = None, checkpoint_every: Every = "auto",
                      local_tier: LocalTier | None = None, generation: int | None = None) -> ShardResult:
    """Train shard ``shard``'s round ``round_no`` (from its newest shard checkpoint of this round,
    else from ``cut``), checkpointing it every ``checkpoint_every`` steps (``"auto"``: at about 2%
    of the training time; 0: never), then write its fragment of step ``round_no`` as ``generation``
    (None: the shard's live generation, read now; a caller that decided to train from what it read
    before passes the generation it read then, so a fence since stops this attempt).
    ``local_tier``: where shard checkpoints are also kept on this host (None: not).
    Returns the loss, sizes and timings (``finished``).

    Raises FencedError (from a heartbeat, a shard checkpoint or the fragment write) when a newer
    attempt owns the shard.
    """
    clock = Stopwatch()
    started_at = time.time()
    spec = spec.trajectory()
    apply_threads(spec)
    if generation is None:
        generation = ck.live_generation(shard_part(shard))
    a = ShardAttempt(ck, spec, shard, round_no, cut, generation, attempt, chaos)
    # before this attempt's first beat replaces the earlier attempt's last
    failure = recognise_failure(ck.store, a.part, round_no, cut.step, a.generation)
    host = Host(start=lambda signature: start_round(a, checkpoint_every, local_tier, signature),
                build=lambda state: build_workload_from(a, state), stop_vote=preemption.requested,
                read_base=lambda: base_from_cut(a))
    # a SIGTERM waits (within its grace) until this attempt has checkpointed and said where it stopped
    with preemption.training():
        hb = start_heartbeat(a, every_s=heartbeat_every_s, on_beat=on_beat)
        return run_attempt(a, host, hb, failure=failure, every=checkpoint_every, tier=local_tier, clock=clock,
                           started_at=started_at)


def start_round(a: ShardAttempt, checkpoint_every: Every, local_tier: LocalTier | None,
                signature: dict[str, Any]) -> Start:
    """Where the attempt starts: its newest usable shard checkpoint of this round (written from the
    cut of ``signature``), else the cut."""
    ref = resume_point(a.ck.store, a.part, a.round_no, a.generation) if checkpoint_every != 0 else None
    start = load_checkpoint(a, ref, signature, local_tier) if ref is not None else None
    if start is not None:
        log.info("%s round %d: continues from its shard checkpoint at step %d (%s, from %s)", a.part, a.round_no,
                 start.round_step, ref.key if ref else "", start.source)
        return start
    return Start(load_cut(a))


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
