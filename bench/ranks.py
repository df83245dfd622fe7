"""Ranks-per-shard benchmark (``ckpt bench --ranks-per-shard``): a shard's round trained by R rank
processes (``trainrun.rank_group``, DDP or FSDP2 over gloo on CPU) against one process
(``trainrun.shard_round``), on the same work (the same batches: each of R ranks takes 1/R of each).

For each layout (R and parallelism: by default 1, 2 ddp, 2 fsdp), from the same step 0 on a local store, round 1 of shard 0 is trained ``repeats`` times
(each in a fresh store; alternating R, so a machine's load drifts over both alike) and reported as
medians: the round's wall time as the shard task sees it (``round_s``), its training alone
(``train_s``: the steps, the all-reduces included), the rank's setup (``setup_s``: its checkpointer's gloo group, its first beat), reading the cut
(``load_s``), building the workload (``build_s``: in a fresh process, DDP's first broadcast), writing
the fragment (``write_s``: for a group, the collective write), and for a group the overhead of its start: the
group's wall time minus what rank 0 measured from its first beat to its fragment (``start_s``:
processes started, torch and the workload imported, the rendezvous, the ranks ended); then the
same round again by the group kept warm (``warm_round_s``, ``warm_build_s``, ``warm_start_s``: what
a round after the first costs, the shard task's way; it must end on the same loss). ``model``: a
digest of the shard's model after the round, read whole (the same digest = the same trajectory,
bit for bit; every repeat of a layout must give the same one, else the row says ``varies``).
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

from .common import machine, table, workdir

Progress = Callable[[str], None]


Layout = tuple[int, str]  # (ranks per shard, parallelism)
LAYOUTS: tuple[Layout, ...] = ((1, "ddp"), (2, "ddp"), (2, "fsdp"))


def _spec(workload: str, size: str, steps: int, ranks: int, parallelism: str = "ddp") -> Any:
    from trainrun.spec import RunSpec

    return RunSpec(workload=workload, workload_size=size, shards=2, steps_per_round=steps, ranks_per_shard=ranks,
                   parallelism=parallelism)


def model_digest(state: dict[str, Any]) -> str:
    """A short digest of a model's full tensors (names, dtypes, shapes, bytes), in name order."""
    import torch

    h = hashlib.blake2b(digest_size=6)
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def one_round(workload: str, size: str, steps: int, layout: Layout, where: Any) -> dict[str, Any]:
    """Round 1 of shard 0 from a fresh step 0 in ``where``: its seconds."""
    from ckptlib import Checkpointer
    from trainrun.documents import Cut
    from trainrun.rank_group import end_groups, train_shard_group
    from trainrun.shard_round import train_shard_round
    from trainrun.step_zero import write_step_zero

    ranks, parallelism = layout
    spec = _spec(workload, size, steps, ranks, parallelism)
    with Checkpointer(str(where)) as ck:
        write_step_zero(ck, spec)
        t0 = time.perf_counter()
        warm: Any = None
        if ranks == 1:
            r = train_shard_round(ck, spec, 0, 1, Cut.of_step(0), checkpoint_every=0)
            wall = time.perf_counter() - t0
        else:
            try:
                r = train_shard_group(ck, None, spec, 0, 1, Cut.of_step(0), checkpoint_every=0, warm=True)
                wall = time.perf_counter() - t0
                t1 = time.perf_counter()  # the same round again, by the same group kept warm
                # (no shard checkpoints: the second attempt would continue from the first's)
                warm = train_shard_group(ck, None, spec, 0, 1, Cut.of_step(0), attempt=2, checkpoint_every=0,
                                         warm=True)
                warm_wall = time.perf_counter() - t1
            finally:
                end_groups(ck.url)
        model = ck.read_fragment(1, "shard-0", generation=r.generation, select=["model"])["model"]
    out: dict[str, Any] = {"round_s": wall, "setup_s": r.seconds.get("setup", 0.0), "load_s": r.seconds.get("load", 0.0),
           "build_s": r.seconds.get("build", 0.0), "train_s": r.seconds.get("train", 0.0),
           "write_s": r.seconds.get("write", 0.0), "loss": r.loss or 0.0,
           "model": model_digest(model)}
    if warm is not None:
        if warm.loss != r.loss:
            raise AssertionError(f"a warm group's round ended on loss {warm.loss!r}, a fresh group's on {r.loss!r}")
        out.update(start_s=r.seconds["group"] - r.seconds["total"], warm_round_s=warm_wall,
                   warm_build_s=warm.seconds.get("build", 0.0), warm_start_s=warm.seconds["group"] - warm.seconds["total"])
    return out


def run(workloads: tuple[str, ...] = ("tinylm",), size: str = "small", steps: int = 100,
        layouts: tuple[Layout, ...] = LAYOUTS, repeats: int = 3, progress: Progress = lambda m: None) -> dict[str, Any]:
    root = workdir("ranks")
    rows = []
    try:
        for wl in workloads:
            seconds: dict[Layout, list[dict[str, Any]]] = {lay: [] for lay in layouts}
            for i in range(repeats):
                for lay in layouts:
                    where = root / f"{wl}-r{lay[0]}-{lay[1]}-{i}"
                    seconds[lay].append(one_round(wl, size, steps, lay, where))
                    shutil.rmtree(where, ignore_errors=True)
                    progress(f"{wl} R={lay[0]} {lay[1]} repeat {i + 1}: {seconds[lay][-1]['round_s']:.2f} s")
            for lay in layouts:
                runs = seconds[lay]
                med = {k: statistics.median(s[k] for s in runs) for k in runs[0] if k != "model"}
                model = runs[0]["model"] if len({s["model"] for s in runs}) == 1 else "varies"
                rows.append({"workload": wl, "size": size, "steps": steps, "ranks": lay[0],
                             "parallelism": lay[1] if lay[0] > 1 else "-", **med, "model": model,
                             "train_per_step_ms": 1000 * med["train_s"] / steps})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"machine": machine(), "repeats": repeats, "rows": rows}


def render(result: dict[str, Any]) -> str:
    cols = [("workload", "workload"), ("ranks", "R"), ("parallelism", "parallelism"), ("steps", "steps"), ("round_s", "round s"),
            ("setup_s", "setup s"), ("load_s", "load s"), ("build_s", "build s"),
            ("train_s", "train s"), ("train_per_step_ms", "ms/step"), ("write_s", "write s"),
            ("start_s", "group start s"), ("warm_round_s", "warm round s"), ("warm_build_s", "warm build s"),
            ("warm_start_s", "warm start s"), ("model", "model digest")]
    return f"median of {result['repeats']} on {result['machine']}\n" + table(result["rows"], cols)
