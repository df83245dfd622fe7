"""One round of a training run, without Prefect: a shard's H steps, and the coordinator's cut.

The Prefect tasks in ``tasks/shard.py`` and ``tasks/checkpoint.py`` are thin wrappers around the
functions here; everything they exchange is small JSON (URLs, ints, dicts of floats), never tensors.
What each checkpoint holds is the contract in ``docs/run-layout.md``.

Who calls what, in which order
------------------------------
::

    plan = plan_run(ck, spec, resume=...)            # refuse / resume: where to start
    initial_cut(ck, spec)                            # step 0 (when there is no healthy checkpoint)
    for r in start+1 .. R:
        source = {"step": r-1, "committed": ..., "generations": {...}}   # the cut to start from
        train_shard_round(ck_i, spec, i, r, source, ...)  for every shard i (any order, anywhere)
        cut_round(ck, spec, r, source, publish=...)  # waits for every shard's live fragment, then
                                                     # the outer step, the coordinator part, commit

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

import dataclasses
import hashlib
import json
import math
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ckptlib import Checkpointer, FencedError
from ckptlib import commit as ckcommit
from ckptlib.heartbeat import Heartbeat
from ckptlib.tree import unflatten

from .chaos import Chaos, strike

COORDINATOR = "coordinator"


def shard_part(shard: int) -> str:
    return f"shard-{shard}"


class RunRefused(ValueError):
    """A run cannot start or continue as asked (existing checkpoints, changed configuration)."""


# --- the run's trajectory configuration ------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    """Everything that determines a run's trajectory. Saved as ``config`` in every coordinator part;
    a resume that changes any field is refused. (Rounds, checkpoint cadence, keyframe interval,
    store and task runner do not change the trajectory and may change between sessions.)"""

    workload: str = "tinylm"
    workload_size: str = "small"
    workload_extra: dict = field(default_factory=dict)
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    shards: int = 2
    steps_per_round: int = 150
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.steps_per_round < 1:
            raise ValueError(f"steps_per_round must be >= 1, got {self.steps_per_round}")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown run config field(s) {unknown}; known: {sorted(known)}")
        return cls(**{**d, "workload_extra": dict(d.get("workload_extra") or {})})

    def config_hash(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def workload_config(self):
        from workloads import WorkloadConfig

        return WorkloadConfig(name=self.workload, seed=self.seed, batch_size=self.batch_size, lr=self.lr,
                              size=self.workload_size, extra=dict(self.workload_extra))

    @property
    def plain_averaging(self) -> bool:
        """Outer step = the mean of the shards (no outer optimizer arithmetic at all)."""
        return self.outer_lr == 1.0 and self.outer_momentum == 0.0

    @property
    def parts(self) -> list[str]:
        return [COORDINATOR] + [shard_part(i) for i in range(self.shards)]


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["seed: 0 -> 1", ...]`` for every field that differs (in field order)."""
    names = list(old) + [k for k in new if k not in old]
    return [f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in names
            if old.get(k, "<absent>") != new.get(k, "<absent>")]


def apply_threads(spec: RunSpec) -> None:
    """``torch.set_num_threads`` is process-wide: every task of a run sets the same value."""
    if torch.get_num_threads() != spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)


# --- where a run starts ----------------------------------------------------------------------------

def stored_config(ck: Checkpointer, step: int) -> dict[str, Any] | None:
    """The ``config`` of the coordinator part of committed ``step`` (read from the manifest only)."""
    frag = ck.manifest(step).parts.get(COORDINATOR)
    if frag is None or not isinstance(frag.skeleton, dict) or "config" not in frag.skeleton:
        return None
    return unflatten(frag.skeleton["config"], [])


def plan_run(ck: Checkpointer, spec: RunSpec, *, resume: bool, run_id: str = "") -> dict[str, Any]:
    """Where a run starts. Raises RunRefused when it must not start (see the resume rules).

    Returns ``{"start_step": int | None, "committed": [...], "healthy": [...], "note": str}``;
    ``start_step`` None means "from scratch" (write step 0 first).
    """
    t0 = time.perf_counter()
    out = _plan(ck, spec, resume=resume, run_id=run_id)
    out["seconds"] = _elapsed(t0)
    return out


