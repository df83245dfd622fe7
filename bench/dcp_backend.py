"""ckptlib.dcp vs DCP's FileSystemWriter on one small FSDP2 job (docs/integrations.md, "Measured").

    python -m bench.dcp_backend [--saves 5] [--loads 7] [--width 512] [--layers 8] [--modes dense,quarter]
                                [--dir DIR]

Two gloo ranks on CPU train an MLP of ``layers`` Linear(width, width) layers, fully_shard per layer,
Adam. Mode ``dense``: every layer trains; mode ``quarter``: only a quarter of the layers do (the
rest, and their optimizer state, stay the same). Every 2 steps the same state is saved through
``ckptlib.dcp`` (one long-lived StorageWriter per rank, one local store) and through a fresh
``FileSystemWriter`` directory; the bytes each adds on disk are counted. Then the last step is
loaded with each into a fresh model, ``loads`` times, alternating (so all see the same machine
load): ckptlib through a fresh StorageReader per load and through one over a Checkpointer kept
across loads, timed from a barrier to a barrier; the median of each is reported. Prints one JSON
line per mode.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from ckptlib import Checkpointer
from ckptlib.dcp import StorageReader, StorageWriter


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _model(width: int, layers: int, mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for i, layer in enumerate(m):
        if mode == "quarter" and i >= layers // 4:
            layer.requires_grad_(False)
        fully_shard(layer)
    fully_shard(m)
    return m, torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)


def _state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd}


def _rank(rank: int, world: int, port: int, root: str, mode: str, saves: int, loads: int, width: int,
          layers: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    base = Path(root) / mode
    ours, fs = base / "ckptlib", base / "fs"
    m, opt = _model(width, layers, mode)
    writer = StorageWriter(str(ours))
    rows = []
    for k in range(1, saves + 1):
        for _ in range(2):
            g = torch.Generator().manual_seed(1000 * k + rank)
            m(torch.randn(16, width, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        state = _state(m, opt)
        before = _du(ours) if rank == 0 else 0
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer, checkpoint_id=k)
        t1 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(fs / str(k))))
        t2 = time.perf_counter()
        dist.barrier()
        if rank == 0:
            rows.append({"save": k, "ckptlib_bytes": _du(ours) - before, "fs_bytes": _du(fs / str(k)),
                         "ckptlib_s": round(t1 - t0, 4), "fs_s": round(t2 - t1, 4)})
    # "ckptlib": a fresh reader per load, as FileSystemReader is used; "ckptlib_reused": a reader over one
    # Checkpointer kept across loads (its IO threads started and the step's fragments parsed once)
    kept = Checkpointer(str(ours))
    readers = {"ckptlib": lambda: StorageReader(str(ours)), "ckptlib_reused": lambda: StorageReader(kept),
               "fs": lambda: dcp.FileSystemReader(str(fs / str(saves)))}
    times: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(loads):
        for name, reader in readers.items():
            m2, opt2 = _model(width, layers, mode)
            into = _state(m2, opt2)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.load(into, storage_reader=reader())
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    load_s = {name: round(statistics.median(t), 4) for name, t in times.items()}
    if rank == 0:
        periodic = rows[1:]  # the first save of each is a full one
        summary = {k: sum(r[k] for r in periodic) / len(periodic) for k in ("ckptlib_bytes", "fs_bytes", "ckptlib_s",
                                                                             "fs_s")}
        print(json.dumps({"mode": mode, "state_bytes": rows[0]["fs_bytes"], "first": rows[0], "per_save": summary,
                          "ratio": summary["ckptlib_bytes"] / summary["fs_bytes"], "load_s": load_s,
                          "load_ratio": round(load_s["ckptlib"] / load_s["fs"], 3),
                          "load_ratio_reused": round(load_s["ckptlib_reused"] / load_s["fs"], 3)}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--loads", type=int, default=7, help="timed loads of each (the median is reported)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--modes", default="dense,quarter", help="which of dense,quarter to run")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    a = ap.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="dcp-backend-")
    for mode in a.modes.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, root, mode, a.saves, a.loads, a.width, a.layers), nprocs=2)


if __name__ == "__main__":
    main()
