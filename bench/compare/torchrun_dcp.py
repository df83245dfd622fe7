"""The user's default: torchrun (``--max-restarts``, gloo, 2 ranks) with DCP checkpoints every N steps.

A failure of any rank (a crash: it exits; a hang: its peer's gloo collective times out after
``timeout_s`` and that rank exits) makes torchrun's agent stop every worker and start them all
again; each loads the latest complete DCP folder (``dcp.save`` writes ``.metadata`` last) and
recomputes the steps since. Where it loses time: the detection (the collective's timeout for a
hang), the restart of every process (interpreter, torch, the process group), the load, and the
recomputed steps.

    python -m bench.compare.torchrun_dcp --worker --dir D --steps S --every N ...   (one rank)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from .schedule import Strike, dumps, loads, strike_if_due
from .workload import event_log, read_events

RANKS = 2


def run(run_dir: str, *, steps: int, every: int, size: str, strikes: list[Strike], timeout_s: float,
        budget_s: float) -> list[dict[str, Any]]:
    """One torchrun job of ``steps`` steps under ``strikes``; its event log (``workload.event_log``).

    A launch that never began to train within ``START_BUDGET_S`` (CI once saw a torchrun job hang
    before its first step, its log lost with the machine) is killed with all its processes and tried
    once more, its log kept beside; a job that hangs after it began fails with its log's tail."""
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
           f"--max-restarts={len(strikes)}", "--monitor-interval=0.1", "-m", "bench.compare.torchrun_dcp",
           "--worker", "--dir", run_dir, "--steps", str(steps), "--every", str(every), "--size", size,
           "--timeout", str(timeout_s), "--strikes", dumps(strikes)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    log_path = os.path.join(run_dir, "torchrun.log")
    for launch in (1, 2):
        with open(log_path, "w") as out:
            p = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # its ranks share its session: one kill ends all
            code = _wait(p, run_dir, budget_s)
        if code is not None:
            break
        if read_events(run_dir) or launch == 2:
            raise RuntimeError(f"torchrun job did not finish in {budget_s:g} s: {log_path} ends:\n{_tail(log_path)}")
        os.replace(log_path, os.path.join(run_dir, "torchrun-hung.log"))
    if code != 0:
        raise RuntimeError(f"torchrun exited {code}: {log_path} ends:\n{_tail(log_path)}")
    return read_events(run_dir)


START_BUDGET_S = 180.0  # interpreter, torch and the process group, twice over on a loaded 2-core machine


def _wait(p: subprocess.Popen, run_dir: str, budget_s: float) -> int | None:
    """``p``'s exit code, or None once it ran past ``budget_s`` (or ``START_BUDGET_S`` without a
    first event): then its whole session is killed."""
    began = time.monotonic()
    while True:
        try:
            return p.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            waited = time.monotonic() - began
            if waited > budget_s or (waited > START_BUDGET_S and not read_events(run_dir)):
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                return None


def _tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def _latest(ckpt_dir: str) -> int:
    """The step of the newest complete DCP folder (``.metadata`` present), 0 if none."""
    done = [int(n.split("-")[1]) for n in os.listdir(ckpt_dir)
            if n.startswith("step-") and os.path.exists(os.path.join(ckpt_dir, n, ".metadata"))] \
        if os.path.isdir(ckpt_dir) else []
    return max(done, default=0)


def _worker(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel

    from .workload import digest, shard_workload

    rank = int(os.environ["RANK"])
    log = event_log(a.dir, rank)
    # The agent's store outlives a restart, and gloo finds the dead attempt's addresses under the same
    # keys (connectFullMesh then times out): each attempt gets keys of its own.
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    store = dist.PrefixStore(f"attempt-{attempt}", dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS, timeout=timedelta(seconds=a.timeout))
    wl = shard_workload(a.size, rank, RANKS)
    ckpt_dir = os.path.join(a.dir, "dcp")

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(wl.model, wl.optimizer)
        return {"model": msd, "optim": osd, "sched": wl.scheduler.state_dict(), "position": wl.data_position}

    start = _latest(ckpt_dir)
    if start:
        s = state()
        dcp.load(s, checkpoint_id=os.path.join(ckpt_dir, f"step-{start:08d}"))
        set_state_dict(wl.model, wl.optimizer, model_state_dict=s["model"], optim_state_dict=s["optim"])
        wl.scheduler.load_state_dict(s["sched"])
        wl.data_position = int(s["position"])
    wl._replica = DistributedDataParallel(wl.model)  # the workload's forward goes through DDP (world of 2)
    log("begin", step=start, attempt=attempt)
    loss = float("nan")
    for step in range(start + 1, a.steps + 1):
        try:
            loss = wl.train_step()
        except Exception as e:  # the peer's collective failed or timed out: this is the detection
            log("error", step=step, error=f"{type(e).__name__}: {str(e)[:200]}")
            raise
        log("step", step=step, loss=loss)
        if step % a.every == 0 and step < a.steps:
            dcp.save(state(), checkpoint_id=os.path.join(ckpt_dir, f"step-{step:08d}"))
        strike_if_due(loads(a.strikes), rank, step, a.dir, log)
    if rank == 0:
        log("final", step=a.steps, loss=loss, digest=digest(wl.model))
    # Ended here, its work logged, without tearing down DDP and gloo: CI saw that teardown deadlock
    # (torch 2.13: the DDP reducer's destructor, holding the GIL, joins a gloo thread that waits for
    # the GIL to drop a Python object), leaving the job hung after its last step.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--size", default="small")
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--strikes", default="[]")
    _worker(ap.parse_args())


if __name__ == "__main__":
    main()
