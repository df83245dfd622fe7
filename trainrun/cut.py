"""The coordinator's cut of one round, as one driver (the shape of DCP's ``_save_state_dict``).

::

    frags  = gather(store, r, shard parts)         # wait for every shard's fragment of its live generation
    states = read those very fragments
    model  = outer_step(previous global model, states)   # trainrun.outer
    coord  = write the coordinator's fragment of step r
    publish(manifest of exactly frags + coord)     # only when ``publish``: every C-th round and the last

The manifest names exactly the fragments that were combined: a shard fenced between the gather and
the publish cannot slip another generation into the cut (its new fragment is the next round's
business). Between published checkpoints nothing is committed; the next round starts from the
generations this cut returns (``Cut(committed=False)``).
"""

from __future__ import annotations

import math
import time
from typing import Any

from ckptlib import Checkpointer
from ckptlib import commit as ckcommit

from .layout import COORDINATOR, shard_part
from .outer import outer_step
from .rounds import Cut, apply_threads, elapsed, load_part, round_s
from .spec import DEFAULT_COMMIT_TIMEOUT_S, RunSpec


def cut_round(ck: Checkpointer, spec: RunSpec, round: int, cut: Cut, *, publish: bool,
              commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S, run_meta: dict | None = None) -> dict[str, Any]:
    """The cut after round ``round`` from the shards of the live generation; commits step ``round``
    when ``publish``. Returns small JSON: loss, sizes, the digest, the generations combined, timings."""
    from workloads import build_workload

    t0 = time.perf_counter()
    spec = spec.trajectory()
    apply_threads(spec)
    prev = load_part(ck, cut, COORDINATOR)
    shard_parts = [shard_part(i) for i in range(spec.shards)]
    t_wait = time.perf_counter()
    gathered = ckcommit.gather(ck.store, round, shard_parts, timeout=commit_timeout_s)
    frags = {p: frag for p, (frag, _) in gathered.items()}
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
        # the coordinator's fragment as stored (the manifest records its bytes' checksum), and the
        # shards' exactly as combined
        coordinator = ckcommit.gather(ck.store, round, [COORDINATOR], timeout=commit_timeout_s)
        prior = [s for s in ck.steps() if s < round]
        manifest = ckcommit.build_manifest(round, prior[-1] if prior else None, {**coordinator, **gathered},
                                           single=False,
                                           meta={**(run_meta or {}), "round": round, "loss": loss, "eval_loss": eval_loss})
        created = ckcommit.publish(ck.store, manifest)
        out.update(committed=True, created=created, digest=manifest.digest, stored_bytes=manifest.stored_bytes,
                   kind=manifest.kind, chunks=manifest.stats, logical_bytes=manifest.logical_bytes)
    t_done = time.perf_counter()
    out["seconds"] = {"load": round_s(t_wait - t0), "wait": round_s(t_gathered - t_wait),
                      "read": round_s(t_read - t_gathered), "combine": round_s(t_combined - t_read),
                      "write": round_s(t_written - t_combined), "commit": round_s(t_done - t_written),
                      "total": elapsed(t0)}
    return out


def next_cut(result: dict[str, Any]) -> Cut:
    """The cut the next round starts from, given this cut's result."""
    return Cut(int(result["step"]), bool(result["committed"]), dict(result.get("generations", {})))
