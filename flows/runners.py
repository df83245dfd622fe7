"""Where shard tasks run, by one parameter: ``threads`` | ``dask`` | ``dask://HOST:PORT`` | ``pool:DEPLOYMENT``.

* ``threads``: the flow's own ThreadPoolTaskRunner (one process; shards are threads).
* ``dask``: a temporary local Dask cluster of processes (``prefect_dask.DaskTaskRunner``), one worker
  process per shard (at least 2), one thread each; it lives as long as the flow run. Its workers,
  replacements included, are forked from a server that imported torch, Prefect and the shard task
  once (``forked_workers``, decision 64). No spare worker: one was tried (a preempted worker's task
  then reran at once, 0.55 s back to training instead of 2-8 s when workers were spawned), but Dask
  hands tasks to idle workers in turn, so a round's shard could land on the spare cold and start
  seconds after the others (a CI run saw a shard finish its round before the other had begun it). In every
  worker (either Dask kind) a SIGTERM is a preemption: its shard checkpoints where it is, then the
  worker ends and Dask runs the task again elsewhere, from that checkpoint (``preemptible_workers``).
* ``dask://HOST:PORT``: an existing scheduler (``dask scheduler`` + ``dask worker`` on many
  machines, ``deployments/dask_cluster.py``). Every worker must import this project (and the
  workload's module) and reach the store, so use an s3:// store there. A worker that dies mid-task
  is Dask's business: the scheduler runs the task again on another worker.
* ``pool:FLOW/DEPLOYMENT`` (e.g. ``pool:train-shard/shard``): each shard of each round is a flow run
  of that deployment of ``flows/shard.py`` on a Prefect work pool (``DeploymentRunner``): Prefect
  workers run flow runs, not task runs. Any number of workers on any machines pick them up.
  A flow run that crashes (its process died: ``Crashed``) is started again, like Dask's rerun of a
  lost task, up to the shard task's retries; one whose whole machine died stays ``Running`` in
  Prefect and is the watchdog's (silent heartbeats: fenced and rerun).

Only shard tasks go elsewhere. The cut runs in the flow's process (a thread). Validations run in one
separate worker process (``validation_runner``): they are Python-heavy (pandas, Great Expectations)
and, as threads, would hold the GIL against the shards' training loops; in their own process they
only share the CPU. They never take a worker slot from the next round's shards.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainrun.results import ShardResult

log = logging.getLogger("flows.runners")

POOL_PREFIX = "pool:"


@contextmanager
def shard_runner(spec: str, shards: int, preempt_grace_s: float = 30.0) -> Iterator[Any]:
    """A started task runner for shard tasks, or None for the flow's own (threads). Dask's worker
    processes make a SIGTERM a preemption (``trainrun.preemption``, within ``preempt_grace_s``)."""
    if spec == "threads":
        yield None
        return
    if spec.startswith(POOL_PREFIX):
        runner = DeploymentRunner(spec[len(POOL_PREFIX):])
        try:
            yield runner
        finally:
            runner.close()
        return
    import dask
    from prefect_dask import DaskTaskRunner

    if spec == "dask":
        # worker processes forked from a server that imported torch, Prefect and the shard task once
        # (``forked_workers``); each gets this process's environment as it is now
        runner = DaskTaskRunner(cluster_kwargs={"n_workers": max(2, shards), "threads_per_worker": 1,
                                                "processes": True, "dashboard_address": None,
                                                "env": dict(os.environ)})
        # Dask reads the method each time a nanny starts a worker: a replacement too, from its own thread
        worker_start: Any = dask.config.set({"distributed.worker.multiprocessing-method": forked_workers()})
    elif spec.startswith("dask://"):
        runner = DaskTaskRunner(address="tcp://" + spec[len("dask://"):])
        worker_start = nullcontext()  # its workers are started by `dask worker` on their machines
    else:
        raise ValueError(f"unknown task runner {spec!r}: use threads, dask, dask://HOST:PORT or pool:FLOW/DEPLOYMENT")
    with worker_start, runner:
        runner.client.register_plugin(preemptible_workers(preempt_grace_s))
        yield runner


# what a shard task's worker imports before its first step (Dask's own preload first); torch._dynamo
# as the rank launcher's PRELOAD says
WORKER_PRELOAD = ("distributed", "torch", "torch._dynamo", "prefect", "tasks.shard", "trainrun.shard_round")


def forked_workers() -> str:
    """Make a local Dask cluster's worker processes start from multiprocessing's fork server, with
    ``WORKER_PRELOAD`` imported there once; return the method (``forkserver``). A spawned worker
    imported them itself: 4-5 CPU-seconds and 2-8 s of wall time for each worker, a replacement
    after a kill or a preemption included. The server is this process's child, started with its
    first worker; a worker is forked from it (one thread: the server runs no other), and Dask sends
    it its work as it did a spawned one."""
    import dask
    from distributed.utils import get_mp_context

    with dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}):
        ctx = get_mp_context()  # sets Dask's own preload once per process: ours replaces it
    ctx.set_forkserver_preload(list(WORKER_PRELOAD))
    return "forkserver"


def preemptible_workers(grace_s: float) -> Any:
    """A Dask worker plugin: every worker process (those the nanny starts later too) installs the
    preemption handler (``trainrun.preemption``) when it joins. Its ``setup`` runs on the worker's
    event loop, the process's main thread: the one thread where Python lets it take SIGTERM."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class Preemptible(WorkerPlugin):
        name = "ckpt-preemption"

        def setup(self, worker: Any) -> None:
            from trainrun import preemption

            if not preemption.install(grace_s):
                log.warning("dask worker %s: SIGTERM stays fatal (its plugins run off the main thread)", worker)

    return Preemptible()


