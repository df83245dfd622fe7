"""The ranks of the torch.distributed jobs of tests/test_distributed_jobs.py: real gloo groups on CPU.

Run as ``python tests/distributed_jobs.py <job> <rank> <world> <port> <url> <out dir>``, once per
rank (the test starts them, so that it can kill one); each rank writes what the test checks to
``<out dir>/<job>.r<rank>.json`` and, on rank 0, full tensors to ``<out dir>/<job>.*.pt``
(``torch.save`` of test data, not a checkpoint). ``CKPT_STORAGE_OPTIONS`` (JSON) reaches the store.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

from ckptlib import Checkpointer, CheckpointError
from ckptlib.store import Store
from ckptlib.testing.faulty import FaultyStore

CHUNK = 4096  # small chunks: a shard spans several, so restores on another layout read ranges of them


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 5))


def fsdp(mesh: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    m = model()
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=0.01)


def step(m: torch.nn.Module, opt: torch.optim.Optimizer, i: int, rank: int) -> float:
    """One optimizer step on rank ``rank``'s batch of step ``i``; the loss averaged over the ranks."""
    g = torch.Generator().manual_seed(1000 * i + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def full(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The full (unsharded) model and optimizer state, on every rank (collective)."""
    msd, osd = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
    # copies: the state dicts alias the optimizer's live step counters
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, {"model": msd, "optim": osd})


def state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd}


def checkpointer(url: str, store: Store | None = None) -> Checkpointer:
    options = json.loads(os.environ.get("CKPT_STORAGE_OPTIONS", "null"))
    return Checkpointer(store or Store.from_url(url, options), chunk_bytes=CHUNK, process_group=dist.group.WORLD,
                        group_timeout_s=120)


def info(i: Any) -> dict[str, Any]:
    return {"step": i.step, "digest": i.digest, "bytes_written": i.bytes_written, "logical_bytes": i.logical_bytes,
            "committed": i.committed, "blocked_s": i.blocked_s, "durable_s": i.durable_s}


# --- FSDP2: bit-exact resume, and a restore on another world size ----------------------------------

def fsdp_train(rank: int, url: str, out: Path) -> dict:
    """10 steps; save step 5 (blocking) and step 10 (in the background, the next step runs beside it)."""
    m, opt = fsdp()
    losses, infos = [], []
    with checkpointer(url) as ck:
        for i in range(1, 11):
            losses.append(step(m, opt, i, rank))
            if i == 5:
                infos.append(info(ck.save(5, {**state(m, opt), "step": 5})))
            if i == 10:
                f = full(m, opt)
                fut = ck.save_async(10, {**state(m, opt), "step": 10})
                extra = step(m, opt, 11, rank)  # trains on (and all-reduces) while step 10 persists
                infos.append(info(fut.result()))
    if rank == 0:
        torch.save(f, out / "fsdp_train.step10.pt")
    return {"losses": losses, "infos": infos, "extra": extra}


def fsdp_resume(rank: int, url: str, out: Path) -> dict:
    """A fresh job of 2 ranks restores step 5 in place and trains steps 6-10."""
    m, opt = fsdp()
    with checkpointer(url) as ck:
        restored = ck.restore(5, into={**state(m, opt), "step": 0})
    set_state_dict(m, opt, model_state_dict=restored["model"], optim_state_dict=restored["optim"])
    losses = [step(m, opt, i, rank) for i in range(6, 11)]
    f = full(m, opt)
    if rank == 0:
        torch.save(f, out / "fsdp_resume.step10.pt")
    return {"losses": losses, "step": restored["step"]}


def fsdp_reshard(rank: int, url: str, out: Path) -> dict:
    """A job of another world size restores step 10 into its own shards."""
    m, opt = fsdp()
    before = {k: v.to_local().clone() for k, v in state(m, opt)["model"].items()}
    with checkpointer(url) as ck:
        restored = ck.restore(10, into={**state(m, opt), "step": 0})
    set_state_dict(m, opt, model_state_dict=restored["model"], optim_state_dict=restored["optim"])
    local = {k: list(v.to_local().shape) for k, v in state(m, opt)["model"].items()}
    f = full(m, opt)
    if rank == 0:
        torch.save(f, out / "fsdp_reshard.step10.pt")
    changed = [k for k, v in state(m, opt)["model"].items() if not torch.equal(v.to_local(), before[k])]
    return {"local_shapes": local, "changed": changed, "step": restored["step"]}


# --- DDP: one replica written, per-rank values kept, restored into FSDP2 ----------------------------

def ddp(rank: int, url: str, out: Path) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    m = DistributedDataParallel(model())
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    for i in range(1, 4):
        step(m, opt, i, rank)
    msd, osd = get_state_dict(m, opt)
    mine = {"seen": torch.full((3,), float(rank)), "name": f"rank-{rank}", "shared": 7}
    with checkpointer(url) as ck:
        saved = info(ck.save(3, {"model": msd, "optim": osd, **mine}))
        fresh = DistributedDataParallel(model())
        fopt = torch.optim.Adam(fresh.parameters(), lr=0.01)
        fmsd, fosd = get_state_dict(fresh, fopt)
        back = ck.restore(3, into={"model": fmsd, "optim": fosd, "seen": torch.zeros(3), "name": "", "shared": 0})
    set_state_dict(fresh, fopt, model_state_dict=back["model"], optim_state_dict=back["optim"])
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, out / "ddp.step3.pt")
        with Checkpointer(str(out / "one-replica"), chunk_bytes=CHUNK) as one:  # what one replica costs
            saved["one_replica_bytes"] = one.save(3, {"model": msd, "optim": osd}).bytes_written
    same = all(torch.equal(a, b) for a, b in zip(m.module.state_dict().values(), fresh.module.state_dict().values()))
    return {"info": saved, "seen": back["seen"].tolist(), "name": back["name"], "shared": back["shared"],
            "same_after_restore": same}


def fsdp_from_ddp(rank: int, url: str, out: Path) -> dict:
    m, opt = fsdp()
    with checkpointer(url) as ck:
        back = ck.restore(3, into={**state(m, opt), "seen": torch.zeros(3), "name": "", "shared": 0})
    set_state_dict(m, opt, model_state_dict=back["model"], optim_state_dict=back["optim"])
    f = full(m, opt)
    if rank == 0:
        torch.save(f, out / "fsdp_from_ddp.pt")
    return {"seen": back["seen"].tolist(), "name": back["name"]}


# --- a rank killed mid-save: nothing committed, the next group saves -------------------------------

def kill(rank: int, url: str, out: Path) -> dict:
    """Step 1 commits; in the save of step 2, rank 1 is killed (SIGKILL) as it uploads its first chunk.
    The leases' time to live is ``LEASE_TTL_S`` of the environment (the test's wait for the killed
    rank's lease to expire, 30 s by default)."""
    from ckptlib import leases

    leases.DEFAULT_LEASE_TTL_S = float(os.environ.get("LEASE_TTL_S", leases.DEFAULT_LEASE_TTL_S))  # read at call time
    m, opt = fsdp()
    store = FaultyStore(Store.from_url(url, json.loads(os.environ.get("CKPT_STORAGE_OPTIONS", "null"))))
    with checkpointer(url, store) as ck:
        step(m, opt, 1, rank)
        ck.save(1, state(m, opt))
        step(m, opt, 2, rank)
        if rank == 1:
            store.on_call("put_if_absent", "chunks/*", lambda: os.kill(os.getpid(), 9))
        try:
            ck.save(2, state(m, opt))
        except CheckpointError as e:
            return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def save_again(rank: int, url: str, out: Path) -> dict:
    """A new group (a restarted job) resumes from step 1 and saves step 2."""
    m, opt = fsdp()
    with checkpointer(url) as ck:
        back = ck.restore(1, into=state(m, opt))
        set_state_dict(m, opt, model_state_dict=back["model"], optim_state_dict=back["optim"])
        step(m, opt, 2, rank)
        saved = info(ck.save(2, state(m, opt)))
    f = full(m, opt)
    if rank == 0:
        torch.save(f, out / "save_again.step2.pt")
    return {"info": saved}


def checkpointer_per_round(rank: int, url: str, out: Path) -> dict:
    """A long-lived rank (a warm group's) makes a collective Checkpointer per round: the gloo group
    each one makes must end with it, so the process's open files stay as after the first round."""
    fds = []
    for r in range(1, 7):
        with checkpointer(url) as ck:
            ck.save(r, {"w": torch.full((256,), float(r)), "mine": torch.tensor([rank])})
            back = ck.restore(r)
        assert torch.equal(back["w"], torch.full((256,), float(r)))
        fds.append(len(os.listdir("/proc/self/fd")))
    return {"fds": fds}


# --- sub-step fragments of a group's part: written in the background, read back whole ----------------

def substeps(rank: int, url: str, out: Path) -> dict:
    """FSDP2: the part "p" of cut 1 starts from step 0's fragment; sub-steps 2, 4 and 6 are written
    in the background while training goes on, then the round's fragment; a fresh Checkpointer
    reads sub-step 4 back (whole tensors), and the same state, sharded again, is sub-step 5: a
    delta against the adopted sub-step 4 that finds every chunk unchanged; a fenced
    generation's sub-step is refused on every rank."""
    from ckptlib import FencedError, commit

    m, opt = fsdp()
    written, wanted = [], None
    with checkpointer(url) as ck:
        ck.write_fragment(0, "p", state(m, opt))
        for i in range(1, 7):
            step(m, opt, i, rank)
            if i % 2 == 0:
                if i == 4:
                    wanted = full(m, opt)
                fut = ck.write_fragment_async(1, "p", {**state(m, opt), "i": i, "mine": rank}, substep=i)
                step(m, opt, 100 + i, rank) if i == 6 else None  # trains (and all-reduces) beside the write
                frag = fut.result()
                written.append({"substep": frag.meta["substep"], "digest": frag.digest, "world": frag.world,
                                "bytes_written": frag.bytes_written, "logical_bytes": frag.logical_bytes})
        final = ck.write_fragment(1, "p", state(m, opt))
    with checkpointer(url) as fresh:
        back = fresh.read_fragment(1, "p", generation=0, substep=4)  # whole tensors
        m2, opt2 = fsdp()
        into = fresh.read_fragment(1, "p", generation=0, substep=4, adopt=True, into={**state(m2, opt2), "i": 0,
                                                                                       "mine": -1})
        again = fresh.write_fragment_async(1, "p", into, substep=5).result()
        if rank == 0:
            fresh.fence("p", 1, reason="a test")
        dist.barrier()
        try:
            fresh.write_fragment_async(1, "p", back, substep=7).result()
            fenced = None
        except FencedError as e:
            fenced = str(e)
        keys = sorted(commit.substep_keys(fresh.store, 1, "p", 0).values())
    same = same_bits(wanted["model"], back["model"]) and same_bits(wanted["optim"]["state"], back["optim"]["state"])
    return {"written": written, "final_digest": final.digest, "same_at_4": same, "i": back["i"], "mine": back["mine"],
            "again_bytes": again.bytes_written, "again_logical": again.logical_bytes, "fenced": fenced, "keys": keys}


def local_copies(rank: int, url: str, out: Path) -> dict:
    """FSDP2: a sub-step written with ``on_written`` hands every rank the group's fragment and the
    units it stored; with every rank's units (what a host's local tier holds for a group), a fresh
    process group reads the sub-step back whole without reading a single chunk."""
    import numpy as np

    from ckptlib.store import WrapperStore

    m, opt = fsdp()
    got: dict[str, Any] = {}

    def keep(group: Any, units: Any) -> None:
        got.update(kind=type(group).__name__, digest=group.digest, units={c: b.copy() for c, b in units.items()})

    with checkpointer(url) as ck:
        ck.write_fragment(0, "p", state(m, opt))
        step(m, opt, 1, rank)
        wanted = full(m, opt)
        frag = ck.write_fragment_async(1, "p", state(m, opt), substep=1, on_written=keep).result()
    np.savez(out / f"units.r{rank}.npz", **got["units"])
    dist.barrier()
    known: dict[str, Any] = {}
    for r in range(dist.get_world_size()):
        with np.load(out / f"units.r{r}.npz") as f:
            known.update({c: f[c] for c in f.files})
    chunk_reads: list[str] = []

    class CountChunks(WrapperStore):
        def _forward(self, op: str, key: str, *args: Any) -> Any:
            if key.startswith("chunks/"):
                chunk_reads.append(key)
            return super()._forward(op, key, *args)

    with checkpointer(url, CountChunks(Store.from_url(url))) as fresh:
        back = fresh.read_fragment(1, "p", generation=0, substep=1, known=known)
        from_local = len(chunk_reads)
        again = fresh.read_fragment(1, "p", generation=0, substep=1)
    same = same_bits(wanted["model"], back["model"]) and same_bits(wanted["optim"]["state"], back["optim"]["state"])
    return {"kind": got["kind"], "same_digest": got["digest"] == frag.digest, "units": len(got["units"]),
            "known": len(known), "chunk_reads_with_known": from_local, "chunk_reads_without": len(chunk_reads) - from_local,
            "same": same, "same_again": same_bits(back["model"], again["model"])}


def same_bits(a: Any, b: Any) -> bool:
    """Whether two nested dicts of tensors hold the same keys and bits."""
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a) == sorted(b) and all(same_bits(a[k], b[k]) for k in a)
    return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


# --- a 2-D mesh: DCP's resharding matrix, HSDP written once per replica group ----------------------

ONE_D = [[Shard(0)], [Replicate()]]
TWO_D = [[Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(0), Replicate()], [Shard(0), Shard(0)],
         [Shard(1), Shard(0)]]


def mesh2d(rank: int, url: str, out: Path) -> dict:
    """Port of DCP's test_dtensor_resharding (placement changes, 1-D <-> 2-D meshes, uneven shards), with
    keys in another order on each rank, a partial restore, and an HSDP model restored into FSDP2."""
    mesh1, mesh2 = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    tensors = {"even": torch.arange(16, dtype=torch.float32).view(4, 4),
               "uneven": torch.arange(5 * 7, dtype=torch.float64).view(5, 7) / 3}
    layouts = [(mesh1, p) for p in ONE_D] + [(mesh2, p) for p in TWO_D]
    failures, written = [], {}
    with checkpointer(url) as ck:
        for s, (mesh, placements) in enumerate(layouts):
            dts = {k: distribute_tensor(t, mesh, placements) for k, t in tensors.items()}
            keys = list(dts) if rank % 2 == 0 else list(reversed(dts))  # ranks list keys in different orders
            written[s] = ck.save(s, {"model": {k: dts[k] for k in keys}, "other": {"x": rank}}).bytes_written
        for s in range(len(layouts)):
            for mesh, placements in layouts:
                dest = {k: distribute_tensor(torch.zeros_like(t), mesh, placements) for k, t in tensors.items()}
                back = ck.restore(s, into={"model": dest}, select=["model"])
                for k, t in tensors.items():
                    got = back["model"][k]
                    if not isinstance(got, DTensor) or got is not dest[k] or not torch.equal(got.full_tensor(), t):
                        failures.append(f"saved as layout {s}, restored as {placements}: {k}")
        hsdp = _hsdp_into_fsdp(ck, rank)
    return {"failures": failures, "written": written, **hsdp}


def _hsdp_into_fsdp(ck: Checkpointer, rank: int) -> dict:
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    m, opt = fsdp(hsdp)  # HSDP: replicated over mesh dim 0, sharded over dim 1
    for i in range(1, 3):
        step(m, opt, i, rank)
    hsdp_bytes = ck.save(100, state(m, opt)).logical_bytes
    want = full(m, opt)
    m1, opt1 = fsdp()
    back = ck.restore(100, into=state(m1, opt1))
    set_state_dict(m1, opt1, model_state_dict=back["model"], optim_state_dict=back["optim"])
    got = full(m1, opt1)
    same = all(torch.equal(got[s][k], v) for s in ("model",) for k, v in want[s].items())
    same_moments = all(torch.equal(got["optim"]["state"][k][n], v[n]) for k, v in want["optim"]["state"].items()
                       for n in v)
    fsdp_bytes = ck.save(101, state(m1, opt1)).logical_bytes
    return {"hsdp_model_equal": same, "hsdp_optim_equal": same_moments, "hsdp_bytes": hsdp_bytes,
            "fsdp_bytes": fsdp_bytes}


JOBS = {f.__name__: f for f in (fsdp_train, fsdp_resume, fsdp_reshard, ddp, fsdp_from_ddp, kill, save_again, mesh2d,
                                         substeps, local_copies, checkpointer_per_round)}


def main(job: str, rank: int, world: int, port: int, url: str, out: str, jobs: dict | None = None) -> None:
    """Run ``job`` (of ``jobs``, default this module's) as rank ``rank`` of a gloo group; its result to ``out``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = (jobs or JOBS)[job](rank, url, Path(out))
        (Path(out) / f"{job}.r{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
    # The rank's work is done and written: leave without the interpreter's teardown, where torch
    # 2.13's gloo can abort a finished rank ("terminate called without an active exception", a
    # joinable std::thread destroyed; seen once in CI under load, in this file's FSDP reshard job).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
