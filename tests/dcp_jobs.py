"""The ranks of tests/test_dcp_backend.py's multi-rank jobs: FSDP2 (fully_shard, gloo on CPU) saved
and loaded with ``torch.distributed.checkpoint`` through ``ckptlib.dcp``.

Run as ``python tests/dcp_jobs.py <job> <rank> <world> <port> <url> <out dir>``, once per rank; each
rank writes what the test checks to ``<out dir>/<job>.r<rank>.json``. Expected full states go
through a plain ckptlib store (``<out dir>/ref``), not pickles.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed_jobs import fsdp, full, state, step
from distributed_jobs import main as run_job
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.device_mesh import DeviceMesh

from ckptlib import Checkpointer
from ckptlib.dcp import StorageReader, StorageWriter
from ckptlib.testing.compare import first_difference


def fsdp_save(rank: int, url: str, out: Path) -> dict[str, Any]:
    """Save after a training step (step 1), after a sparse edit of every parameter (step 2: a few
    elements each, so a writer holding step 1's bytes writes small deltas) and after another
    training step (step 3), all through one long-lived writer per rank; rank 0 keeps step 3's full
    state in the reference store."""
    m, opt = fsdp()
    writer = StorageWriter(url, chunk_bytes=4096)
    written = []
    for s in (1, 2, 3):
        if s == 2:
            with torch.no_grad():
                for p in m.parameters():
                    p.to_local().view(-1)[:3] += 1.0
        else:
            step(m, opt, s, rank)
        dcp.save(state(m, opt), storage_writer=writer, checkpoint_id=s)
        if rank == 0:
            assert writer.last_commit is not None
            written.append(writer.last_commit.bytes_written)
    want = full(m, opt)  # collective
    if rank == 0:
        Checkpointer(str(out / "ref")).save(3, want)
    return {"bytes_written": written}


def fsdp_load(rank: int, url: str, out: Path) -> dict[str, Any]:
    """Load each of steps 3 (saved by 2 ranks) and 4 (by 1 process) into a fresh FSDP2 model and
    optimizer; whether the full state matches the reference, bit for bit."""
    want = Checkpointer(str(out / "ref")).restore(3)
    diffs = {}
    for s in (3, 4):
        torch.manual_seed(100 + s)
        m, opt = fsdp()
        step(m, opt, 99, rank)  # other weights and initialised moments, all to be overwritten
        into = state(m, opt)
        dcp.load(into, storage_reader=StorageReader(url, step=s))
        set_state_dict(m, opt, model_state_dict=into["model"], optim_state_dict=into["optim"])
        diffs[str(s)] = first_difference(want, full(m, opt))
    return {"diffs": diffs}


def fsdp_four(rank: int, url: str, out: Path) -> dict[str, Any]:
    """On 4 ranks: save step 1 after a training step, then load it into a fresh FSDP2 model and
    optimizer on all 4 ranks and on ranks 0 and 1 alone (a 2-rank process group, the model sharded
    over it); whether each full state matches the saved one, bit for bit."""
    m, opt = fsdp()
    step(m, opt, 1, rank)
    dcp.save(state(m, opt), storage_writer=StorageWriter(url, chunk_bytes=4096), checkpoint_id=1)
    want = full(m, opt)  # collective
    diffs = {"4": _loaded(url, want, None)}
    pair = dist.new_group([0, 1])  # collective: every rank creates it
    if rank < 2:
        diffs["2"] = _loaded(url, want, pair)
    return {"diffs": diffs}


def _loaded(url: str, want: dict[str, Any], group: Any) -> str | None:
    """Step 1 loaded into a fresh model sharded over ``group`` (None: the world): the first
    difference of its full state from ``want``."""
    mesh = None if group is None else DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(7)
    m, opt = fsdp(mesh)
    g = torch.Generator().manual_seed(99)
    m(torch.randn(4, 16, generator=g)).square().mean().backward()  # other weights and moments, to be overwritten
    opt.step()
    opt.zero_grad()
    into = state(m, opt)
    dcp.load(into, storage_reader=StorageReader(url, step=1), process_group=group)
    set_state_dict(m, opt, model_state_dict=into["model"], optim_state_dict=into["optim"])
    return first_difference(want, full(m, opt))


JOBS = {f.__name__: f for f in (fsdp_save, fsdp_load, fsdp_four)}


def main(job: str, rank: int, world: int, port: int, url: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    run_job(job, rank, world, port, url, out, jobs=JOBS)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