def _plan(ck: Checkpointer, spec: RunSpec, *, resume: bool, run_id: str) -> dict[str, Any]:
    steps = ck.steps()
    where = f"run '{run_id}' at {ck.url}" if run_id else ck.url
    if steps and not resume:
        raise RunRefused(
            f"{where} already has committed checkpoints (steps {steps[0]}..{steps[-1]}). Continue it with "
            f"--resume (same --run-id and --store), or start a new run with another --run-id.")
    if not steps:
        note = "nothing to resume: starting from scratch" if resume else "new run"
        return {"start_step": None, "committed": [], "healthy": [], "note": note}
    old = stored_config(ck, steps[-1])
    if old is None:
        raise RunRefused(f"{where}: step {steps[-1]} has no coordinator config; it was not written by a "
                         "training run. Choose another --run-id.")
    changes = describe_changes(old, spec.to_dict())
    if changes:
        raise RunRefused(
            f"cannot resume {where}: these settings differ from the run's and would change its trajectory: "
            f"{'; '.join(changes)}. Resume with the run's settings (only --rounds, --checkpoint-every, "
            f"--keyframe-every, --task-runner may change), or start a new --run-id.")
    healthy = ck.healthy_steps()
    if not healthy:
        return {"start_step": None, "committed": steps, "healthy": [],
                "note": "no validated checkpoint yet: starting from scratch (committed steps are recomputed "
                        "identically)"}
    return {"start_step": healthy[-1], "committed": steps, "healthy": healthy,
            "note": f"resuming from healthy step {healthy[-1]}"}


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

def initial_source(step: int) -> dict[str, Any]:
    return {"step": step, "committed": True, "generations": {}}


def load_part(ck: Checkpointer, source: dict[str, Any], part: str) -> Any:
    """``part``'s state in the cut ``source``; it becomes ``ck``'s delta base for ``part``."""
    step = int(source["step"])
    if source.get("committed"):
        return ck.restore(step, part=part)
    gen = source.get("generations", {}).get(part)
    return ck.read_fragment(step, part, generation=gen, adopt=True)


def _elapsed(t0: float) -> float:
    return round(time.perf_counter() - t0, 4)


# --- step 0 -----------------------------------------------------------------------------------------

def outer_optimizer(spec: RunSpec, model_state: dict[str, torch.Tensor]) -> tuple[torch.optim.SGD, list[str]]:
    """The outer optimizer over the global model's floating tensors (SGD, Nesterov when momentum > 0)."""
    names = [n for n, t in model_state.items() if t.is_floating_point()]
    params = [torch.nn.Parameter(model_state[n].detach().clone()) for n in names]
    opt = torch.optim.SGD(params, lr=spec.outer_lr, momentum=spec.outer_momentum,
                          nesterov=spec.outer_momentum > 0, foreach=False)
    return opt, names


def _clone_model_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def initial_cut(ck: Checkpointer, spec: RunSpec, *, run_meta: dict | None = None,
                commit_timeout_s: float = 600.0) -> dict[str, Any]:
    """Write and commit step 0: every shard's fresh state and the coordinator's (idempotent)."""
    from workloads import build_workload

    t0 = time.perf_counter()
    apply_threads(spec)
    h = spec.config_hash()
    bytes_written = 0
    write_s = 0.0
    coord_model, eval_loss = None, None
    for i in range(spec.shards):
        wl = build_workload(spec.workload_config(), i, spec.shards)
        if coord_model is None:
            coord_model = _clone_model_state(wl.model.state_dict())
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
            "seconds": {"save": round_s(write_s + commit_s), "commit": round_s(commit_s), "total": _elapsed(t0)}}


# --- a shard's round --------------------------------------------------------------------------------

