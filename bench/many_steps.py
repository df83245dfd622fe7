"""10,000 checkpoints: listing, restore of the latest, retention and GC over a run with many committed
steps of a small state.

    python -m bench.many_steps                                # 10,000 steps, local store
    python -m bench.many_steps --steps 2000 --store s3 --json bench-results/many-steps-s3.json

The run is written once (``Checkpointer.save`` of a 16 KiB state that changes a little every step,
a verdict per step, as validations would write), then, each from a fresh process where it matters:

* ``ckpt ls URL`` (the newest page) and ``ckpt ls URL --before S`` (a page back), as subprocesses;
* ``restore()`` of the latest step by a fresh ``Checkpointer``, and ``latest_step(healthy=True)``;
* GC with a retention policy that keeps the newest 100 steps and every 1,000th (``--keep-last 100
  --keep-every 1000``): seconds, store requests, and its peak Python memory (``tracemalloc``) in a
  process of its own (with the folded marks of ``ckptlib.gc``, the marks are the distinct objects
  of the run, not one set per step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from .common import ROOT, machine, save_json, store_root, table, workdir
from .requests import RecordingStore


def write_run(url: str, so: dict | None, steps: int, threads: int = 8) -> float:
    """``steps`` committed checkpoints of a small state (saved in order; verdicts written beside)."""
    import torch

    from ckptlib import Checkpointer
    from ckptlib.commit import validation_key

    t0 = time.perf_counter()
    w = torch.zeros(4096)
    with Checkpointer(url, so, threads=threads) as ck:
        for s in range(steps):
            w[s % 4096] += 1.0
            ck.save(s, {"model": {"w": w}, "step": s})
            ck.store.put(validation_key(s), json.dumps({"passed": True, "step": s}).encode())
            if s % 1000 == 999:
                print(f"  {s + 1} steps written ({time.perf_counter() - t0:.0f} s)", flush=True)
    return time.perf_counter() - t0


def cli(*args: str, env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "ckpt", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"ckpt {' '.join(args)} failed: {out.stderr[-2000:]}")
    return time.perf_counter() - t0, out.stdout


def measure_in_process(url: str, so: dict | None) -> dict[str, Any]:
    from ckptlib import Checkpointer
    from ckptlib.store import Store

    rec: dict[str, Any] = {}
    store = RecordingStore(Store.from_url(url, so))
    with Checkpointer(store) as ck:
        t0 = time.perf_counter()
        steps = ck.steps()
        rec["list_steps_s"] = round(time.perf_counter() - t0, 3)
        rec["list_requests"] = store.reset().total
        t0 = time.perf_counter()
        state = ck.restore()
        rec["restore_latest_s"] = round(time.perf_counter() - t0, 3)
        rec["restore_requests"] = store.reset().total
        assert state["step"] == steps[-1]
        t0 = time.perf_counter()
        healthy = ck.latest_step(healthy=True)
        rec["latest_healthy_s"] = round(time.perf_counter() - t0, 3)
        rec["latest_healthy_requests"] = store.reset().total
        assert healthy == steps[-1]
    return rec


GC_CHILD = """
import json, sys, time, tracemalloc
from ckptlib import Checkpointer, RetentionPolicy
from ckptlib.store import Store
from bench.requests import RecordingStore
url, so, dry = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "dry"
tracemalloc.start()
store = RecordingStore(Store.from_url(url, so or None))
with Checkpointer(store) as ck:
    t0 = time.perf_counter()
    r = ck.gc(RetentionPolicy(keep_last=100, keep_every=1000), grace_s=0, dry_run=dry)
    s = time.perf_counter() - t0
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"seconds": round(s, 2), "requests": store.counts.total, "by_verb": dict(store.counts.by_verb),
                  "kept": len(r.kept_steps), "dropped": len(r.dropped_steps), "deleted": len(r.deleted_objects),
                  "peak_mib": round(peak / 2**20, 1)}))
"""


def gc_child(url: str, so: dict | None, dry: bool, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", GC_CHILD, url, json.dumps(so or {}), "dry" if dry else "real"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"gc failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(kind: str, steps: int) -> dict[str, Any]:
    here = workdir(f"many-{kind}")
    with store_root(kind, here) as (root, so):
        url = f"{root}/many"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if so:
            env["CKPT_STORAGE_OPTIONS"] = json.dumps(so)
        rec: dict[str, Any] = {"store": kind, "steps": steps}
        print(f"{kind}: writing {steps} checkpoints", flush=True)
        rec["write_s"] = round(write_run(url, so, steps), 1)
        rec.update(measure_in_process(url, so))
        rec["ls_s"], out = cli("ls", url, env=env)
        rec["ls_rows"] = sum(1 for line in out.splitlines() if line.strip()[:1].isdigit() or "│" in line) - 1
        rec["ls_page_back_s"], _ = cli("ls", url, "--before", str(steps // 2), env=env)
        rec["gc_dry"] = gc_child(url, so, True, env)
        rec["gc"] = gc_child(url, so, False, env)
        rec["restore_after_gc_s"] = measure_in_process(url, so)["restore_latest_s"]
    print(f"{kind}: {json.dumps(rec)}", flush=True)
    return rec


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--store", choices=["s3", "local"], nargs="+", default=["local"])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    records = [run(kind, args.steps) for kind in args.store]
    rows = [{**r, "gc_s": r["gc"]["seconds"], "gc_requests": r["gc"]["requests"], "gc_peak_mib": r["gc"]["peak_mib"],
             "gc_dropped": r["gc"]["dropped"], "gc_deleted": r["gc"]["deleted"]} for r in records]
    print(f"\nmachine: {machine()}\n")
    print(table(rows, [("store", "store"), ("steps", "steps"), ("ls_s", "ckpt ls s"), ("ls_page_back_s", "ls --before s"),
                       ("restore_latest_s", "restore latest s"), ("restore_requests", "restore requests"),
                       ("latest_healthy_s", "latest healthy s"), ("gc_s", "GC s"), ("gc_requests", "GC requests"),
                       ("gc_dropped", "steps dropped"), ("gc_deleted", "objects deleted"), ("gc_peak_mib", "GC peak MiB")]))
    save_json(args.json, {"machine": machine(), "records": records})
    return records


if __name__ == "__main__":
    main()
