"""``ckpt bench --distributed``: ckptlib's collective Checkpointer against DCP on the same FSDP2 jobs.

For each workload: a job of each world size in ``ranks`` (gloo on CPU, one process per rank, as
``torchrun`` would start them) trains, saves a series with every system (``SYSTEMS``: ckptlib's
``save_async``, DCP's ``save`` and DCP's ``async_save``; ``job`` says how) and restores each; each job
after the first also restores the previous world size's last checkpoints (a restore on another
world size). A record per (workload, world, system): bytes per periodic save (saves 2..N: the first
is a keyframe for ckptlib), blocked and durable seconds per save (the slowest rank's), restore
seconds on the same and on the other world size, the largest peak RSS above the baseline of any
rank over a save (and over saves 2..N: ``periodic_peak_mib``), and whether every restore gave back the saved state bit for bit (digests of the
full tensors). ``keyframe_every``: ckptlib's option (1: its low-memory mode). On a GPU machine the same jobs would run on NCCL; this runner starts gloo on CPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

SYSTEMS = ("ckptlib", "dcp", "dcp_async")


@dataclass(frozen=True)
class DistributedBenchConfig:
    workloads: tuple[str, ...] = ("tinylm", "finetune")
    ranks: tuple[int, ...] = (2, 4)
    saves: int = 5
    steps_between: int = 5
    size: str = "small"
    store: str | None = None  # a directory for the stores (default: a temporary one)
    keyframe_every: int | None = None  # ckptlib's option (None: its default; 1: keyframes only, no base bytes)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(cfg: dict[str, Any], world: int, timeout: float = 1800) -> list[dict[str, Any]]:
    """Start ``world`` ranks of ``bench.distributed.job``; each rank's result."""
    cfg = {**cfg, "port": _port()}
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-m", "bench.distributed.job", json.dumps(cfg)],
                              env={**env, "RANK": str(r)}, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    results = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"rank {r} of the {world}-rank {cfg['workload']} job failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _records(workload: str, world: int, ranks: list[dict[str, Any]], prev: list[dict[str, Any]] | None) -> list[dict]:
    out = []
    for system in SYSTEMS:
        saves = [[r["saves"][k][system] for r in ranks] for k in range(len(ranks[0]["saves"]))]
        periodic = saves[1:] or saves
        same = [r["restore_same"] for r in ranks]
        rec: dict[str, Any] = {
            "workload": workload, "world": world, "system": system,
            "bytes_per_save": mean(max(x["bytes"] for x in s) for s in periodic),
            "first_save_bytes": max(x["bytes"] for x in saves[0]),
            "blocked_s": mean(max(x["blocked_s"] for x in s) for s in periodic),
            "durable_s": mean(max(x["durable_s"] for x in s) for s in periodic),
            "peak_extra_mib": max(x["peak_extra_bytes"] for s in saves for x in s) / 2**20,
            # saves 2..N: without what a process's first save pays once (its threads' buffers, imports)
            "periodic_peak_mib": max(x["peak_extra_bytes"] for s in periodic for x in s) / 2**20,
            "restore_same_s": max(x[f"{system}_s"] for x in same),
            "exact_same": all(x[f"{system}_digest"] == ranks[0]["saved_digest"] for x in same),
        }
        if prev is not None:
            other = [r["restore_other"] for r in ranks]
            rec["restore_other_s"] = max(x[f"{system}_s"] for x in other)
            rec["restore_other_from"] = prev[0]["world"]
            rec["exact_other"] = all(x[f"{system}_digest"] == prev[0]["saved_digest"] for x in other)
        out.append(rec)
    return out


def run_distributed_benchmark(cfg: DistributedBenchConfig, progress: Callable[[str], None] = print) -> list[dict]:
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-dist-", dir=cfg.store) as tmp:
        for workload in cfg.workloads:
            prev_root, prev = None, None
            for world in cfg.ranks:
                root = Path(tmp) / workload / f"w{world}"
                progress(f"{workload}: {world} ranks, {cfg.saves} saves {cfg.steps_between} steps apart ...")
                job = {"workload": workload, "size": cfg.size, "saves": cfg.saves, "steps_between": cfg.steps_between,
                       "root": str(root), "restore_from": str(prev_root) if prev_root else None,
                       "keyframe_every": cfg.keyframe_every}
                ranks = run_job(job, world)
                records += _records(workload, world, ranks, prev)
                prev_root, prev = root, ranks
    return records


def render(records: list[dict]) -> str:
    """A plain-text table, one row per (workload, world, system), and ckptlib against DCP (sync and
    async) per job."""
    head = (f"{'workload':<10} {'ranks':>5} {'system':<9} {'bytes/save':>11} {'blocked s':>9} {'durable s':>9} "
            f"{'restore s':>9} {'other-world s':>13} {'peak +MiB':>9} {'(2..N)':>6} {'exact':>5}")
    lines = [head, "-" * len(head)]
    for r in records:
        other = f"{r['restore_other_s']:.3f} (from {r['restore_other_from']})" if "restore_other_s" in r else "-"
        exact = r["exact_same"] and r.get("exact_other", True)
        lines.append(f"{r['workload']:<10} {r['world']:>5} {r['system']:<9} {int(r['bytes_per_save']):>11} "
                     f"{r['blocked_s']:>9.3f} {r['durable_s']:>9.3f} {r['restore_same_s']:>9.3f} {other:>13} "
                     f"{r['peak_extra_mib']:>9.1f} {r['periodic_peak_mib']:>6.1f} {'yes' if exact else 'NO':>5}")
    lines.append("")
    by = {(r["workload"], r["world"], r["system"]): r for r in records}
    for (workload, world, system), r in by.items():
        if system != "ckptlib" or (workload, world, "dcp") not in by:
            continue
        d = by[(workload, world, "dcp")]
        a = by.get((workload, world, "dcp_async"))
        ratio = d["bytes_per_save"] / max(r["bytes_per_save"], 1)
        line = (f"{workload}, {world} ranks: DCP writes {ratio:.1f}x the bytes per save; blocked "
                f"{r['blocked_s']:.3f} s vs {d['blocked_s']:.3f} s (dcp)"
                + (f", {a['blocked_s']:.3f} s (dcp_async); durable {r['durable_s']:.3f} s vs "
                   f"{a['durable_s']:.3f} s (dcp_async)" if a else "")
                + f"; restore {r['restore_same_s']:.3f} s vs {d['restore_same_s']:.3f} s")
        if "restore_other_s" in r:
            line += f", on another world size {r['restore_other_s']:.3f} s vs {d['restore_other_s']:.3f} s"
        lines.append(line)
    return "\n".join(lines)
