"""One rank of a benchmark job: a workload trained with FSDP2, checkpointed by ckptlib and by DCP.

Run by ``bench.distributed.run`` as ``python -m bench.distributed.job <json config>``, once per rank.
At each save point (every ``steps_between`` steps) the same state is saved by each system
(``SYSTEMS``), one after the other, each waited for until durable (the order rotates, so each system
goes first in turn): ckptlib's collective ``save_async``; DCP's ``save`` (``dcp``: blocked =
durable); DCP's ``async_save`` (``dcp_async``: thread executor, on a gloo group of its own, as DCP's
docs advise for background saves; blocked = until it returns, durable = until its future completes).
Both DCP systems write with a ``FileSystemWriter`` into a directory of their own. Then each system's
last checkpoint is restored in place (``restore_all``), and, when the config names one, the last
checkpoint another world size wrote. Rank 0 writes a digest of the
full state saved and restored (``StateDictOptions(full_state_dict=True)``), so the runner checks
that every restore is bit-exact. Each rank prints one JSON line with its measurements.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from bench.checkpoint.probes import PeakRss, release_free_memory, rss_bytes
from bench.distributed.run import SYSTEMS
from ckptlib import Checkpointer, codecs
from workloads import WorkloadConfig, build_workload


def shard_model(wl: Any) -> None:
    """FSDP2 over every direct child module (the items of a ModuleList), then the root; the optimizer
    rebuilt over the sharded parameters with the same groups and hyperparameters (no scheduler)."""
    model = wl.model
    warm = wl.make_batch(0)  # FSDP2 must see a forward of the root first (finetune labels through a child)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in wl.optimizer.param_groups]
    for child in model.children():
        for m in (child if isinstance(child, torch.nn.ModuleList) else [child]):
            if any(True for _ in m.parameters()):
                fully_shard(m)
    fully_shard(model)
    params = dict(model.named_parameters())
    wl.optimizer = type(wl.optimizer)([{**g, "params": [params[n] for n in g["params"]]} for g in groups])
    wl.scheduler = None
    with torch.no_grad():
        wl.compute_loss(warm)


def state_of(wl: Any) -> dict[str, Any]:
    msd, osd = get_state_dict(wl.model, wl.optimizer)
    return {"model": msd, "optim": osd, "data_position": int(wl.data_position)}


def full_digest(wl: Any) -> str:
    """A digest of the full (gathered) model and optimizer state (collective; every rank returns it)."""
    msd, osd = get_state_dict(wl.model, wl.optimizer, options=StateDictOptions(full_state_dict=True))
    parts = []
    for prefix, sd in (("model", msd), ("optim", osd.get("state", {}))):
        flat = torch.utils._pytree.tree_flatten_with_path(sd)[0]
        for path, v in flat:
            if isinstance(v, torch.Tensor):
                parts.append(f"{prefix}{torch.utils._pytree.keystr(path)}:{codecs.checksum(v.detach().contiguous().view(-1).view(torch.uint8).numpy())}")
    return codecs.checksum("\n".join(parts).encode())


class Timed:
    """One save's blocked and durable seconds and its peak RSS above the RSS before it."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.blocked = self.durable = 0.0
        self.peak_extra = 0

    def run(self, start: Any, wait: Any) -> Any:
        release_free_memory()
        dist.barrier()  # the ranks start together, as a training step's collectives keep them
        base = rss_bytes() or 0
        with PeakRss() as peak:
            self.t0 = time.perf_counter()
            fut = start()
            self.blocked = time.perf_counter() - self.t0
            result = wait(fut)
            self.durable = time.perf_counter() - self.t0
        self.peak_extra = max(0, (peak.peak or base) - base)
        return result


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _save(system: str, t: Timed, wl: Any, ck: Checkpointer, dcp_group: Any, root: Path, step: int) -> int:
    """Save this rank's state with ``system``, timed by ``t``; the bytes it wrote (DCP: rank 0 counts
    the whole directory, the other ranks 0)."""
    if system == "ckptlib":
        return int(t.run(lambda: ck.save_async(step, state_of(wl)), lambda f: f.result()).bytes_written)
    where = root / system / str(step)
    if system == "dcp":
        t.run(lambda: dcp.save(state_of(wl), storage_writer=FileSystemWriter(str(where))), lambda _m: None)
    else:
        t.run(lambda: dcp.async_save(state_of(wl), storage_writer=FileSystemWriter(str(where)),
                                     process_group=dcp_group), lambda f: f.result())
    dist.barrier()
    return _dir_bytes(where) if dist.get_rank() == 0 else 0


