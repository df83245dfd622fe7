"""Shards on a Prefect work pool: the ``train-shard/shard`` deployment and the workers that run it.

    python -m deployments.shard_pool --pool shard-pool            # register the deployment (PREFECT_API_URL)
    prefect worker start --pool shard-pool --type process --limit 1   # on each machine, as many as you like
    ckpt train --task-runner pool:train-shard/shard --store s3://bucket/runs ...

A Prefect worker runs flow runs, not task runs: in this mode the training flow starts every shard
of every round as a flow run of this deployment (``flows/shard.py``, ``flows/runners.py``), and
whichever worker of the pool is free picks it up. ``--limit 1`` makes a worker run one shard at a
time (one per GPU or per core set: start one worker per slot).

What every worker machine needs: this project installed and the same checkout path as where the
deployment was registered (``--source``, as ``deployments/deploy.py``), ``PREFECT_API_URL`` (and
``PREFECT_API_AUTH_STRING`` for a server that wants credentials, as the local stack's), and
the store's credentials in its environment (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_ENDPOINT_URL`` or ``CKPT_STORAGE_OPTIONS``), or a Prefect Secret block the run names
(``--credentials-block``): flow parameters never carry credentials.

``PrefectWorkers`` starts such workers on this machine for tests and benchmarks, each in its own
session and working directory, so that one can be killed like a machine (``kill(i)``: the worker and
the flow runs it started). A separate module from ``deploy.py`` (the stack's deployments): this one
belongs to the scale-out path (docs/scale.md).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .local_services import _log_tail, prefect_cli, stop_process_groups

REPO = Path(__file__).resolve().parent.parent
SHARD_ENTRYPOINT = "flows.shard.train_shard_flow"
SHARD_FLOW = "train-shard"
SHARD_DEPLOYMENT = "shard"
RUNNER = f"pool:{SHARD_FLOW}/{SHARD_DEPLOYMENT}"  # the --task-runner value


def ensure_pool(pool: str) -> None:
    """Create the process work pool ``pool`` unless it exists (PREFECT_API_URL)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))


def deploy_shard_flow(pool: str, *, source: str = str(REPO), name: str = SHARD_DEPLOYMENT) -> str:
    """Register ``train-shard/<name>`` on ``pool`` (created if missing); returns ``pool:train-shard/<name>``,
    the task runner that uses it."""
    from prefect import Flow

    ensure_pool(pool)
    flow = Flow.from_source(source=source, entrypoint=SHARD_ENTRYPOINT)
    with contextlib.redirect_stdout(io.StringIO()):
        flow.deploy(name=name, work_pool_name=pool, tags=["ckpt", "shard"], print_next_steps=False,
                    ignore_warnings=True, description="One shard's round of a training run: started by train-run "
                    "with --task-runner pool:train-shard/" + name + " (docs/scale.md).")
    return f"pool:{flow.name}/{name}"


class PrefectWorkers:
    """``prefect worker start`` processes of one process work pool on this machine (see the module docstring)."""

    def __init__(self, workdir: Path, pool: str):
        self.workdir, self.pool = workdir, pool
        self.procs: list[subprocess.Popen] = []
        self._logs: list[object] = []
        atexit.register(self.stop)

    @classmethod
    def start(cls, workdir: str | os.PathLike, pool: str, workers: int = 2, *, limit: int = 1,
              env: dict[str, str] | None = None, poll_s: float = 1.0, timeout: float = 90.0) -> PrefectWorkers:
        """Start ``workers`` workers (``--limit`` each); return once all are ONLINE in the pool."""
        self = cls(Path(workdir).absolute(), pool)
        try:
            for i in range(workers):
                here = self.workdir / f"worker-{i}"
                here.mkdir(parents=True, exist_ok=True)
                log = open(here / "worker.log", "ab")  # noqa: SIM115 - the child writes it until stop()
                self._logs.append(log)
                cmd = [*prefect_cli(), "worker", "start", "--pool", pool, "--type", "process", "--name",
                       f"{pool}-worker-{i}", "--limit", str(limit), "--install-policy", "never"]
                self.procs.append(subprocess.Popen(
                    cmd, cwd=here, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, **(env or {}), "PREFECT_WORKER_QUERY_SECONDS": str(poll_s),
                         "PREFECT_WORKER_PREFETCH_SECONDS": "1"}))
            self.wait_online(workers, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def online(self) -> set[str]:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return {w.name for w in client.read_workers_for_work_pool(self.pool) if str(w.status).endswith("ONLINE")}

    def wait_online(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.online() & {f"{self.pool}-worker-{i}" for i in range(len(self.procs))}) >= n:
                return
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                break
            time.sleep(0.5)
        logs = "\n".join(f"--- worker-{i}\n{_log_tail(self.workdir / f'worker-{i}' / 'worker.log', 15)}"
                         for i in range(len(self.procs)))
        raise RuntimeError(f"{n} workers of pool {self.pool!r} are not ONLINE after {timeout:.0f} s:\n{logs}")

    def pids(self, i: int) -> set[int]:
        """Process ids of worker ``i`` and of every process below it: the flow runs it started run in
        sessions of their own (Prefect starts them with ``start_new_session``), so they are found by
        parent, not by session."""
        import psutil

        if self.procs[i].poll() is not None:
            return set()
        try:
            worker = psutil.Process(self.procs[i].pid)
            return {worker.pid, *(p.pid for p in worker.children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def kill(self, i: int) -> None:
        """SIGKILL worker ``i`` and every flow run it started (a machine that dies): the worker's
        process group and the session of each process below it."""
        below = self.pids(i)
        for pid in below:
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait(30)

    def stop(self, grace: float = 5.0) -> None:
        stop_process_groups(self.procs, grace)
        for log in self._logs:
            log.close()  # type: ignore[attr-defined]
        atexit.unregister(self.stop)

    def __enter__(self) -> PrefectWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deployments.shard_pool", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", default=os.environ.get("CKPT_SHARD_POOL", "shard-pool"), help="process work pool")
    ap.add_argument("--name", default=SHARD_DEPLOYMENT, help="deployment name")
    ap.add_argument("--source", default=str(REPO), help="where workers get the code (this checkout, or a git URL)")
    a = ap.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        print("error: set PREFECT_API_URL to the Prefect server the workers and the training flow use", file=sys.stderr)
        return 2
    runner = deploy_shard_flow(a.pool, source=a.source, name=a.name)
    print(f"registered {runner[len('pool:'):]} on work pool {a.pool!r}; start workers with\n"
          f"  prefect worker start --pool {a.pool} --type process --limit 1\n"
          f"and train with --task-runner {runner}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