def submit(runner: Any, task: Any, **parameters: Any) -> Any:
    """Submit ``task`` to ``runner`` (None: the flow's own task runner). Returns a PrefectFuture."""
    if runner is None:
        return task.submit(**parameters)
    return runner.submit(task, parameters)


# --- shards as flow runs on a work pool -------------------------------------------------------------

class DeploymentRunner:
    """Runs ``train-shard`` tasks as flow runs of ``deployment`` (``flows/shard.py``) on its work pool.

    ``submit(task, parameters)`` starts one flow run (``run_deployment(..., timeout=0)``) and
    returns a ``DeploymentFuture``. One thread looks at the states of every flow run in flight with
    one API call every ``poll_s`` seconds (not one call per shard), fires the futures' callbacks
    when their runs end, and starts a crashed run again (up to the task's ``retries``).

    What crosses to the workers: the task's parameters as flow parameters (JSON, small), with the
    store's credentials reduced to the Secret block's name: options held in memory (``ckpt train
    --storage-options``) are never sent, so workers use their own environment or the block. The
    shard's result is read from the store (its fragment), not from Prefect's result storage.
    """

    def __init__(self, deployment: str, *, poll_s: float = 1.0):
        if deployment.count("/") != 1 or not all(deployment.split("/")):
            raise ValueError(f"pool runner needs FLOW/DEPLOYMENT, e.g. pool:train-shard/shard, got {deployment!r}")
        self.deployment, self.poll_s = deployment, poll_s
        self._ctx = contextvars.copy_context()  # the Prefect API of the flow run that made us
        self._pending: dict[Any, DeploymentFuture] = {}  # flow run id -> future
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ctx.run, args=(self._watch,), name="ckpt-pool-runner", daemon=True)
        self._thread.start()

    def submit(self, task: Any, parameters: dict[str, Any]) -> DeploymentFuture:
        delay = task.retry_delay_seconds
        fut = DeploymentFuture(self, dict(parameters), retries=int(task.retries or 0),
                               retry_delay_s=float((delay[0] if isinstance(delay, list) else delay) or 0.0))
        self._start(fut)
        return fut

    def _start(self, fut: DeploymentFuture) -> None:
        from prefect.deployments import run_deployment

        # called from the flow's thread, or from the watcher thread (which runs in a copy of its context)
        flow_run = run_deployment(self.deployment, parameters=fut.flow_parameters(), timeout=0, as_subflow=False,
                                  tags=["ckpt", "shard"])
        with self._lock:
            fut.flow_run_id = flow_run.id
            self._pending[flow_run.id] = fut

    def _watch(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        while not self._stop.wait(self.poll_s):
            with self._lock:
                ids = list(self._pending)
            if not ids:
                continue
            try:
                with get_client(sync_client=True) as client:
                    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
            except Exception as e:  # noqa: BLE001 - the API is briefly away: look again
                log.warning("pool runner: cannot read the shard flow runs' states: %s", e)
                continue
            for run in runs:
                state = run.state
                if state is None or not state.is_final():
                    continue
                with self._lock:
                    fut = self._pending.pop(run.id, None)
                if fut is None:
                    continue
                if state.is_crashed() and fut.crashes < fut.retries:
                    fut.crashes += 1
                    log.warning("shard %s round %s: flow run %s crashed (%s); starting it again (%d/%d)",
                                fut.parameters.get("shard"), fut.parameters.get("round_no"), run.name,
                                state.message, fut.crashes, fut.retries)
                    try:
                        self._start(fut)
                        continue
                    except Exception as e:  # noqa: BLE001
                        fut._finish(state.type.value, f"could not start it again: {e}")
                        continue
                fut._finish(state.type.value, state.message)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class DeploymentFuture:
    """A shard task run as a flow run (the interface ``flows/train.py`` uses of a PrefectFuture:
    ``add_done_callback``, ``result``)."""

    def __init__(self, runner: DeploymentRunner, parameters: dict[str, Any], *, retries: int, retry_delay_s: float):
        self.runner, self.parameters = runner, parameters
        self.retries, self.retry_delay_s = retries, retry_delay_s
        self.crashes = 0
        self.flow_run_id: Any = None
        self._done = threading.Event()
        self._state: str | None = None
        self._message: str | None = None
        self._callbacks: list[Callable[[DeploymentFuture], None]] = []
        self._lock = threading.Lock()

    def flow_parameters(self) -> dict[str, Any]:
        """The shard flow's parameters: the task's, with no secret (only a block's name) and the
        attempt numbering carried on past crashed runs."""
        p = self.parameters
        access = p.get("access")
        return {"run_url": p["run_url"], "spec": p["spec"].to_dict(), "shard": p["shard"], "round_no": p["round_no"],
                "cut": p["cut"].to_dict(), "credentials_block": getattr(access, "block", None),
                "keyframe_every": p["keyframe_every"], "chaos": list(p.get("chaos") or []),
                "heartbeat_every_s": p["heartbeat_every_s"], "heartbeat_events": p["heartbeat_events"],
                "attempt_offset": int(p.get("attempt_offset") or 0) + self.crashes,
                "retries": self.retries, "retry_delay_s": self.retry_delay_s,
                "shard_checkpoint_every": p.get("shard_checkpoint_every", "auto"), "local_tier": p.get("local_tier", True)}

    def _finish(self, state: str, message: str | None) -> None:
        with self._lock:
            self._state, self._message = state, message
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, fn: Callable[[DeploymentFuture], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> ShardResult:
        """The shard's result, read from its fragment of the round (its live generation's); raises
        RuntimeError when the flow run did not complete."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"shard {self.parameters['shard']} round {self.parameters['round_no']}: its flow run "
                               f"{self.flow_run_id} has not ended after {timeout} s")
        if self._state != "COMPLETED":
            raise RuntimeError(f"shard {self.parameters['shard']} round {self.parameters['round_no']}: flow run "
                               f"{self.flow_run_id} of {self.runner.deployment} ended {self._state}: {self._message}")
        return shard_result(self.parameters)


def shard_result(parameters: dict[str, Any]) -> ShardResult:
    """What ``train_shard`` returned, rebuilt from the store: the live generation's fragment of the
    round (``status: fenced`` when there is none: the attempt was fenced before it wrote)."""
    from ckptlib import commit
    from ckptlib.errors import ObjectNotFound
    from ckptlib.store import Store
    from tasks.access import storage_options
    from trainrun.layout import shard_part
    from trainrun.results import ShardResult

    shard, round_no = int(parameters["shard"]), int(parameters["round_no"])
    part = shard_part(shard)
    store = Store.from_url(parameters["run_url"], storage_options(parameters.get("access")))
    gen = commit.live_generation(store, part)
    key = commit.fragment_key(round_no, part, gen)
    try:
        frag, _ = commit.read_fragment(store, key)  # with the fragment cap
    except ObjectNotFound:
        return ShardResult(shard=shard, round=round_no, part=part, status="fenced", generation=gen)
    m = frag.meta
    seconds = {k: float(m.get(f"{k}_s") or 0.0) for k in ("load", "build", "train")}
    return ShardResult(shard=shard, round=round_no, part=part, status="finished", generation=gen,
                       attempt=m.get("attempt"), loss=m.get("loss"), bytes_written=frag.bytes_written,
                       logical_bytes=frag.logical_bytes, chunks=dict(frag.stats), digest=frag.digest,
                       seconds={**seconds, "write": 0.0, "total": sum(seconds.values())},
                       resumed_at_step=m.get("resumed_at_step"), start_source=m.get("start_source"),
                       shard_checkpoints=int(m.get("shard_checkpoints") or 0),
                       shard_checkpoint_bytes=int(m.get("shard_checkpoint_bytes") or 0))


@contextmanager
def validation_runner(kind: str) -> Iterator[Any]:
    """``process``: one worker process for validations (sequential, beside training), which ends
    itself when the flow's process is gone (``exit_with_parent``); ``threads``: the flow's own thread
    pool (None)."""
    if kind == "threads":
        yield None
        return
    if kind != "process":
        raise ValueError(f"unknown validation runner {kind!r}: use process or threads")
    from prefect.task_runners import ProcessPoolTaskRunner

    with ProcessPoolTaskRunner(max_workers=1, initializer=exit_with_parent, initargs=(os.getpid(),)) as runner:
        yield runner


def exit_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """In a worker process: end it (``os._exit``) within ``poll_s`` once ``parent_pid`` is no longer
    its parent. A flow-run process killed with SIGKILL cannot stop its process pool; its worker
    (hundreds of MB) would live on blocked on its task queue, and multiprocessing's resource tracker
    with it (the tracker ends by itself once no process holds its pipe). A thread, not
    PR_SET_PDEATHSIG: that signal follows the thread that started the child, not the process."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        log.warning("validation worker %d: its flow-run process %d is gone; ending it", os.getpid(), parent_pid)
        os._exit(1)

    threading.Thread(target=watch, name="ckpt-exit-with-parent", daemon=True).start()