def save_series(cfg: dict[str, Any], wl: Any, ck: Checkpointer, dcp_group: Any, root: Path) -> list[dict]:
    rows = []
    for k in range(cfg["saves"]):
        for _ in range(cfg["steps_between"]):
            wl.train_step()
        step = k + 1
        record: dict[str, Any] = {"save": step}
        first = k % len(SYSTEMS)
        for system in SYSTEMS[first:] + SYSTEMS[:first]:
            t = Timed()
            written = _save(system, t, wl, ck, dcp_group, root, step)
            record[system] = {"blocked_s": t.blocked, "durable_s": t.durable, "bytes": written,
                              "peak_extra_bytes": t.peak_extra}
        rows.append(record)
    return rows


def _restore_ckptlib(wl: Any, url: str, step: int) -> float:
    with Checkpointer(url, process_group=dist.group.WORLD) as ck:
        dist.barrier()
        t0 = time.perf_counter()
        back = ck.restore(step, into=state_of(wl))
        set_state_dict(wl.model, wl.optimizer, model_state_dict=back["model"], optim_state_dict=back["optim"])
        return time.perf_counter() - t0


def _restore_dcp(wl: Any, where: Path) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    st = state_of(wl)
    dcp.load(st, checkpoint_id=str(where))
    set_state_dict(wl.model, wl.optimizer, model_state_dict=st["model"], optim_state_dict=st["optim"])
    return time.perf_counter() - t0


def restore_all(wl: Any, root: Path, step: int, repeats: int = 3) -> dict[str, Any]:
    """Restore each system's ``step`` under ``root`` (``root/<system>``) into this job's state, in
    place (then ``set_state_dict``): once each (``<system>_cold_s``: the first calls of a process
    fill caches a system may then find filled), then ``repeats`` times each, in turn
    (``<system>_s``: the median). The digests are of the full state after each system's restore."""
    def restore(system: str) -> float:
        if system == "ckptlib":
            return _restore_ckptlib(wl, str(root / system), step)
        return _restore_dcp(wl, root / system / str(step))

    out: dict[str, Any] = {}
    for system in SYSTEMS:
        out[f"{system}_cold_s"] = restore(system)
        out[f"{system}_digest"] = full_digest(wl)
    times: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    for _ in range(repeats):
        for system in SYSTEMS:
            times[system].append(restore(system))
    if full_digest(wl) != out[f"{SYSTEMS[-1]}_digest"]:
        out[f"{SYSTEMS[-1]}_digest"] = "differs between its restores"
    out.update({f"{k}_s": median(v) for k, v in times.items()})
    return out


def main(cfg: dict[str, Any]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(cfg.get("threads", 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world)
    root = Path(cfg["root"])
    wl = build_workload(WorkloadConfig(cfg["workload"], size=cfg["size"]), shard=rank, num_shards=world)
    shard_model(wl)
    dcp_group = dist.new_group(backend="gloo")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    result: dict[str, Any] = {"rank": rank, "world": world}
    options = {"keyframe_every": cfg["keyframe_every"]} if cfg.get("keyframe_every") else {}
    with Checkpointer(str(root / "ckptlib"), process_group=dist.group.WORLD, **options) as ck:
        result["saves"] = save_series(cfg, wl, ck, dcp_group, root)
    last = cfg["saves"]
    result["saved_digest"] = full_digest(wl)
    result["restore_same"] = restore_all(wl, root, last)
    other = cfg.get("restore_from")
    if other:
        result["restore_other"] = restore_all(wl, Path(other), last)
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
