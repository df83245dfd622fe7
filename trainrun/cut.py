"""The coordinator's cut of one round, as one driver (the shape of DCP's ``_save_state_dict``).

::

    frags  = gather(store, r, shard parts)         # wait for every shard's fragment of its live generation
    mean   = the shards' models from those very fragments, streamed (ShardMean; a group's piece by piece)
    model  = outer_step(previous global model, mean)      # trainrun.outer
    coord  = write the coordinator's fragment of step r
    commit(exactly frags + coord)                  # only when ``publish``: every C-th round and the last

The manifest names exactly the fragments that were combined: a shard fenced between the gather and
the publish cannot slip another generation into the cut (its new fragment is the next round's
business). A quorum cut (``left_out``) combines the other shards and commits the left-out ones' parts
carried from the cut the round started from (``carry_part``). Between published checkpoints nothing is committed; the next round starts from the
generations this cut returns (``CutResult.next_cut()``: a ``Cut(committed=False)``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ckptlib import Checkpointer
from ckptlib.concurrency import map_ahead
from ckptlib.distributed import GroupFragment, ShardInfo
from ckptlib.distributed.documents import AnyFragment

from .documents import Cut
from .layout import COORDINATOR, run_parts, shard_part
from .metrics import finite_metrics
from .outer import ShardMean, outer_step
from .reshard import cut_shards, reshard_state
from .results import CutResult
from .shard_attempt import ShardRNG, apply_threads
from .shard_round import read_cut_part
from .spec import DEFAULT_COMMIT_TIMEOUT_S, RunSpec
from .timing import Stopwatch

READ_AHEAD = 8  # shards' models read at once: store latency overlaps; memory holds this many models


def cut_round(ck: Checkpointer, spec: RunSpec, round_no: int, cut: Cut, *, publish: bool,
              commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S, run_meta: dict | None = None,
              left_out: Sequence[int] = ()) -> CutResult:
    """The cut after round ``round_no`` from the shards of the live generation; commits step
    ``round_no`` when ``publish``. Returns the loss, sizes, the digest (when committed), the
    generations combined and timings.

    Cost in the shard count N: one fence listing per look of the gather, N fragment reads, and of
    each shard only its model (not its optimizer state) read, ``READ_AHEAD`` at a time and added to
    the mean in shard order (memory: the accumulator and ``READ_AHEAD`` models, whatever N). The
    manifest names each part's fragment: O(N) small entries, never the shards' tensors.

    ``left_out`` (quorum mode, ``docs/training.md``): shards fenced out of this round by the flow.
    The mean is of the others; each left-out shard's part is its part of ``cut`` carried into step
    ``round_no`` (``carry_part``), written first, as its live generation."""
    from workloads import build_workload

    clock = Stopwatch()
    spec = spec.trajectory()
    apply_threads(spec)
    prev = read_cut_part(ck, cut, COORDINATOR)
    left = sorted(set(left_out))
    carried = {shard_part(i): carry_part(ck, spec, cut, i, round_no) for i in left}
    shard_parts = [shard_part(i) for i in range(spec.shards) if i not in left]
    clock.lap("load")
    gathered = ck.gather(round_no, shard_parts, timeout=commit_timeout_s)
    frags = {p: frag for p, (frag, _) in gathered.items()}
    quorum = {"quorum": {"shards": [i for i in range(spec.shards) if i not in left], "left_out": left}} if left else {}
    clock.lap("wait")
    mean = ShardMean(prev["model"])
    losses = []
    for piece in _shard_pieces(ck, round_no, [frags[p] for p in shard_parts]):
        mean.add_piece(piece.model, piece.where)
        if piece.last:
            mean.end_shard()
            losses.append(piece.loss)
    clock.lap("read")
    model, outer_state = outer_step(spec, prev["model"], prev["outer_optimizer"], mean)
    loss = math.fsum(losses) / len(losses)
    wl = build_workload(spec.workload_config(), 0, spec.shards)
    wl.model.load_state_dict(model)
    eval_loss = float(wl.evaluate())
    clock.lap("combine")
    del mean, wl
    coord = {"model": model, "outer_optimizer": outer_state, "round": round_no,
             "global_step": round_no * spec.steps_per_round, "config": spec.to_dict(),
             "metrics": {"loss": loss, "eval_loss": eval_loss}}
    reshards = _reshards(prev, cut, spec)
    if reshards:  # only a resharded run has the key: every other run's digests stay as they were
        coord["reshards"] = reshards
    frags.update({p: frag for p, (frag, _) in carried.items()})
    generations = {p: frags[p].generation for p in run_parts(spec.shards) if p in frags}
    cfrag = ck.write_fragment(round_no, COORDINATOR, coord, generation=ck.live_generation(COORDINATOR),
                              config_hash=spec.config_hash(),
                              meta={"round": round_no, **finite_metrics(loss=loss, eval_loss=eval_loss),
                                    "generations": generations, **quorum})
    generations[COORDINATOR] = cfrag.generation
    clock.lap("write")
    result = CutResult(step=round_no, committed=False, created=False, loss=loss, eval_loss=eval_loss,
                       generations=generations, bytes_written=cfrag.bytes_written + sum(
                           f.bytes_written for f, _ in carried.values()),
                       logical_bytes=cfrag.logical_bytes + sum(f.logical_bytes for f in frags.values()))
    if publish:
        meta = {**(run_meta or {}), "round": round_no, **finite_metrics(loss=loss, eval_loss=eval_loss),
                **({"reshards": reshards} if reshards else {}), **quorum}
        # the coordinator's fragment as stored, and the shards' exactly as combined (or carried)
        info = ck.commit(round_no, run_parts(spec.shards), fragments={**gathered, **carried},
                         parent=_parent(ck, cut, round_no), meta=meta, timeout=commit_timeout_s)
        result = replace(result, committed=True, created=info.committed, digest=info.digest,
                         stored_bytes=info.stored_bytes, kind=info.kind, chunks=info.chunks,
                         logical_bytes=info.logical_bytes)
    clock.lap("commit")
    return replace(result, seconds=clock.seconds())


def carry_part(ck: Checkpointer, spec: RunSpec, cut: Cut, shard: int, round_no: int) -> tuple[AnyFragment, str]:
    """Quorum mode: the part of a shard left out of round ``round_no``, written as its live
    generation (the flow fenced the failed attempt first) and returned as gathered (fragment and the
    checksum of its bytes). Its state is its part of ``cut`` (optimizer, scheduler, model) with
    the round's counter, its generators and its data position advanced by one round: the round's
    batches are skipped, so every shard's position stays ``round * steps_per_round`` (the next round
    and a validation read it as after any round). Deterministic: a cut retried writes it again,
    identical."""
    part = shard_part(shard)
    mine = read_cut_part(ck, cut, part) if cut_shards(ck, cut) == spec.shards else \
        reshard_state(ck, cut, shard, spec.shards)
    state = {**mine, "round": round_no, "data_position": int(mine["data_position"]) + spec.steps_per_round,
             "rng": ShardRNG(spec.seed, shard, round_no).state()}
    ck.write_fragment(round_no, part, state, generation=ck.live_generation(part), config_hash=spec.config_hash(),
                      meta={"round": round_no, "left_out": True, "carried_from": cut.step})
    return ck.gather(round_no, [part], timeout=60.0)[part]


@dataclass(frozen=True)
class _Piece:
    """A shard's model, or the part of it one rank of its group held (``where``: the blocks of the
    tensors that rank held a piece of, by name); ``last``: the shard's model is complete."""

    model: dict[str, Any]
    where: dict[str, ShardInfo]
    loss: float
    last: bool


