"""One shard's round, without Prefect: load the cut, build the workload, train with beats, write the fragment.

``tasks/shard.py`` wraps ``train_shard_round`` as the Prefect task ``train-shard``; everything it
exchanges is small (URLs, ints, a ``Cut``), never tensors. What the fragment holds is the contract
in ``docs/run-layout.md``.

The round is a short driver over named steps, each a function of the attempt (``ShardAttempt``:
which shard, which round, from which cut, as which generation)::

    hb    = start_heartbeat(attempt)           # heartbeats/shard-<i>.json, its meta a ShardInfo
    state = load_cut(attempt)                  # the coordinator's model + this shard's own part
    wl    = build_workload_from(attempt, state)
    loss  = train_steps(attempt, wl, hb)       # steps_per_round steps, a beat after each, chaos strikes
    frag  = write_round_fragment(attempt, wl, loss, clock)   # fragments/<round>/shard-<i>.g<gen>.json

Guarantees
----------
* Determinism: a round is a pure function of the cut it starts from and ``RunSpec``. Data order
  and every random number derive from (seed, shard, round/position); nothing reads the global
  RNGs, the time, the host or the thread. So a retried, resumed or re-run round writes the same
  fragment (same digest) and ``put_fragment`` finds it identical. Bit-exactness holds for one
  torch build and thread count (``torch_threads`` is part of the spec).
* Non-deterministic values (wall times, host, attempt) go into the fragment's ``meta``, which the
  digest does not cover.
* A round never starts from anything but a cut: a committed manifest, or (between published cuts,
  ``checkpoint_every > 1``) the fragments the coordinator combined, named by generation.
* A newer generation of the shard (a watchdog's fence) stops the attempt: ``FencedError`` from a
  beat or from the fragment write.
"""

from __future__ import annotations

import math
import random
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptlib import Checkpointer, FencedError
from ckptlib.distributed.documents import AnyFragment
from ckptlib.heartbeat import Beat, Heartbeat

from .chaos import Chaos, strike
from .documents import Cut, ShardInfo
from .layout import COORDINATOR, shard_part
from .reshard import cut_shards, reshard_state
from .results import ShardResult
from .spec import RunSpec
from .timing import Stopwatch

if TYPE_CHECKING:
    from workloads import Workload


def apply_threads(spec: RunSpec) -> None:
    """``torch.set_num_threads`` is process-wide: every task of a run sets the same value."""
    if torch.get_num_threads() != spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)


class ShardRNG:
    """A shard's own generators (torch, numpy, python), seeded from (seed, shard, round).

    Shards run as threads of one process by default, so global RNGs would be shared: nothing in a
    run uses them. The built-in workloads draw their batches from generators of (seed, shard,
    position) and need none of these; they are kept (and saved, as the run layout asks) for
    workloads or augmentations that want per-shard randomness.
    """

    def __init__(self, seed: int, shard: int, round_no: int):
        from workloads.common import derive_seed

        s = derive_seed("shard-rng", seed, shard, round_no)
        self.torch = torch.Generator().manual_seed(s)
        self.numpy = np.random.RandomState(s % 2**32)
        self.python = random.Random(s)

    def state(self) -> dict[str, Any]:
        return {"torch": self.torch.get_state(), "numpy": self.numpy.get_state(), "python": self.python.getstate()}


def read_cut_part(ck: Checkpointer, cut: Cut, part: str) -> Any:
    """``part``'s state in ``cut``; it becomes ``ck``'s delta base for ``part`` (the next write of
    ``part`` is a delta against it)."""
    if cut.committed:
        return ck.restore(cut.step, part=part, keep_base=True)
    return ck.read_fragment(cut.step, part, generation=cut.generations.get(part), adopt=True)