def train_shard_round(ck: Checkpointer, spec: RunSpec, shard: int, round: int, source: dict[str, Any], *,
                      attempt: int = 1, chaos: list[Chaos] = (), heartbeat_every_s: float = 2.0,
                      on_beat: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Load the cut ``source``, train ``steps_per_round`` steps of shard ``shard``, write its fragment of
    step ``round`` with its live generation. Returns small JSON (loss, sizes, timings).

    Raises FencedError (from a heartbeat or the fragment write) when a newer attempt owns the shard.
    """
    from workloads import build_workload

    t0 = time.perf_counter()
    apply_threads(spec)
    part = shard_part(shard)
    generation = ck.live_generation(part)
    # meta: what a watchdog needs to rerun this very task (the cut it starts from, the config's hash)
    hb = Heartbeat(ck.store, part, generation=generation, round=round, steps_per_round=spec.steps_per_round,
                   every_s=heartbeat_every_s, attempt=attempt, on_beat=on_beat,
                   meta={"source": source, "config_hash": spec.config_hash(), "spec": spec.to_dict()})
    hb.start()
    try:
        coord = load_part(ck, source, COORDINATOR)
        mine = load_part(ck, source, part)
        t_loaded = time.perf_counter()
        wl = build_workload(spec.workload_config(), shard, spec.shards)
        wl.load_state_dict({**mine, "model": coord["model"]})
        del coord, mine
        rng = ShardRNG(spec.seed, shard, round)
        strikes = {c.strike_step(spec.steps_per_round): c for c in chaos}
        hb.beat(step=int(wl.data_position))
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
                    "total": _elapsed(t0)},
    }


def round_s(x: float) -> float:
    return round(x, 4)


# --- the cut ----------------------------------------------------------------------------------------

def outer_step(spec: RunSpec, global_model: dict[str, torch.Tensor], outer_state: dict,
               shard_models: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict]:
    """Combine the shards' local models into the new global model (local SGD / DiLoCo outer step).

    The shards' mean is accumulated in float64 in shard order (deterministic, and exact for one
    shard). Plain averaging (outer_lr 1, no momentum) takes the mean as is. Otherwise the outer
    gradient ``global - mean`` goes through SGD(outer_lr, momentum, Nesterov), whose state (the
    momentum buffers) is the returned outer state. Non-floating tensors are taken from shard 0.
    """
    n = len(shard_models)
    mean: dict[str, torch.Tensor] = {}
    for name, ref in global_model.items():
        if ref.is_floating_point():
            acc = torch.zeros(ref.shape, dtype=torch.float64)
            for sm in shard_models:
                acc.add_(sm[name].to(torch.float64))
            mean[name] = acc.div_(n).to(ref.dtype)
        else:
            mean[name] = shard_models[0][name].detach().clone()
    opt, names = outer_optimizer(spec, global_model)
    opt.load_state_dict(outer_state)  # copies the tensors it is given
    if spec.plain_averaging:
        return mean, opt.state_dict()
    for p, name in zip((p for g in opt.param_groups for p in g["params"]), names):
        p.grad = p.detach() - mean[name]
    opt.step()
    new = dict(mean)
    for p, name in zip((p for g in opt.param_groups for p in g["params"]), names):
        new[name] = p.detach().clone()
    return new, opt.state_dict()


def cut_round(ck: Checkpointer, spec: RunSpec, round: int, source: dict[str, Any], *, publish: bool,
              commit_timeout_s: float = 600.0, run_meta: dict | None = None) -> dict[str, Any]:
    """The coordinator: wait for every shard's fragment of the live generation for step ``round``,
    combine them (outer step), evaluate, write the coordinator part, and commit the cut if ``publish``."""
    from workloads import build_workload

    t0 = time.perf_counter()
    apply_threads(spec)
    prev = load_part(ck, source, COORDINATOR)
    shard_parts = [shard_part(i) for i in range(spec.shards)]
    t_wait = time.perf_counter()
    frags = ckcommit.gather(ck.store, round, shard_parts, timeout=commit_timeout_s)
    t_gathered = time.perf_counter()
    states = [ck.read_fragment(round, p, generation=frags[p].generation) for p in shard_parts]
    t_read = time.perf_counter()
    model, outer_state = outer_step(spec, prev["model"], prev["outer_optimizer"], [s["model"] for s in states])
    loss = math.fsum(float(s["loss"]) for s in states) / len(states)
    wl = build_workload(spec.workload_config(), 0, spec.shards)
    wl.model.load_state_dict(model)
    eval_loss = float(wl.evaluate())
    t_combined = time.perf_counter()
    del states, wl
    coord = {"model": model, "outer_optimizer": outer_state, "round": round,
             "global_step": round * spec.steps_per_round, "config": spec.to_dict(),
             "metrics": {"loss": loss, "eval_loss": eval_loss}}
    generations = {p: f.generation for p, f in frags.items()}
    cfrag = ck.write_fragment(round, COORDINATOR, coord, generation=ck.live_generation(COORDINATOR),
                              config_hash=spec.config_hash(),
                              meta={"round": round, "loss": loss, "eval_loss": eval_loss, "generations": generations})
    generations[COORDINATOR] = cfrag.generation
    t_written = time.perf_counter()
    out: dict[str, Any] = {
        "step": round, "round": round, "committed": False, "created": False, "loss": loss, "eval_loss": eval_loss,
        "generations": generations, "coordinator_bytes_written": cfrag.bytes_written,
        "logical_bytes": cfrag.logical_bytes + sum(f.logical_bytes for f in frags.values()),
        "shard_bytes_written": sum(f.bytes_written for f in frags.values()), "digest": None,
    }
    if publish:
        info = ck.commit(round, spec.parts, timeout=commit_timeout_s,
                         meta={**(run_meta or {}), "round": round, "loss": loss, "eval_loss": eval_loss})
        out.update(committed=True, created=info.committed, digest=info.digest, stored_bytes=info.stored_bytes,
                   kind=info.kind, chunks=info.chunks, logical_bytes=info.logical_bytes)
    t_done = time.perf_counter()
    out["seconds"] = {"load": round_s(t_wait - t0), "wait": round_s(t_gathered - t_wait),
                      "read": round_s(t_read - t_gathered), "combine": round_s(t_combined - t_read),
                      "write": round_s(t_written - t_combined), "commit": round_s(t_done - t_written),
                      "total": _elapsed(t0)}
    return out


def next_source(cut: dict[str, Any]) -> dict[str, Any]:
    """The cut the next round starts from."""
    return {"step": cut["step"], "committed": bool(cut["committed"]), "generations": dict(cut.get("generations", {}))}


__all__ = [
    "COORDINATOR", "RunRefused", "RunSpec", "ShardRNG", "cut_round", "describe_changes", "initial_cut",
    "initial_source", "load_part", "next_source", "outer_step", "plan_run", "shard_part", "stored_config",
    "train_shard_round",
]
