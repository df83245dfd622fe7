"""What every peer's rank shares: the tinylm shard it trains, a digest of its parameters, its event log."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from workloads import WorkloadConfig, build_workload
from workloads.common import TorchWorkload

WORKLOAD = "tinylm"


def shard_workload(size: str, rank: int, ranks: int) -> TorchWorkload:
    """The workload ``ckpt soak`` trains (seed 0), with the batches of shard ``rank``: rank r of a peer
    sees the batches the pipeline's shard r sees, position by position."""
    torch.set_num_threads(1)
    wl = build_workload(WorkloadConfig(WORKLOAD, seed=0, size=size), rank, ranks)
    assert isinstance(wl, TorchWorkload)
    return wl


def digest(model: torch.nn.Module) -> str:
    """sha256 of the parameters' bytes in name order (the same state gives the same digest)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def event_log(run_dir: str, rank: int) -> Callable[..., None]:
    """``log(kind, **fields)``: one JSON line appended to ``run_dir/events.jsonl`` (one ``write`` of
    O_APPEND, so the lines of concurrent processes do not interleave), stamped with wall time."""
    path = os.path.join(run_dir, "events.jsonl")

    def log(kind: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "kind": kind, "rank": rank, "pid": os.getpid(), **fields}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    return log


def read_events(run_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda e: e["t"])