@dataclass(frozen=True)
class ShardAttempt:
    """One attempt at one shard's round: what each step of it needs. ``generation`` is the shard's
    live generation when the attempt started: its beats, fence checks and fragment are that one's."""

    ck: Checkpointer
    spec: RunSpec  # the trajectory
    shard: int
    round_no: int
    cut: Cut
    generation: int
    attempt: int = 1
    chaos: Sequence[Chaos] = ()

    @property
    def part(self) -> str:
        return shard_part(self.shard)


def train_shard_round(ck: Checkpointer, spec: RunSpec, shard: int, round_no: int, cut: Cut, *,
                      attempt: int = 1, chaos: Sequence[Chaos] = (), heartbeat_every_s: float = 2.0,
                      on_beat: Callable[[Beat], None] | None = None) -> ShardResult:
    """Load ``cut``, train ``steps_per_round`` steps of shard ``shard``, write its fragment of step
    ``round_no`` with its live generation. Returns the loss, sizes and timings (``finished``).

    Raises FencedError (from a heartbeat or the fragment write) when a newer attempt owns the shard.
    """
    clock = Stopwatch()
    spec = spec.trajectory()
    apply_threads(spec)
    a = ShardAttempt(ck, spec, shard, round_no, cut, ck.live_generation(shard_part(shard)), attempt, chaos)
    hb = start_heartbeat(a, every_s=heartbeat_every_s, on_beat=on_beat)
    loss = float("nan")
    try:
        state = load_cut(a)
        clock.lap("load")
        wl = build_workload_from(a, state)
        del state
        # loaded and built: say so now (round_step 0), so that a watchdog times the steps from here
        # (before this beat it allows the start timeout: loading is slow in a fresh process)
        hb.beat(step=int(wl.data_position), force=True)
        clock.lap("build")
        loss = train_steps(a, wl, hb)
        clock.lap("train")
        frag = write_round_fragment(a, wl, loss, clock)
        clock.lap("write")
    except BaseException as e:
        hb.finish("fenced" if isinstance(e, FencedError) else "failed", error=f"{type(e).__name__}: {e}")
        raise
    hb.finish("finished", loss=loss)
    return ShardResult(shard=shard, round=round_no, part=a.part, status="finished", generation=a.generation,
                       attempt=attempt, loss=loss, data_position=int(wl.data_position),
                       bytes_written=frag.bytes_written, logical_bytes=frag.logical_bytes, chunks=dict(frag.stats),
                       digest=frag.digest, seconds=clock.seconds())


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


def train_steps(a: ShardAttempt, wl: Workload, hb: Heartbeat) -> float:
    """``steps_per_round`` steps, a beat after each (written at most every ``every_s``), the
    attempt's chaos striking at its step; the round's mean loss."""
    strikes = {c.strike_step(a.spec.steps_per_round): c for c in a.chaos}
    losses = []
    for k in range(1, a.spec.steps_per_round + 1):
        losses.append(float(wl.train_step()))
        if k in strikes:
            strike(strikes[k], part=a.part, round_step=k, heartbeat=hb, checkpointer=a.ck, generation=a.generation)
        hb.beat(step=int(wl.data_position), loss=losses[-1])
    return math.fsum(losses) / len(losses)


def write_round_fragment(a: ShardAttempt, wl: Workload, loss: float, clock: Stopwatch) -> AnyFragment:
    """``fragments/<round>/<part>.g<generation>.json``: the workload's state, the shard's generators,
    its round and loss (``docs/run-layout.md``); timings and host in ``meta``, outside the digest."""
    state = {**wl.checkpoint_state(), "rng": ShardRNG(a.spec.seed, a.shard, a.round_no).state(),
             "round": a.round_no, "loss": loss}
    return a.ck.write_fragment(a.round_no, a.part, state, generation=a.generation, config_hash=a.spec.config_hash(),
                               meta={"round": a.round_no, "loss": loss, "attempt": a.attempt,
                                     "host": socket.gethostname(), "load_s": clock.spent("load"),
                                     "build_s": clock.spent("build"), "train_s": clock.spent("train")})
