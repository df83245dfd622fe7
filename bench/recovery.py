"""Recovery benchmark (``ckpt bench --recovery``): what shard checkpoints cost, what they save, the local tier.

Three measurements on the real runtime (``trainrun.shard_round.train_shard_round``, no Prefect),
each from a copy of the same run (step 0 and the cut of round 1) on a local store:

* **cost**: round 2 of every shard trained at once (threads, as ``ckpt train`` trains them), with
  shard checkpoints at the cadence given (``auto`` by default) and without, alternating, ``repeats``
  times; the cost is the extra wall time of the round's training, against the training without (the
  median of each; on a busy machine this difference is noisier than the cost itself). Also the
  checkpoints taken, the steps between them (the N ``auto`` chose), and the seconds the loops waited
  (snapshots) and the background writes took, as shares of the training: the cost as the cadence
  counts it (blocked + background write, wall time).
* **bytes**: ``rounds`` rounds of one shard, its round fragments written as deltas against the cut
  (what the runtime does) or against its last shard checkpoint (the alternative), with a shard
  checkpoint every ``N`` steps: bytes each round's fragment writes, bytes a restore of it reads
  (its blob table), its longest delta chain, and what the store keeps for all the committed rounds
  once GC has swept the shard checkpoints (the union of the round fragments' blob tables: the
  alternative's chains hold on to the checkpoints' objects).
* **back to training**: a shard that crashed at step k of its round, started again: seconds from
  the start of the new attempt until it trains (it reads its checkpoint, builds its workload), with
  the local tier and without (the store), on the local store and on S3 (SeaweedFS on loopback).
"""

from __future__ import annotations

import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import machine, store_root, table, workdir

Progress = Callable[[str], None]
WORKLOADS = ("tinylm", "recsys", "finetune", "finetune-bf16")


def _spec(workload: str, size: str, steps: int, shards: int = 2) -> Any:
    from trainrun.spec import RunSpec

    return RunSpec(workload=workload, workload_size=size, shards=shards, steps_per_round=steps)


def _base_run(root: Path, spec: Any) -> None:
    """Step 0 and the committed cut of round 1 of ``spec`` at ``root``."""
    from ckptlib import Checkpointer
    from trainrun.cut import cut_round
    from trainrun.documents import Cut
    from trainrun.step_zero import write_step_zero

    with Checkpointer(str(root)) as ck:
        write_step_zero(ck, spec)
    _shards_at_once(root, spec, 1, Cut.of_step(0), 0)
    with Checkpointer(str(root)) as ck:
        cut_round(ck, spec, 1, Cut.of_step(0), publish=True)


