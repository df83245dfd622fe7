"""The training run as a Prefect flow: ``train-run`` (composition only; the work is in ``tasks/``).

::

    plan-run ─> [initial-cut] ─> round 1: train-shard ×N ─> checkpoint-cut ─> round 2: ... ─> round R
                      │                                          │
                      └─> validate-step 0 (beside round 1)       └─> validate-step 1 (beside round 2) ...

Each round every shard is one retryable ``train-shard`` task (threads, or Dask processes); the
``checkpoint-cut`` task waits for every shard's fragment of the live generation, performs the outer
step and commits the cut (every ``checkpoint_every`` rounds and after the last); the validation of a
committed step runs in its own process beside the next round, and the flow waits for all of them
at the end. Tasks pass only small JSON values; the state travels through the store
(``docs/run-layout.md``).

The flow beats ``heartbeats/coordinator.json`` from a thread (round, phase, the cut the round starts
from, what a rerun needs). A watchdog (``flows/watchdog.py``) that finds a shard dead fences it and
reruns it itself; the flow does not wait for a fenced attempt once the live generation has written
its fragment (``tasks.watchdog.wait_for_shards``), and the cut takes the live generation's fragment,
whoever produced it (``docs/watchdog.md``).

Run it with ``ckpt train`` (live progress and a summary), ``python -m flows.train``, or from a
deployment, whose UI shows ``TrainParams`` as a form. ``docs/training.md`` explains rounds, the
cut, resume rules and determinism.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from ckptlib.commit import live_generation
from ckptlib.store import Store
from tasks.checkpoint import checkpoint_cut, initial_cut, plan_run
from tasks.shard import train_shard
from tasks.watchdog import CoordinatorBeat, wait_for_shards

from .params import TrainParams, new_run_id, run_url
from .runners import shard_runner, submit, validation_runner
from .summary import Ledger, publish_artifacts


class Validations:
    """Validation of committed steps, submitted to ``runner`` (never awaited before the end)."""

    def __init__(self, runner: Any, url: str, storage_options: dict | None, params: TrainParams):
        from tasks.validate import validate_step

        self.task, self.runner, self.url, self.so = validate_step, runner, url, storage_options
        self.enabled, self.thresholds = params.validate_checkpoints, params.thresholds
        self.futures: dict[int, Any] = {}

    def submit(self, step: int) -> None:
        if self.enabled:
            self.futures[step] = submit(self.runner, self.task, run_url=self.url, step=step,
                                        storage_options=self.so, thresholds=self.thresholds)

    def wait_all(self) -> dict[int, dict]:
        verdicts = {}
        for step, fut in self.futures.items():
            try:
                verdicts[step] = fut.result()
            except Exception as e:  # a validator that crashes leaves its checkpoint unhealthy
                verdicts[step] = {"step": step, "passed": False, "failed": ["validator_error"], "error": str(e)}
        return verdicts


def _flow_run_name() -> str:
    """``train-<run id>`` in the UI (``train-new`` while the id is still to be generated)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters.get("params")
    rid = getattr(p, "run_id", None) if not isinstance(p, dict) else p.get("run_id")
    return f"train-{rid or 'new'}"


@flow(name="train-run", flow_run_name=_flow_run_name, description="Fault-tolerant data-parallel training with incremental, validated "
      "checkpoints: rounds of shard tasks, a consistent cut after each.",
      task_runner=ThreadPoolTaskRunner(max_workers=64), validate_parameters=True, persist_result=False)
