"""A Dask cluster started from the ``dask`` command line, as it would run on separate machines.

    with DaskCluster.start(workdir, workers=3, env={"PYTHONPATH": ..., "PREFECT_API_URL": ...}) as dc:
        train_run(TrainParams(task_runner=dc.runner, store="s3://...", ...))   # dask://127.0.0.1:PORT
        dc.kill_worker(1)                       # SIGKILL of one "machine": its nanny and its worker

Contract:

* ``start`` runs ``dask scheduler`` and ``workers`` times ``dask worker`` (each one process with a
  nanny, ``nthreads`` threads), each in its own session (process group) and its own working and
  local directory under ``workdir`` (``scheduler/``, ``worker-<i>/``): nothing is shared through
  the filesystem but the logs this class reads, so the store must be one every worker reaches by
  URL (S3). It returns once every worker has registered with the scheduler, or raises
  ``RuntimeError`` with the tail of the logs within ``timeout`` seconds.
* ``env`` is added to each process's environment: what a worker machine needs (``PYTHONPATH`` or an
  installed project, ``PREFECT_API_URL``, the store's credentials as ``AWS_*`` or
  ``CKPT_STORAGE_OPTIONS``). Nothing secret goes on a command line (``ps`` shows those).
* ``kill_worker(i)`` SIGKILLs worker ``i``'s whole process group, as a machine that dies (the
  nanny cannot restart it); ``stop()`` stops everything (SIGTERM, then SIGKILL) and is idempotent.
  A cluster still running is also stopped at interpreter exit.

On real machines the same two commands run by hand or by a service manager (docs/scale.md).
No pytest here: the tests and ``bench/`` both use this module.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
from pathlib import Path

from .local_services import _free_ports, _log_tail, find_command, stop_process_groups

__all__ = ["DaskCluster", "find_dask"]


def find_dask() -> str:
    """Path of the ``dask`` command."""
    return find_command("dask", "install distributed (`pip install 'ckptlib[pipeline]'` brings it with prefect-dask)")


class DaskCluster:
    """A running ``dask scheduler`` and its ``dask worker`` processes on ``host``."""

    def __init__(self, workdir: Path, host: str, port: int):
        self.workdir, self.host, self.port = workdir, host, port
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, object] = {}
        atexit.register(self.stop)

    @property
    def address(self) -> str:
        """The scheduler's address for ``distributed.Client``."""
        return f"tcp://{self.host}:{self.port}"

    @property
    def runner(self) -> str:
        """The ``--task-runner`` (``task_runner``) value that sends shards to this cluster."""
        return f"dask://{self.host}:{self.port}"

    @classmethod
    def start(cls, workdir: str | os.PathLike, workers: int = 2, *, host: str = "127.0.0.1", nthreads: int = 1,
              env: dict[str, str] | None = None, timeout: float = 90.0) -> DaskCluster:
        """Start the scheduler and ``workers`` workers; return once all have registered."""
        workdir = Path(workdir).absolute()
        (port,) = _free_ports(host, 1)
        cluster = cls(workdir, host, port)
        dask = find_dask()
        try:
            cluster._launch("scheduler", [dask, "scheduler", "--host", host, "--port", str(port), "--no-dashboard"], env)
            for i in range(workers):
                cluster.add_worker(i, nthreads=nthreads, env=env, wait=False)
            cluster.wait_for_workers(workers, timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def add_worker(self, i: int, *, nthreads: int = 1, env: dict[str, str] | None = None, wait: bool = True,
                   timeout: float = 90.0) -> None:
        """Start worker ``i`` (a new machine joining); with ``wait``, return once it has registered."""
        here = self.workdir / f"worker-{i}"
        self._launch(f"worker-{i}", [find_dask(), "worker", self.address, "--name", f"worker-{i}",
                                     "--nthreads", str(nthreads), "--nworkers", "1", "--no-dashboard",
                                     "--local-directory", str(here / "dask"), "--death-timeout", "60"], env)
        if wait:
            self.wait_for_workers(self.alive_workers(), timeout)

    def _launch(self, name: str, cmd: list[str], env: dict[str, str] | None) -> None:
        here = self.workdir / name.split(" ")[0]
        here.mkdir(parents=True, exist_ok=True)
        log = open(here / "dask.log", "ab")  # noqa: SIM115 - the child writes it until stop()
        self._logs[name] = log
        self.procs[name] = subprocess.Popen(cmd, cwd=here, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive_workers(self) -> int:
        return sum(1 for n, p in self.procs.items() if n.startswith("worker-") and p.poll() is None)

    def wait_for_workers(self, n: int, timeout: float = 90.0) -> None:
        """Return once ``n`` workers are registered with the scheduler; RuntimeError with the logs if not."""
        from distributed import Client

        deadline = time.monotonic() + timeout
        try:
            with Client(self.address, timeout=timeout) as client:
                client.wait_for_workers(n, timeout=max(1.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - the logs say why
            dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
            logs = "\n".join(f"--- {name}\n{_log_tail(self.workdir / name / 'dask.log', 15)}" for name in self.procs)
            raise RuntimeError(f"the Dask cluster at {self.address} did not get {n} workers within {timeout:.0f} s "
                               f"({type(e).__name__}: {e}); exited: {dead or 'none'}\n{logs}") from None

    def worker_pids(self, i: int) -> set[int]:
        """Process ids of worker ``i``'s process group (its nanny and its worker process)."""
        import psutil

        pgid = self.procs[f"worker-{i}"].pid
        pids = set()
        for pid in psutil.pids():
            try:
                if os.getpgid(pid) == pgid:
                    pids.add(pid)
            except OSError:
                continue
        return pids

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i``'s whole process group (a machine that dies) and reap it."""
        proc = self.procs[f"worker-{i}"]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)

    def stop(self, grace: float = 5.0) -> None:
        """Stop the workers, then the scheduler: SIGTERM, ``grace`` seconds, SIGKILL. Idempotent."""
        for name in sorted(self.procs, key=lambda n: n == "scheduler"):
            stop_process_groups([self.procs[name]], grace)
        for log in self._logs.values():
            log.close()  # type: ignore[attr-defined]
        atexit.unregister(self.stop)

    def __enter__(self) -> DaskCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"DaskCluster({self.address}, {self.alive_workers()} workers alive, dir={self.workdir})"
