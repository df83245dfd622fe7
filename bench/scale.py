"""Shard count: the same small model at 2, 8, 32 and 64 shards, shards in Dask worker processes
started from the ``dask`` CLI, the store on SeaweedFS S3 (or a local folder).

    python -m bench.scale                                   # 2 8 32 64 shards, 2 rounds, S3, 2 workers
    python -m bench.scale --shards 2 8 --store local --json bench-results/scale.json

It drives the runtime the flow runs (``trainrun.shard_round.train_shard_round`` on the Dask workers,
``trainrun.cut.cut_round`` here), each through a ``bench.requests.RecordingStore``, so every store
request is counted where it is made; Prefect adds a constant per task and is measured by the
end-to-end runs (docs/scale.md). Per shard count, from the last round (steady state: deltas):

* the cut: seconds without the wait for shards (load the previous global model, gather, read the
  shards' models, combine, write the coordinator part, commit), and the commit alone;
* the manifest's size, the coordinator's fragment, a shard's fragment;
* objects and bytes written in the round (chunks, fragments, the manifest), store requests of one
  shard's round and of the cut, by kind.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from .common import SMALL, machine, save_json, store_root, table, workdir, worker_env
from .requests import RecordingStore


def shard_round(url: str, spec: dict, shard: int, round: int, cut: dict, heartbeat_every_s: float) -> dict[str, Any]:
    """One shard's round on a Dask worker, counting its store requests (credentials: the worker's env)."""
    from ckptlib import Checkpointer
    from ckptlib.store import Store
    from trainrun.credentials import storage_options_from_env
    from trainrun.documents import Cut
    from trainrun.shard_round import train_shard_round
    from trainrun.spec import RunSpec

    store = RecordingStore(Store.from_url(url, storage_options_from_env()))
    with Checkpointer(store) as ck:
        out = train_shard_round(ck, RunSpec.from_dict(spec), shard, round, Cut.from_dict(cut),
                                heartbeat_every_s=heartbeat_every_s).to_dict()
    out["requests"] = store.counts.to_dict()
    return out


def measure(n: int, root: str, storage_options: dict | None, client: Any, *, rounds: int, steps: int) -> dict[str, Any]:
    from ckptlib import Checkpointer
    from ckptlib.store import Store
    from trainrun.cut import cut_round
    from trainrun.documents import Cut
    from trainrun.spec import RunSpec
    from trainrun.step_zero import write_step_zero

    spec = RunSpec(workload="tinylm", workload_extra=SMALL, shards=n, steps_per_round=steps, seed=0)
    url = f"{root.rstrip('/')}/shards-{n}"
    store = RecordingStore(Store.from_url(url, storage_options))
    rec: dict[str, Any] = {"shards": n}
    with Checkpointer(store) as ck:
        t0 = time.perf_counter()
        write_step_zero(ck, spec)
        rec["step0_s"] = round(time.perf_counter() - t0, 2)
        cut = Cut.of_step(0)
        for r in range(1, rounds + 1):
            t0 = time.perf_counter()
            futures = [client.submit(shard_round, url, spec.to_dict(), i, r, cut.to_dict(), 2.0, pure=False)
                       for i in range(n)]
            shards = client.gather(futures)
            t1 = time.perf_counter()
            store.reset()
            res = cut_round(ck, spec, r, cut, publish=True)
            t2 = time.perf_counter()
            cut = res.next_cut()
        cut_req = store.reset()
    sec = res.seconds
    shard_req = [s["requests"] for s in shards]
    created = dict(cut_req.created)
    for s in shard_req:
        for k, v in s["created"].items():
            created[k] = created.get(k, 0) + v
    raw = Store.from_url(url, storage_options)
    rec.update({
        "round_s": round(t2 - t0, 2), "shards_s": round(t1 - t0, 2),
        "cut_s": round(sec["total"] - sec["wait"], 3), "commit_s": sec["commit"],
        "cut_load_s": sec["load"], "cut_gather_s": sec["wait"], "cut_read_s": sec["read"],
        "cut_combine_s": sec["combine"], "cut_write_s": sec["write"],
        "manifest_bytes": len(raw.get(f"manifests/{rounds}.json")),
        "coordinator_fragment_bytes": len(raw.get(f"fragments/{rounds}/coordinator.g0.json")),
        "shard_fragment_bytes": len(raw.get(f"fragments/{rounds}/shard-0.g0.json")),
        "objects_round": sum(v for k, v in created.items() if k in ("chunks", "fragments", "manifests")),
        "chunks_round": created.get("chunks", 0),
        "bytes_round": cut_req.bytes_put + sum(s["bytes_put"] for s in shard_req),
        "shard_requests": round(statistics.mean(s["total"] for s in shard_req), 1),
        "shard_requests_by_verb": {k: round(statistics.mean(s["by_verb"].get(k, 0) for s in shard_req), 1)
                                   for k in ("GET", "PUT", "HEAD", "LIST", "DELETE")},
        "shard_requests_by_folder": {k: round(statistics.mean(s["by_folder"].get(k, 0) for s in shard_req), 1)
                                     for k in sorted({k for s in shard_req for k in s["by_folder"]})},
        "cut_requests": cut_req.total, "cut_requests_by_verb": dict(cut_req.by_verb),
        "cut_requests_by_folder": dict(cut_req.by_folder),
        "shard_load_s": round(statistics.mean(s["seconds"]["load"] for s in shards), 3),
        "shard_write_s": round(statistics.mean(s["seconds"]["write"] for s in shards), 3),
    })
    return rec


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="inner steps per round")
    ap.add_argument("--workers", type=int, default=2, help="dask worker processes (one thread each)")
    ap.add_argument("--store", choices=["s3", "local"], default="s3")
    ap.add_argument("--json", help="write the records here")
    args = ap.parse_args(argv)

    from distributed import Client

    from deployments.dask_cluster import DaskCluster

    here = workdir("scale")
    records = []
    with store_root(args.store, here) as (root, so), \
            DaskCluster.start(here / "dask", workers=args.workers, env=worker_env(so)) as cluster, \
            Client(cluster.address) as client:
        for n in args.shards:
            rec = measure(n, root, so, client, rounds=args.rounds, steps=args.steps)
            rec.update(store=args.store, workers=args.workers, steps=args.steps)
            records.append(rec)
            print(f"{n} shards: cut {rec['cut_s']} s (commit {rec['commit_s']} s), manifest {rec['manifest_bytes']} B, "
                  f"{rec['objects_round']} objects / {rec['bytes_round']} B per round, requests: shard "
                  f"{rec['shard_requests']} cut {rec['cut_requests']}", flush=True)
    print(f"\nmachine: {machine()}; store {args.store}; {args.workers} Dask workers; tinylm {SMALL}, "
          f"{args.steps} steps per round; last of {args.rounds} rounds\n")
    print(table(records, [("shards", "shards"), ("cut_s", "cut s"), ("commit_s", "commit s"),
                          ("cut_read_s", "read s"), ("cut_combine_s", "combine s"),
                          ("manifest_bytes", "manifest B"), ("coordinator_fragment_bytes", "coord. fragment B"),
                          ("shard_fragment_bytes", "shard fragment B"), ("objects_round", "objects/round"),
                          ("bytes_round", "bytes/round"), ("shard_requests", "requests/shard"),
                          ("cut_requests", "requests/cut")]))
    save_json(args.json, {"machine": machine(), "records": records})
    return records


if __name__ == "__main__":
    main()