def _shard_pieces(ck: Checkpointer, step: int, frags: list[AnyFragment]) -> Iterator[_Piece]:
    """Each fragment's model, in the order given: whole, or rank by rank for a group whose ranks held
    pieces (FSDP: no full tensor of a shard is put together in this process). The first read of
    each fragment runs ``READ_AHEAD`` fragments ahead (the fragments are read already: only the
    models' chunks are fetched), so memory holds that many models, or pieces of models."""
    def read(f: AnyFragment, rank: int = 0) -> _Piece:
        if not isinstance(f, GroupFragment):
            state = ck.read_fragment(step, f.part, generation=f.generation, fragment=f, select=["model", "loss"])
            return _Piece(state["model"], {}, float(state["loss"]), True)
        held = ck.read_rank(step, f.part, rank, generation=f.generation, fragment=f, select=["model", "loss"])
        where = {path.removeprefix("/model/"): info for path, info in held.shards.items() if path.startswith("/model/")}
        # a group whose rank 0 held no piece holds replicas (DDP): rank 0's model is the shard's
        last = not where or rank == f.world - 1
        return _Piece(held.state["model"], where, float(held.state["loss"]), last)

    with ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="cut-read") as pool:
        for f, first in zip(frags, map_ahead(pool, read, frags, READ_AHEAD)):
            yield first
            if not first.last:
                assert isinstance(f, GroupFragment)
                yield from (read(f, rank) for rank in range(1, f.world))


def _reshards(prev: dict[str, Any], cut: Cut, spec: RunSpec) -> list[dict[str, Any]]:
    """The run's shard count changes so far: the previous cut's, plus one when this round's shard
    count differs from the cut's (the first round after a resume with another ``--shards``)."""
    done = list(prev.get("reshards") or [])
    before = (prev.get("config") or {}).get("shards")
    if isinstance(before, int) and before != spec.shards:
        done.append({"step": cut.step, "shards": [before, spec.shards]})
    return done


def _parent(ck: Checkpointer, cut: Cut, round_no: int) -> int | None:
    """The committed step before ``round_no``: the cut's when it is committed (no listing: a run with
    thousands of checkpoints lists them only when it publishes every C-th round)."""
    if cut.committed:
        return cut.step
    prior = [s for s in ck.steps() if s < round_no]
    return prior[-1] if prior else None