def _shards_at_once(root: Path, spec: Any, round_no: int, cut: Any, every: Any) -> list[Any]:
    """Every shard's round ``round_no`` at once, one thread each (as the flow runs them)."""
    from ckptlib import Checkpointer
    from trainrun.shard_round import train_shard_round

    results: list[Any] = [None] * spec.shards
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with Checkpointer(str(root)) as ck:
                results[i] = train_shard_round(ck, spec, i, round_no, cut, checkpoint_every=every)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(spec.shards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def measure_cost(workload: str, size: str, steps: int, every: Any, repeats: int, work: Path,
                 progress: Progress) -> dict[str, Any]:
    """Round 2 with shard checkpoints every ``every`` and without, alternating (see the module docstring)."""
    from trainrun.documents import Cut

    spec = _spec(workload, size, steps)
    base = work / f"cost-{workload}"
    _base_run(base, spec)
    train: dict[Any, list[float]] = {0: [], every: []}
    ckpts, blocked, written = [], [], []
    for rep in range(repeats):
        for e in ((0, every) if rep % 2 == 0 else (every, 0)):
            trial = work / f"trial-{workload}-{rep}-{e}"
            shutil.copytree(base, trial)
            res = _shards_at_once(trial, spec, 2, Cut.of_step(1), e)
            train[e].append(max(r.seconds["train"] for r in res))
            if e != 0:
                ckpts.append(sum(r.shard_checkpoints for r in res) / len(res))
                blocked.append(sum(r.seconds["ckpt_blocked"] for r in res) / len(res))
                written.append(sum(r.seconds["ckpt_write"] for r in res) / len(res))
            shutil.rmtree(trial, ignore_errors=True)
        progress(f"  cost {workload}: repeat {rep + 1}/{repeats}")
    off, on = statistics.median(train[0]), statistics.median(train[every])
    per_round = statistics.mean(ckpts)
    return {"workload": workload, "size": size, "steps_per_round": steps, "every": every,
            "train_s_without": round(off, 3), "train_s_with": round(on, 3), "cost": round(on / off - 1.0, 4),
            "checkpoints_per_round": round(per_round, 2),
            "steps_between": round(steps / (per_round + 1), 1) if per_round else None,
            "blocked_share": round(statistics.mean(blocked) / on, 5),
            "write_share": round(statistics.mean(written) / on, 5),
            "counted_cost": round((statistics.mean(blocked) + statistics.mean(written)) / on, 5), "repeats": repeats}


def measure_bytes(workload: str, size: str, steps: int, every: int, rounds: int, work: Path) -> list[dict[str, Any]]:
    """One shard's rounds, its fragment against the cut or against its last shard checkpoint."""
    import torch

    from ckptlib import Checkpointer
    from workloads import build_workload

    spec = _spec(workload, size, steps, shards=1)
    torch.set_num_threads(1)
    out = []
    for against in ("cut", "last shard checkpoint"):
        wl = build_workload(spec.workload_config(), 0, 1)
        kept: dict[str, int] = {}
        fake = 1_000_000  # the alternative: shard checkpoints as fragments of the part itself (one chain)
        with Checkpointer(str(work / f"bytes-{workload}-{against[:3]}")) as ck:
            ck.write_fragment(0, "shard-0", wl.checkpoint_state())
            for r in range(1, rounds + 1):
                for k in range(1, steps + 1):
                    wl.train_step()
                    if k % every == 0 and k < steps:
                        if against == "cut":
                            ck.write_fragment_async(r, "shard-0", wl.checkpoint_state(), substep=k).result()
                        else:
                            fake += 1
                            ck.write_fragment(fake, "shard-0", wl.checkpoint_state())
                frag = ck.write_fragment(r, "shard-0", wl.checkpoint_state())
                kept.update({b.key: b.size for b in frag.blobs.values()})
                out.append({"workload": workload, "against": against, "round": r, "every": every,
                            "written": frag.bytes_written, "restore_reads": frag.stored_bytes,
                            "logical": frag.logical_bytes, "chain": max(b.depth for b in frag.blobs.values()),
                            "kept_after_gc": sum(kept.values())})
                ck.read_fragment(r, "shard-0", adopt=True)  # the next round starts from this cut
    return out


def measure_back_to_training(workload: str, size: str, steps: int, every: int, crash_at: int, store_kind: str,
                             repeats: int, work: Path, progress: Progress) -> list[dict[str, Any]]:
    """A crashed attempt started again, its checkpoint from the local tier or the store."""
    from ckptlib import Checkpointer
    from trainrun.chaos import parse_chaos
    from trainrun.documents import Cut
    from trainrun.local_tier import LocalTier
    from trainrun.shard_round import train_shard_round
    from trainrun.step_zero import write_step_zero

    spec = _spec(workload, size, steps, shards=1)
    rows = []
    with store_root(store_kind, work / f"btt-{workload}-{store_kind}") as (root_url, so):
        for rep in range(repeats):
            for tiered in (True, False):
                url = f"{root_url.rstrip('/')}/run-{rep}-{int(tiered)}"
                tier = LocalTier(url, root=work / "tier") if tiered else None
                with Checkpointer(url, so) as ck:
                    write_step_zero(ck, spec)
                    try:
                        train_shard_round(ck, spec, 0, 1, Cut.of_step(0), checkpoint_every=every, local_tier=tier,
                                          chaos=[parse_chaos(f"crash:shard=0,round=1,step={crash_at}")])
                    except Exception:  # noqa: BLE001 - the crash on purpose
                        pass
                t0 = time.time()
                with Checkpointer(url, so) as ck:
                    res = train_shard_round(ck, spec, 0, 1, Cut.of_step(0), attempt=2, checkpoint_every=every,
                                            local_tier=tier)
                rows.append({"workload": workload, "store": store_kind, "local_tier": tiered, "from": res.start_source,
                             "resumed_at_step": res.resumed_at_step, "back_to_training_s": round(res.training_at - t0, 4),
                             "load_s": res.seconds["load"], "build_s": res.seconds["build"]})
            progress(f"  back to training {workload} on {store_kind}: repeat {rep + 1}/{repeats}")
    return rows


def run(workloads: tuple[str, ...] = WORKLOADS, *, size: str = "small", steps: int = 150, every: Any = "auto",
        repeats: int = 5, bytes_every: int = 25, bytes_rounds: int = 4, stores: tuple[str, ...] = ("local", "s3"),
        progress: Progress = lambda _m: None) -> dict[str, Any]:
    """Every measurement of the module docstring; the records as JSON-able dicts."""
    work = workdir("recovery")
    try:
        cost = [measure_cost(w, size, steps, every, repeats, work, progress) for w in workloads]
        progress("bytes of the round's fragments")
        bytes_rows = [r for w in workloads for r in measure_bytes(w, size, steps, bytes_every, bytes_rounds, work)]
        back = [r for kind in stores for w in workloads[:1]
                for r in measure_back_to_training(w, "bench", steps, bytes_every, steps // 2 + 3, kind, repeats, work,
                                                  progress)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"machine": machine(), "cost": cost, "bytes": bytes_rows, "back_to_training": back}


def render(result: dict[str, Any]) -> str:
    """The three tables, markdown."""
    cost = table(result["cost"], [("workload", "workload"), ("every", "every"), ("train_s_without", "train s"),
                                  ("train_s_with", "with ckpts"), ("cost", "cost"),
                                  ("checkpoints_per_round", "ckpts/round"), ("steps_between", "steps apart"),
                                  ("blocked_share", "blocked"), ("write_share", "bg write"),
                                  ("counted_cost", "blocked + bg write")])
    agg: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in result["bytes"]:
        agg.setdefault((r["workload"], r["against"]), []).append(r)
    rows = [{"workload": w, "against": a, "written": sum(x["written"] for x in xs) / len(xs),
             "restore_reads": sum(x["restore_reads"] for x in xs) / len(xs), "chain": max(x["chain"] for x in xs),
             "kept": xs[-1]["kept_after_gc"]} for (w, a), xs in agg.items()]
    bytes_t = table(rows, [("workload", "workload"), ("against", "round fragment against"),
                           ("written", "bytes written / round"), ("restore_reads", "restore reads"),
                           ("chain", "longest chain"), ("kept", "kept after GC, all rounds")])
    back: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for r in result["back_to_training"]:
        back.setdefault((r["store"], r["local_tier"]), []).append(r)
    back_rows = [{"store": s, "local_tier": "yes" if t else "no", "from": xs[0]["from"],
                  "median_s": statistics.median(x["back_to_training_s"] for x in xs),
                  "load_s": statistics.median(x["load_s"] for x in xs)} for (s, t), xs in back.items()]
    back_t = table(back_rows, [("store", "store"), ("local_tier", "local tier"), ("from", "read from"),
                               ("median_s", "back to training s"), ("load_s", "of which reading the checkpoint")])
    return (f"shard checkpoint cost (round of {result['cost'][0]['steps_per_round']} steps, every shard at once)\n"
            f"{cost}\n\nthe round's fragment\n{bytes_t}\n\nback to training after a crash\n{back_t}")
