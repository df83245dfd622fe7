"""Shard checkpoints within a round: when an attempt takes one, how it writes it, how a later attempt continues from one.

A shard checkpoint is the shard's complete state after ``k`` steps of its round (the workload's
``checkpoint_state()``: model, optimizer, scheduler, data position; the shard's generators; the
round, ``round_step`` k and the losses of steps 1..k), written as the sub-step fragment
``fragments/<round>/<part>.g<gen>.k<k>.json`` under the attempt's live generation. It is not a cut:
no manifest names it, the cut protocol and the committed digests do not change, and GC removes it
once its round's cut is committed (``docs/format.md``). Its fragment's ``meta`` records the cut the
attempt started from (``cut`` and ``cut_signature``: the digests of the cut's coordinator part and
of the shard's own part), its attempt and host.

* **When** (``Cadence``): every ``every`` round steps, or ``"auto"`` (the default): once the
  training since the last one (or since the round began) has lasted ``1 / AUTO_BUDGET`` times what
  one costs (the snapshot the loop waited for plus the background write, wall time: on a busy
  machine both the training and the write slow down), so checkpoints cost about 2% of the
  training. What one costs is measured by each write; an attempt starts from what the last one of
  the same shard cost in this process (the previous round's), else from an estimate from the
  state's size after its first step. And never more than ``AUTO_MAX_STEPS`` steps apart (waiting
  for the write in flight if need be), so that a failure recomputes at most that many steps
  whatever the machine's load (a slow write under load stretches the time rule). Never at the
  round's last step (the round's fragment is written then). And at once, at the step it is at,
  when the process is asked to stop (a SIGTERM, a cancel: ``trainrun.preemption``). A group's ranks must write each one at
  the same step (it is a collective write), and each judges time by its own clock, so they agree
  on the step instead: at the attempt's second step and at each checkpoint, every rank proposes the
  steps the time rule gives at its own pace and cost, and one ``all_reduce(MAX)`` makes the
  largest proposal every rank's next checkpoint step (the group trains at its slowest rank's pace,
  so the costliest rank's write is the one the group pays for; the step ceiling still binds).
* **How** (``ShardCheckpoints``): ``Checkpointer.write_fragment_async(compress=False)``: the loop
  waits only for the snapshot; the writing runs in the background, changed chunks raw and
  unchanged ones not at all (a checkpoint that lives for a round: its CPU matters more than its
  bytes, decision 50). A group's ranks write it together (``trainrun.rank_round``). A failed write is logged and training goes on, but a
  fenced one stops the attempt. Once stored, the checkpoint is also kept in the local tier
  (``trainrun.local_tier``).
* **From where** (``load_checkpoint``): the checkpoint ``trainrun.resume_point`` names, checked
  against the attempt's round, cut (its signature) and spec; its units from the local tier when a
  valid copy is there, else from the store. Anything that does not check out is logged and the
  attempt starts from the cut.

Nothing here changes the trajectory: a checkpoint only reads the state, and an attempt that
continues from step k runs steps k+1.. exactly as the attempt that wrote it would have.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ckptlib import FencedError, commit
from ckptlib.distributed.documents import AnyFragment
from ckptlib.errors import CheckpointError, StoreError

from .layout import COORDINATOR
from .local_tier import LocalTier, copy_name
from .resume_point import ShardCheckpointRef

if TYPE_CHECKING:
    from workloads import Workload

    from .shard_attempt import ShardAttempt, ShardRNG

log = logging.getLogger("trainrun.shard_checkpoint")

Every = int | Literal["auto"]
AUTO_BUDGET = 0.02  # "auto": checkpoints take about this share of the training time
ESTIMATED_BYTES_PER_S = 100e6  # the first checkpoint's cost, before one was measured (encode + write, measured ~120 MB/s)
MIN_COST_S = 0.01  # the fixed cost of a write (lease, fragment, fence checks): a floor of the estimate
# "auto": at most this many steps between checkpoints, the bound on a failure's recomputation
# (docs/decisions.md, decisions 48 and 50: 25 cost 13% of tinylm's training here, 50 cost 1.5%)
AUTO_MAX_STEPS = 50


# What a shard checkpoint cost, by (run URL, part), in this process: the next attempt of the shard
# here (the next round's task, a retry, a rerun) starts its cadence from it instead of an estimate.
_LAST_COST: dict[tuple[str, str], float] = {}


def step_bound(every: Every | str, steps_per_round: int) -> int:
    """The most steps a failure recomputes under cadence ``every`` (a kill -9's write in flight aside):
    N, ``auto``'s ceiling, or the whole round when shard checkpoints are off."""
    return AUTO_MAX_STEPS if every == "auto" else int(every) or steps_per_round


@dataclass
class Cadence:
    """When the next shard checkpoint is due (see the module docstring). ``agree`` (a group's ranks):
    the largest of every rank's integer, the same on every rank (one collective); it is called at
    the same round steps on every rank (the attempt's second step, and each checkpoint taken)."""

    every: Every
    cost_s: float | None = None  # what one checkpoint costs (measured, or estimated at the first step)
    since: float = field(default_factory=time.monotonic)  # when the last one was taken (or training began)
    last_step: int = 0  # the round step of the last one (or where the attempt started)
    max_steps: int = AUTO_MAX_STEPS  # "auto": never more steps apart than this
    agree: Callable[[int], int] | None = None
    next_step: int | None = None  # a group's "auto": the round step of its next checkpoint, agreed
    paced: tuple[int, float] | None = None  # a group's "auto": (step, time) its pace is measured from

    @property
    def interval_s(self) -> float:
        return (self.cost_s or MIN_COST_S) / AUTO_BUDGET

    def steps_for(self, step_s: float) -> int:
        """The steps between checkpoints that the time rule gives at ``step_s`` a step: 1..``max_steps``."""
        if step_s <= 0:
            return self.max_steps
        return max(1, min(self.max_steps, math.ceil(self.interval_s / step_s)))

    def estimate(self, state_bytes: int) -> None:
        """Until one was measured: a checkpoint of ``state_bytes`` costs what encoding it at
        ``ESTIMATED_BYTES_PER_S`` takes."""
        if self.cost_s is None:
            self.cost_s = max(MIN_COST_S, state_bytes / ESTIMATED_BYTES_PER_S)

    def due(self, round_step: int, steps_per_round: int, busy: bool, now: float | None = None) -> bool:
        if round_step >= steps_per_round or self.every == 0:
            return False
        if self.every != "auto":
            return round_step % self.every == 0
        if self.agree is not None:
            if self.next_step is None:
                now = time.monotonic() if now is None else now
                if self.paced is None:  # the first step's pace includes warming up (DDP's buckets, allocations)
                    self.paced = (round_step, now)
                    return False
                # the attempt's second step: the group agrees on its first checkpoint, at that step's pace
                self.next_step = max(round_step, self.last_step + self.agree(self._steps_at(round_step, now)))
            return round_step == self.next_step
        if round_step - self.last_step >= self.max_steps:
            return True  # the step bound holds even while a write is in flight: ``take`` waits for it
        return not busy and (time.monotonic() if now is None else now) - self.since >= self.interval_s

    def taken(self, round_step: int, at: float) -> None:
        """A checkpoint was taken at ``round_step`` (its snapshot began ``at``); a group's ranks agree
        on the next one, at the pace of the steps since the last."""
        if self.agree is not None and self.every == "auto":
            self.next_step = round_step + self.agree(self._steps_at(round_step, at))
            self.paced = (round_step, at)
        self.since, self.last_step = at, round_step

    def _steps_at(self, round_step: int, now: float) -> int:
        """``steps_for`` at this rank's pace since ``paced`` (the attempt's first step, or the last checkpoint)."""
        k0, t0 = self.paced if self.paced is not None else (self.last_step, self.since)
        return self.steps_for((now - t0) / max(1, round_step - k0))


@dataclass
class Start:
    """Where an attempt starts its round: the cut (``round_step`` 0) or a shard checkpoint."""

    state: dict[str, Any]
    round_step: int = 0
    losses: list[float] = field(default_factory=list)
    rng: dict[str, Any] | None = None
    source: str = "cut"  # cut | store | local
    checkpoint: ShardCheckpointRef | None = None


class ShardCheckpoints:
    """One attempt's shard checkpoints: at most one write in flight; counts, bytes and seconds."""

    def __init__(self, a: ShardAttempt, every: Every, signature: dict[str, Any], tier: LocalTier | None,
                 start_step: int = 0, copy: str | None = None, agree: Callable[[int], int] | None = None):
        self.a, self.signature, self.tier = a, signature, tier
        self.copy = copy or a.part  # its name in the tier (a rank of a group: trainrun.local_tier.copy_name)
        self._memo = (a.ck.url, self.copy)
        self.cadence = Cadence(every, _LAST_COST.get(self._memo), last_step=start_step, agree=agree)
        self.count = 0
        self.bytes_written = 0
        self.blocked_s = 0.0  # the loop waited: snapshots (and, with a step count, a write still in flight)
        self.write_s = 0.0  # background writes, wall time
        self.newest: int | None = None
        self._inflight: tuple[Future, int, float, float] | None = None  # future, round step, began, blocked
        self._done_at: float | None = None

    @property
    def enabled(self) -> bool:
        """Shard checkpoints are on (a cadence of 0 turns them off, a preemption's too)."""
        return self.cadence.every != 0

    def due(self, round_step: int, wl: Workload) -> bool:
        busy = self._inflight is not None and not self._inflight[0].done()
        if not busy:
            self._settle()
        if self.cadence.cost_s is None and self.cadence.every == "auto":
            self.cadence.estimate(_nbytes(wl.checkpoint_state()))  # after a step: the optimizer's moments exist
        return self.cadence.due(round_step, self.a.spec.steps_per_round, busy)

    def take(self, round_step: int, wl: Workload, rng: ShardRNG, losses: list[float]) -> None:
        """Checkpoint the state after ``round_step`` steps (returns once it is copied)."""
        t0 = time.monotonic()
        self._settle(wait=True)
        a = self.a
        state = {**wl.checkpoint_state(), "rng": rng.state(), "round": a.round_no, "round_step": round_step,
                 "losses": list(losses)}
        meta = {"cut": a.cut.to_dict(), "cut_signature": self.signature, "attempt": a.attempt,
                "host": socket.gethostname(), "time": time.time()}
        self._done_at = None
        fut = a.ck.write_fragment_async(a.round_no, a.part, state, generation=a.generation, substep=round_step,
                                        config_hash=a.spec.config_hash(), meta=meta, compress=False,
                                        on_written=self._keep_local if self.tier is not None else None)
        fut.add_done_callback(lambda _f: setattr(self, "_done_at", time.monotonic()))
        now = time.monotonic()
        self.blocked_s += now - t0
        self.cadence.taken(round_step, t0)
        self._inflight = (fut, round_step, now, now - t0)

    def _keep_local(self, frag: AnyFragment, units: Mapping[str, np.ndarray]) -> None:
        """In the background, once stored: the checkpoint's copy in the local tier (a group's: the
        units this rank stored, under the group fragment's key and digest)."""
        assert self.tier is not None
        key = commit.substep_key(frag.step, frag.part, frag.generation, frag.meta["substep"])
        self.tier.put(self.copy, frag.generation, key, frag.digest, units)

    def _settle(self, wait: bool = False) -> None:
        """Take the result of the write in flight (if it is done, or ``wait``): a fenced write stops
        the attempt (FencedError); any other failure is logged and training goes on."""
        if self._inflight is None or not (wait or self._inflight[0].done()):
            return
        fut, k, began, blocked = self._inflight
        self._inflight = None
        try:
            frag = fut.result()
        except FencedError:
            raise
        except Exception as e:  # noqa: BLE001 - a shard checkpoint that failed is not a failed round
            log.warning("%s round %d: shard checkpoint at step %d not written: %s", self.a.part, self.a.round_no, k, e)
            return
        spent = max(0.0, (self._done_at or time.monotonic()) - began)
        self.count += 1
        self.bytes_written += frag.bytes_written
        self.write_s += spent
        self.newest = k
        self.cadence.cost_s = _LAST_COST[self._memo] = max(MIN_COST_S, spent + blocked)

    def finish(self) -> None:
        """Wait for the write in flight (its FencedError is raised)."""
        self._settle(wait=True)

    def abandon(self) -> None:
        """The attempt failed: wait for the write in flight, whatever became of it."""
        try:
            self._settle(wait=True)
        except Exception:  # noqa: BLE001 - the attempt's own error is the one to report
            pass

    def stats(self) -> dict[str, Any]:
        return {"shard_checkpoints": self.count, "shard_checkpoint_bytes": self.bytes_written,
                "shard_checkpoint_newest": self.newest}


def _nbytes(state: Any) -> int:
    from workloads import state_nbytes

    return int(state_nbytes(state))


def cut_signature(a: ShardAttempt) -> dict[str, Any]:
    """The cut an attempt starts from, by content: its step and the digests of its coordinator part
    and of the shard's own part (None where the cut has none, e.g. of another shard count)."""
    cut, parts = a.cut, (COORDINATOR, a.part)
    if cut.committed:
        m = a.ck.manifest(cut.step)
        digests = {p: m.parts[p].digest if p in m.parts else None for p in parts}
    else:
        digests = {}
        for p in parts:
            gen = cut.generations.get(p)
            key = commit.fragment_key(cut.step, p, gen) if gen is not None else None
            digests[p] = commit.read_fragment(a.ck.store, key)[0].digest if key else None
    return {"step": cut.step, **digests}


def load_checkpoint(a: ShardAttempt, ref: ShardCheckpointRef, signature: dict[str, Any],
                    tier: LocalTier | None, ranks: int | None = None) -> Start | None:
    """The state of shard checkpoint ``ref``, checked against the attempt's round, cut and spec, from
    the local tier where a valid copy is there, else from the store; None (logged) when it does not
    check out or cannot be read: the attempt then starts from the cut. ``ranks``: a rank of a group
    of that many (its units come from every rank's copy)."""
    try:
        frag = commit.read_fragment(a.ck.store, ref.key)[0]  # a process's, or a group's (``trainrun.rank_round``)
        meta = frag.meta
        why = None
        if frag.config_hash != a.spec.config_hash():
            why = "another configuration wrote it"
        elif meta.get("cut_signature") != signature:
            why = f"it continues another cut ({meta.get('cut_signature')} != {signature})"
        if why is not None:
            log.warning("%s round %d: shard checkpoint %s not used: %s", a.part, a.round_no, ref.key, why)
            return None
        names = [copy_name(a.part, r) for r in range(ranks)] if ranks else [a.part]
        known = tier.get_all(names, ref.generation, ref.key, frag.digest) if tier is not None else None
        state = _read(a, ref, frag, known)
        if known is not None and state is None:
            known, state = None, _read(a, ref, frag, None)
        if state is None:
            return None
        if (state.get("round"), state.get("round_step")) != (a.round_no, ref.round_step):
            log.warning("%s round %d: shard checkpoint %s holds round %s step %s", a.part, a.round_no, ref.key,
                        state.get("round"), state.get("round_step"))
            return None
        return Start(state, ref.round_step, [float(x) for x in state.pop("losses")], state.pop("rng"),
                     "local" if known is not None else "store", ref)
    except (CheckpointError, StoreError, KeyError, TypeError, ValueError) as e:
        log.warning("%s round %d: shard checkpoint %s cannot be used (%s: %s): starting from the cut", a.part,
                    a.round_no, ref.key, type(e).__name__, e)
        return None


def _read(a: ShardAttempt, ref: ShardCheckpointRef, frag: AnyFragment,
          known: Mapping[str, np.ndarray] | None) -> dict[str, Any] | None:
    """The checkpoint's state (it becomes the base of the attempt's next checkpoint); with ``known``
    (local units) a damaged copy is logged and None."""
    try:
        return a.ck.read_fragment(a.round_no, a.part, generation=ref.generation, substep=ref.round_step, adopt=True,
                                  fragment=frag, known=known)
    except CheckpointError as e:
        if known is None:
            raise
        log.warning("%s round %d: the local copy of %s does not restore (%s): reading the store", a.part, a.round_no,
                    ref.key, e)
        return None
