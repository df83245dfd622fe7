"""Step 0 of a run: every shard's fresh state and the coordinator's, committed as the first checkpoint.

Every round starts from a checkpoint, the first included: a run with no healthy step writes this
one first (``where_to_start`` says when). Idempotent: a retry, or a resume that starts from scratch,
writes the same fragments and finds the same manifest already published.
"""

from __future__ import annotations

import socket

import torch

from ckptlib import Checkpointer

from .layout import COORDINATOR, shard_part
from .outer import outer_optimizer
from .results import CutResult
from .shard_attempt import ShardRNG, apply_threads
from .spec import DEFAULT_COMMIT_TIMEOUT_S, RunSpec
from .timing import Stopwatch


def write_step_zero(ck: Checkpointer, spec: RunSpec, *, run_meta: dict | None = None,
                    commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> CutResult:
    """Write and commit step 0: every shard's fresh state and the coordinator's (idempotent)."""
    from workloads import build_workload

    clock = Stopwatch()
    spec = spec.trajectory()
    apply_threads(spec)
    h = spec.config_hash()
    bytes_written = 0
    coord_model: dict[str, torch.Tensor] = {}
    eval_loss = None
    for i in range(spec.shards):
        wl = build_workload(spec.workload_config(), i, spec.shards)
        if i == 0:
            coord_model = {k: v.detach().clone() for k, v in wl.model.state_dict().items()}
            eval_loss = float(wl.evaluate())
        state = {**wl.checkpoint_state(), "rng": ShardRNG(spec.seed, i, 0).state(), "round": 0, "loss": None}
        part = shard_part(i)
        with clock.timing("save"):
            frag = ck.write_fragment(0, part, state, generation=ck.live_generation(part), config_hash=h,
                                     meta={"round": 0, "host": socket.gethostname()})
        bytes_written += frag.bytes_written
    opt, _ = outer_optimizer(spec, coord_model)
    coord = {"model": coord_model, "outer_optimizer": opt.state_dict(), "round": 0, "global_step": 0,
             "config": spec.to_dict(), "metrics": {"loss": None, "eval_loss": eval_loss}}
    with clock.timing("save"):
        frag = ck.write_fragment(0, COORDINATOR, coord, generation=ck.live_generation(COORDINATOR),
                                 config_hash=h, meta={"round": 0, "eval_loss": eval_loss})
    bytes_written += frag.bytes_written
    with clock.timing("commit"):
        info = ck.commit(0, spec.parts, timeout=commit_timeout_s,
                         meta={**(run_meta or {}), "round": 0, "loss": None, "eval_loss": eval_loss})
    seconds = {"save": round(clock.spent("save") + clock.spent("commit"), 4), "commit": clock.spent("commit"),
               "total": clock.total()}
    return CutResult(step=0, committed=True, created=info.committed, loss=None, eval_loss=eval_loss, generations={},
                     bytes_written=bytes_written, logical_bytes=info.logical_bytes, digest=info.digest,
                     stored_bytes=info.stored_bytes, kind=info.kind, chunks=info.chunks, seconds=seconds)
