"""torchft: replica groups of one process each, DDP over gloo, its lighthouse, healing from a live peer.

Each replica trains its shard's batches at the global step (``manager.current_step()``); torchft's
DDP averages the gradients of the replicas in the step's quorum. A failure of one replica (a crash:
it exits; a hang: it freezes, its peer's allreduce times out after ``timeout_s``) fails that step
on the live replica (``should_commit`` is False: the step is discarded, not applied), which forms a
quorum of its own at the next step (the lighthouse drops a replica whose heartbeats stop for
``timeout_s``) and trains on alone. The harness restarts a replica that exits (as a scheduler's
restart policy would); the new one joins the next quorum and fetches the live replica's state at
the current step (torchft's HTTP transport). Where it loses time: the discarded step and the
timeout; where it loses work: the batches of the replica that is out (samples dropped, nothing
recomputed). Nothing restarts a frozen replica (it has not exited): it stays out until the end.

    python -m bench.compare.torchft_peer --replica R --dir D --steps S ...   (one replica)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .schedule import Strike, dumps, loads, strike_if_due
from .workload import event_log, read_events

RANKS = 2


def run(run_dir: str, *, steps: int, size: str, strikes: list[Strike], timeout_s: float,
        budget_s: float) -> list[dict[str, Any]]:
    """One torchft job of ``steps`` steps under ``strikes``: a lighthouse here, a supervisor that
    restarts a replica which exits non-zero; its event log (``workload.event_log``)."""
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft's logger starts: not a line per quorum on stderr
    from torchft._torchft import LighthouseServer

    os.makedirs(run_dir, exist_ok=True)
    ms = int(timeout_s * 1000)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=ms, heartbeat_timeout_ms=ms)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse.address()}
    with open(os.path.join(run_dir, "torchft.log"), "w") as out:

        def start(r: int) -> subprocess.Popen:
            cmd = [sys.executable, "-m", "bench.compare.torchft_peer", "--replica", str(r), "--dir", run_dir,
                   "--steps", str(steps), "--size", size, "--timeout", str(timeout_s), "--strikes", dumps(strikes)]
            return subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)

        try:
            _supervise(start, len(strikes) + 2, timeout_s, budget_s, run_dir)
        finally:
            lighthouse.shutdown()
    return read_events(run_dir)


def _supervise(start: Callable[[int], subprocess.Popen], max_restarts: int, timeout_s: float, budget_s: float,
               run_dir: str) -> None:
    """Start the replicas, start again one that exits non-zero, until one has trained the last step (a
    live one finishes its own within the timeout; a frozen one never does, and is killed). When no
    replica has logged anything for ``stuck_s`` (every one frozen: torchft restarts nothing that has
    not exited), kill them, as an operator would, and log it (``operator_kill``)."""
    procs = {r: start(r) for r in range(RANKS)}
    deadline, restarts, finished_at = time.monotonic() + budget_s, 0, None
    events, stuck_s = os.path.join(run_dir, "events.jsonl"), max(60.0, 10 * timeout_s)
    try:
        while True:
            if os.path.exists(events) and time.time() - os.path.getmtime(events) > stuck_s and finished_at is None:
                event_log(run_dir, -1)("operator_kill", stuck_s=stuck_s)
                for p in procs.values():
                    p.kill()
            for r, p in procs.items():
                rc = p.poll()
                if rc not in (None, 0):
                    restarts += 1
                    if restarts > max_restarts:
                        raise RuntimeError(f"torchft replica {r} exited {rc} again: see {run_dir}/torchft.log")
                    procs[r] = start(r)
                elif rc == 0 and finished_at is None:
                    finished_at = time.monotonic()
            if all(p.poll() is not None for p in procs.values()) or (
                    finished_at is not None and time.monotonic() - finished_at > timeout_s + 5):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchft job did not finish in {budget_s:g} s: see {run_dir}/torchft.log")
            time.sleep(0.05)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _replica(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    from .workload import digest, shard_workload

    log = event_log(a.dir, a.replica)
    wl = shard_workload(a.size, a.replica, RANKS)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def state() -> dict[str, Any]:
        return {"model": wl.model.state_dict(), "optim": wl.optimizer.state_dict(), "sched": wl.scheduler.state_dict()}

    def load(s: dict[str, Any]) -> None:
        wl.model.load_state_dict(s["model"])
        wl.optimizer.load_state_dict(s["optim"])
        wl.scheduler.load_state_dict(s["sched"])

    t = timedelta(seconds=a.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=t), load_state_dict=load, state_dict=state, min_replica_size=1,
                      use_async_quorum=False, timeout=t, quorum_timeout=timedelta(seconds=60), rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, replica_id=f"replica_{a.replica}")
    wl._replica = DistributedDataParallel(manager, wl.model)  # the workload's forward goes through torchft's DDP
    _first_start_together(a.dir, a.replica)
    log("begin", step=manager.current_step())
    loss, quorum = float("nan"), -1
    while manager.current_step() < a.steps:
        manager.start_quorum()  # blocking (no async quorum): a healing replica has the peer's state after it
        if manager._quorum_id != quorum:  # a new quorum: the lighthouse acted on a replica leaving or joining
            quorum = manager._quorum_id
            log("quorum", step=manager.current_step(), participants=manager.num_participants())
        wl.data_position = manager.current_step()  # the batch of the global step
        wl.model.train()
        wl.optimizer.zero_grad(set_to_none=True)
        loss_t = wl.compute_loss(wl.make_batch(wl.data_position))
        loss_t.backward()
        if not manager.should_commit():  # the allreduce failed (a peer died or hung): the step is discarded
            log("error", step=manager.current_step() + 1, error=str(manager.errored())[:200])
            continue
        wl.optimizer.step()
        wl.scheduler.step()
        loss = float(loss_t.detach())
        log("step", step=manager.current_step(), loss=loss, participants=manager.num_participants())
        strike_if_due(loads(a.strikes), a.replica, manager.current_step(), a.dir, log)
    log("final", step=manager.current_step(), loss=loss, digest=digest(wl.model))
    manager.shutdown(wait=False)
    os._exit(0)  # done: not the seconds the server threads take to wind down


def _first_start_together(run_dir: str, replica: int) -> None:
    """On a replica's first start, wait until every replica is up, so the clean run trains with all
    of them from step 1 (a restarted replica joins at once)."""
    mine = os.path.join(run_dir, f"ready-{replica}")
    if os.path.exists(mine):
        return
    open(mine, "w").close()
    while not all(os.path.exists(os.path.join(run_dir, f"ready-{r}")) for r in range(RANKS)):
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--size", default="small")
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--strikes", default="[]")
    _replica(ap.parse_args())


if __name__ == "__main__":
    main()
