"""Where a training run starts, step 0, and one shard's round, without Prefect.

``tasks/`` wraps these as Prefect tasks; everything they exchange is small (URLs, ints, a ``Cut``,
dicts of floats), never tensors. What each checkpoint holds is the contract in ``docs/run-layout.md``.

Who calls what, in which order
------------------------------
::

    plan = plan_run(ck, spec, resume=...)            # refuse / resume: where to start
    initial_cut(ck, spec)                            # step 0 (when there is no healthy checkpoint)
    for r in start+1 .. R:
        cut = Cut(step=r-1, ...)                     # the cut to start from
        train_shard_round(ck_i, spec, i, r, cut, ...)  for every shard i (any order, anywhere)
        cut_round(ck, spec, r, cut, publish=...)     # trainrun.cut: gather, combine, commit

Guarantees
----------
* Determinism: a round is a pure function of the cut it starts from and ``RunSpec``. Data order
  and every random number derive from (seed, shard, round/position); nothing reads the global
  RNGs, the time, the host or the thread. So a retried, resumed or re-run round writes the same
  fragments (same digests), ``put_fragment``/``publish`` find them identical, and two runs with the
  same spec have the same digest at every step. Bit-exactness holds for one torch build and thread
  count (``torch_threads`` is part of the spec).
* Non-deterministic values (wall times, host, attempt) go into fragment/manifest ``meta``, which the
  digest does not cover.
* A round never starts from anything but a cut: a committed manifest, or (between published cuts,
  ``checkpoint_every > 1``) the fragments the coordinator combined, named by generation.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ckptlib import Checkpointer, FencedError
from ckptlib.heartbeat import Beat, Heartbeat
from ckptlib.tree import unflatten

from .chaos import Chaos, strike
from .documents import Cut, ShardInfo
from .layout import COORDINATOR, shard_part
from .outer import outer_optimizer
from .reshard import cut_shards, reshard_state
from .spec import DEFAULT_COMMIT_TIMEOUT_S, RunSpec, describe_changes

log = logging.getLogger("trainrun.rounds")


class RunRefused(ValueError):
    """A run cannot start or continue as asked (existing checkpoints, changed configuration)."""


def apply_threads(spec: RunSpec) -> None:
    """``torch.set_num_threads`` is process-wide: every task of a run sets the same value."""
    if torch.get_num_threads() != spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)


def round_s(x: float) -> float:
    return round(x, 4)


def elapsed(t0: float) -> float:
    return round_s(time.perf_counter() - t0)


# --- where a run starts ----------------------------------------------------------------------------

def stored_config(ck: Checkpointer, step: int) -> dict[str, Any] | None:
    """The ``config`` of the coordinator part of committed ``step`` (its fragment; no chunk read)."""
    if COORDINATOR not in ck.manifest(step).parts:
        return None
    frag = ck.fragment(step, COORDINATOR)
    if not isinstance(frag.skeleton, dict) or "config" not in frag.skeleton:
        return None
    config = unflatten(frag.skeleton["config"], [])
    return config if isinstance(config, dict) else None


def plan_run(ck: Checkpointer, spec: RunSpec, *, resume: bool, run_id: str = "",
             from_step: int | None = None) -> dict[str, Any]:
    """Where a run starts. Raises RunRefused when it must not start (see the resume rules).

    ``from_step`` (with ``resume``): start from this committed step rather than the last healthy
    one (the form's ``start_from``; it need not be validated: it is validated again as the run goes).
    Returns ``{"start_step": int | None, "committed": int, "latest": int | None, "note": str,
    "reshard": {"step", "shards": [old, new]} | None, "seconds"}``; ``start_step`` None means "from
    scratch" (write step 0 first). A resume with another ``shards`` (and every other trajectory field
    the same) reshards from the last healthy step (``trainrun.reshard``) when that step is the
    latest committed one. Cost: one listing of the manifests, and verdicts read from the newest
    step back to the first healthy one (not every step's: runs may hold thousands).
    """
    t0 = time.perf_counter()
    out = _plan(ck, spec.trajectory(), resume=resume, run_id=run_id, from_step=from_step)
    out["seconds"] = elapsed(t0)
    return out


# How to resume, said to both kinds of users: the CLI's and the form's (deployments, the UI).
HOW_TO_RESUME = "resume (`ckpt train --resume`, or resume: true in the form), with the same run id and store"


def _plan(ck: Checkpointer, spec: RunSpec, *, resume: bool, run_id: str, from_step: int | None) -> dict[str, Any]:
    steps = ck.steps()
    where = f"run '{run_id}' at {ck.url}" if run_id else ck.url
    if steps and not resume:
        raise RunRefused(
            f"{where} already has committed checkpoints (steps {steps[0]}..{steps[-1]}). Continue it with "
            f"{HOW_TO_RESUME}, or start a new run with another run id.")
    if from_step is not None and from_step not in steps:
        raise RunRefused(f"{where} has no committed step {from_step} to start from (committed: "
                         f"{', '.join(map(str, steps[-8:])) or 'none'}): choose one of them")
    if not steps:
        note = "nothing to resume: starting from scratch" if resume else "new run"
        return {"start_step": None, "committed": 0, "latest": None, "note": note, "reshard": None}
    at = steps[-1] if from_step is None else from_step
    old = stored_config(ck, at)
    if old is None:
        raise RunRefused(f"{where}: step {at} has no coordinator config; it was not written by a "
                         "training run. Choose another run id.")
    new = spec.to_dict()
    changed = [k for k in dict.fromkeys([*old, *new]) if old.get(k, "<absent>") != new.get(k, "<absent>")]
    if changed and (changed != ["shards"] or from_step is not None):
        raise RunRefused(
            f"cannot resume {where}: these settings differ from the run's and would change its trajectory: "
            f"{'; '.join(describe_changes(old, new))}. Resume with the run's settings (only rounds, shards, "
            f"checkpoint_every, keyframe_every, task_runner may change; shards only when resuming from the "
            f"last healthy step, not from a chosen one), or start a new run id.")
    base = {"committed": len(steps), "latest": steps[-1], "reshard": None}
    if from_step is not None:
        validated = (ck.verdict(from_step) or {}).get("passed") is True
        return {**base, "start_step": from_step, "note": f"starting from committed step {from_step}"
                + ("" if validated else " (not validated: validated again as the run goes)")}
    healthy = ck.latest_step(healthy=True)
    if changed:
        if healthy != steps[-1]:
            what = f"step {healthy}" if healthy is not None else "no step"
            raise RunRefused(
                f"cannot reshard {where} from {old['shards']} to {spec.shards} shards yet: its latest committed "
                f"step {steps[-1]} is not validated ({what} is healthy). Resharding starts a new trajectory from "
                f"the latest committed step, which later steps of the old trajectory would contradict. Validate "
                f"step {steps[-1]} (`ckpt validate {ck.url} --step {steps[-1]}`), or resume once with "
                f"--shards {old['shards']}, then resume with --shards {spec.shards}.")
        return {**base, "start_step": healthy, "reshard": {"step": healthy, "shards": [old["shards"], spec.shards]},
                "note": f"resuming from healthy step {healthy} with {spec.shards} shards instead of {old['shards']} "
                        f"(resharded: a new trajectory from step {healthy})"}
    if healthy is None:
        return {**base, "start_step": None,
                "note": "no validated checkpoint yet: starting from scratch (committed steps are recomputed "
                        "identically)"}
    return {**base, "start_step": healthy, "note": f"resuming from healthy step {healthy}"}


# --- per-shard generators ---------------------------------------------------------------------------

class ShardRNG:
    """A shard's own generators (torch, numpy, python), seeded from (seed, shard, round).

    Shards run as threads of one process by default, so global RNGs would be shared: nothing in a
    run uses them. The built-in workloads draw their batches from generators of (seed, shard,
    position) and need none of these; they are kept (and saved, as the run layout asks) for
    workloads or augmentations that want per-shard randomness.
    """

    def __init__(self, seed: int, shard: int, round: int):
        from workloads.common import derive_seed

        s = derive_seed("shard-rng", seed, shard, round)
        self.torch = torch.Generator().manual_seed(s)
        self.numpy = np.random.RandomState(s % 2**32)
        self.python = random.Random(s)

    def state(self) -> dict[str, Any]:
        return {"torch": self.torch.get_state(), "numpy": self.numpy.get_state(), "python": self.python.getstate()}


# --- loading a cut ----------------------------------------------------------------------------------

def load_part(ck: Checkpointer, cut: Cut, part: str) -> Any:
    """``part``'s state in ``cut``; it becomes ``ck``'s delta base for ``part``."""
    if cut.committed:
        return ck.restore(cut.step, part=part, keep_base=True)
    return ck.read_fragment(cut.step, part, generation=cut.generations.get(part), adopt=True)


# --- step 0 -----------------------------------------------------------------------------------------

def initial_cut(ck: Checkpointer, spec: RunSpec, *, run_meta: dict | None = None,
                commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> dict[str, Any]:
    """Write and commit step 0: every shard's fresh state and the coordinator's (idempotent)."""
    from workloads import build_workload

    t0 = time.perf_counter()
    spec = spec.trajectory()
    apply_threads(spec)
    h = spec.config_hash()
    bytes_written = 0
    write_s = 0.0
    coord_model: dict[str, torch.Tensor] = {}
    eval_loss = None
    for i in range(spec.shards):
        wl = build_workload(spec.workload_config(), i, spec.shards)
        if i == 0:
            coord_model = {k: v.detach().clone() for k, v in wl.model.state_dict().items()}
            eval_loss = float(wl.evaluate())
        state = {**wl.checkpoint_state(), "rng": ShardRNG(spec.seed, i, 0).state(), "round": 0, "loss": None}
        part = shard_part(i)
        tw = time.perf_counter()
        frag = ck.write_fragment(0, part, state, generation=ck.live_generation(part), config_hash=h,
                                 meta={"round": 0, "host": socket.gethostname()})
        write_s += time.perf_counter() - tw
        bytes_written += frag.bytes_written
    opt, _ = outer_optimizer(spec, coord_model)
    coord = {"model": coord_model, "outer_optimizer": opt.state_dict(), "round": 0, "global_step": 0,
             "config": spec.to_dict(), "metrics": {"loss": None, "eval_loss": eval_loss}}
    tw = time.perf_counter()
    frag = ck.write_fragment(0, COORDINATOR, coord, generation=ck.live_generation(COORDINATOR), config_hash=h,
                             meta={"round": 0, "eval_loss": eval_loss})
    bytes_written += frag.bytes_written
    t_commit = time.perf_counter()
    write_s += t_commit - tw
    info = ck.commit(0, spec.parts, timeout=commit_timeout_s,
                     meta={**(run_meta or {}), "round": 0, "loss": None, "eval_loss": eval_loss})
    commit_s = time.perf_counter() - t_commit
    return {"step": 0, "round": 0, "committed": True, "created": info.committed, "digest": info.digest,
            "bytes_written": bytes_written, "logical_bytes": info.logical_bytes, "stored_bytes": info.stored_bytes,
            "kind": info.kind, "chunks": info.chunks, "loss": None, "eval_loss": eval_loss, "generations": {},
            "seconds": {"save": round_s(write_s + commit_s), "commit": round_s(commit_s), "total": elapsed(t0)}}


# --- a shard's round --------------------------------------------------------------------------------

def train_shard_round(ck: Checkpointer, spec: RunSpec, shard: int, round: int, cut: Cut, *,
                      attempt: int = 1, chaos: Sequence[Chaos] = (), heartbeat_every_s: float = 2.0,
                      on_beat: Callable[[Beat], None] | None = None) -> dict[str, Any]:
    """Load ``cut``, train ``steps_per_round`` steps of shard ``shard``, write its fragment of step
    ``round`` with its live generation. Returns small JSON (loss, sizes, timings).

    Raises FencedError (from a heartbeat or the fragment write) when a newer attempt owns the shard.
    """
    from workloads import build_workload

    t0 = time.perf_counter()
    spec = spec.trajectory()
    apply_threads(spec)
    part = shard_part(shard)
    generation = ck.live_generation(part)
    # meta: what a watchdog needs to rerun this very task without a coordinator beat
    hb = Heartbeat(ck.store, part, generation=generation, round=round, steps_per_round=spec.steps_per_round,
                   every_s=heartbeat_every_s, attempt=attempt, on_beat=on_beat,
                   meta=ShardInfo(cut=cut, config_hash=spec.config_hash()).to_dict())
    hb.start()
    loss = float("nan")
    try:
        coord = load_part(ck, cut, COORDINATOR)
        # a cut of another shard count (a resumed run with new --shards): merged or split (trainrun.reshard)
        mine = load_part(ck, cut, part) if cut_shards(ck, cut) == spec.shards else \
            reshard_state(ck, cut, shard, spec.shards)
        t_loaded = time.perf_counter()
        wl = build_workload(spec.workload_config(), shard, spec.shards)
        wl.load_state_dict({**mine, "model": coord["model"]})
        del coord, mine
        rng = ShardRNG(spec.seed, shard, round)
        strikes = {c.strike_step(spec.steps_per_round): c for c in chaos}
        # loaded and built: say so now (round_step 0), so that a watchdog times the steps from here
        # (before this beat it allows the start timeout: loading is slow in a fresh process)
        hb.beat(step=int(wl.data_position), force=True)
        t_train = time.perf_counter()
        losses = []
        for k in range(1, spec.steps_per_round + 1):
            losses.append(float(wl.train_step()))
            if k in strikes:
                strike(strikes[k], part=part, round_step=k, heartbeat=hb, checkpointer=ck, generation=generation)
            hb.beat(step=int(wl.data_position), loss=losses[-1])
        t_trained = time.perf_counter()
        loss = math.fsum(losses) / len(losses)
        state = {**wl.checkpoint_state(), "rng": rng.state(), "round": round, "loss": loss}
        frag = ck.write_fragment(round, part, state, generation=generation, config_hash=spec.config_hash(),
                                 meta={"round": round, "loss": loss, "attempt": attempt, "host": socket.gethostname(),
                                       "load_s": round_s(t_loaded - t0), "build_s": round_s(t_train - t_loaded),
                                       "train_s": round_s(t_trained - t_train)})
        t_written = time.perf_counter()
    except BaseException as e:
        hb.finish("fenced" if isinstance(e, FencedError) else "failed", error=f"{type(e).__name__}: {e}")
        raise
    hb.finish("finished", loss=loss)
    return {
        "shard": shard, "round": round, "part": part, "generation": generation, "attempt": attempt,
        "status": "finished", "loss": loss, "data_position": int(wl.data_position),
        "bytes_written": frag.bytes_written, "logical_bytes": frag.logical_bytes, "chunks": dict(frag.stats),
        "digest": frag.digest,
        "seconds": {"load": round_s(t_loaded - t0), "build": round_s(t_train - t_loaded),
                    "train": round_s(t_trained - t_train), "write": round_s(t_written - t_trained),
                    "total": elapsed(t0)},
    }