def train_run(params: TrainParams = TrainParams()) -> dict[str, Any]:  # noqa: B008 (a pydantic default: a form)
    """Train ``params.rounds`` rounds (or continue a run with ``resume``); return a JSON summary."""
    logger = get_run_logger()
    run_id = params.run_id or new_run_id()
    url = run_url(params.store, run_id)
    so = params.storage_options_dict()
    spec = params.spec().to_dict()
    ledger = Ledger(params, run_id, url)
    common = dict(run_url=url, spec=spec, storage_options=so, keyframe_every=params.keyframe_every)
    shard_task = train_shard.with_options(retries=params.shard_retries, retry_delay_seconds=params.retry_delay_s)

    plan = plan_run(url, spec, params.resume, run_id, so)
    logger.info("run %s at %s: %s", run_id, url, plan["note"])
    store = Store.from_url(url, so)
    beat = coordinator_beat(store, params, run_id, spec)  # the watchdog's sign that this run lives
    try:
        summary = _rounds(params, run_id, url, so, spec, ledger, common, shard_task, plan, store, beat)
    except BaseException as e:
        beat.finish("failed", error=f"{type(e).__name__}: {e}")
        raise
    beat.finish("finished")
    publish_artifacts(summary)
    if summary["failed_validation"]:
        logger.warning("checkpoints %s failed validation: they are not healthy (see %s/validations/)",
                       summary["failed_validation"], url)
    return summary


def coordinator_beat(store: Store, params: TrainParams, run_id: str, spec: dict) -> CoordinatorBeat:
    """``heartbeats/coordinator.json`` with what a watchdog needs to rerun a shard or restart the run."""
    from prefect.runtime import deployment, flow_run

    meta = {"run_id": run_id, "spec": spec, "chaos": list(params.chaos), "rounds": params.rounds,
            "heartbeat_every_s": params.heartbeat_every_s, "heartbeat_events": params.heartbeat_events,
            "keyframe_every": params.keyframe_every, "shard_retries": params.shard_retries,
            "retry_delay_s": params.retry_delay_s, "task_runner": params.task_runner,
            "flow_run_id": str(flow_run.id) if flow_run.id else None,
            "deployment_id": str(deployment.id) if deployment.id else None}
    return CoordinatorBeat(store, every_s=params.heartbeat_every_s, meta=meta).start()


def _rounds(params, run_id, url, so, spec, ledger, common, shard_task, plan, store, beat) -> dict[str, Any]:
    from tasks.rounds import initial_source, next_source, shard_part

    with validation_runner(params.validation_runner) as vrunner, \
            shard_runner(params.task_runner, params.shards) as srunner:
        validations = Validations(vrunner, url, so, params)
        start = plan["start_step"]
        if start is None:
            start = 0
            ledger.add_cut(initial_cut(**common, run_meta=ledger.run_meta, commit_timeout_s=params.commit_timeout_s))
            validations.submit(0)
        source = initial_source(start)
        ledger.start_rounds(plan, start)
        for r in range(start + 1, params.rounds + 1):
            t0 = time.perf_counter()
            beat.update(round=r, phase="shards", source=source)
            generations = [live_generation(store, shard_part(i)) for i in range(params.shards)]
            futures = [submit(srunner, shard_task, **common, shard=i, round=r, source=source, chaos=params.chaos,
                              heartbeat_every_s=params.heartbeat_every_s, heartbeat_events=params.heartbeat_events)
                       for i in range(params.shards)]
            # not [f.result() ...]: a hung or stopped attempt the watchdog replaced may never return
            shards = wait_for_shards(futures, store, r, generations)
            t1 = time.perf_counter()
            beat.update(phase="cut")
            cut = checkpoint_cut(**common, round=r, source=source, run_meta=ledger.run_meta,
                                 publish=r % params.checkpoint_every == 0 or r == params.rounds,
                                 commit_timeout_s=params.commit_timeout_s)
            ledger.add_round(r, shards, cut, t0, t1, time.perf_counter())
            if cut["committed"]:
                validations.submit(r)
            source = next_source(cut)
        ledger.rounds_done()
        beat.update(phase="validations")
        verdicts = validations.wait_all()
    return ledger.summary(verdicts)


if __name__ == "__main__":  # python -m flows.train: one default run (ckpt train shows progress)
    import json

    from .api import prefect_api

    with prefect_api():
        print(json.dumps(train_run(TrainParams()), indent=2, default=str))
