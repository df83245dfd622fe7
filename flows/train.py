"""The training run as a Prefect flow: ``train-run`` (composition only; the work is ``trainrun`` via ``tasks/``).

::

    plan-run ─> [initial-cut] ─> round 1: train-shard ×N ─> checkpoint-cut ─> round 2: ... ─> round R
                      │                                          │
                      └─> validate-step 0 (beside round 1)       └─> validate-step 1 (beside round 2) ...

Each round every shard is one retryable ``train-shard`` task (threads, or Dask processes); the
``checkpoint-cut`` task waits for every shard's fragment of the live generation, performs the outer
step and commits the cut (every ``checkpoint_every`` rounds and after the last); the validation of a
committed step runs in its own process beside the next round, and the flow waits for all of them
at the end. Tasks pass only small values; the state travels through the store
(``docs/run-layout.md``).

The flow beats ``heartbeats/coordinator.json`` from a thread (``trainrun.beats.CoordinatorBeat``:
round, phase, the cut the round starts from, the spec and settings a rerun needs). A watchdog
(``flows/watchdog.py``) that finds a shard dead fences it and reruns it itself; the flow does not
wait for a fenced attempt once the live generation has written its fragment (``_wait_for_shards``),
and the cut takes the live generation's fragment, whoever produced it (``docs/watchdog.md``).

Run it with ``ckpt train`` (live progress and a summary), ``python -m flows.train``, or from a
deployment, whose UI shows ``TrainParams`` as a form. ``docs/training.md`` explains rounds, the
cut, resume rules and determinism.
"""

from __future__ import annotations

import queue
import time
from dataclasses import replace
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from ckptlib.commit import live_generation, live_generations
from ckptlib.store import Store
from ckptlib.validate import Verdict, error_verdict
from tasks.access import storage_options
from tasks.checkpoint import branch_run, checkpoint_cut, initial_cut, plan_run
from tasks.shard import train_shard
from tasks.validate import validate_step
from trainrun.beats import CoordinatorBeat
from trainrun.credentials import StoreAccess
from trainrun.documents import CoordinatorInfo, Cut
from trainrun.layout import new_run_id, run_url, shard_part
from trainrun.results import ShardResult
from trainrun.watchdog.judge import superseded

from .params import TrainParams
from .runners import shard_runner, submit, validation_runner
from .summary import Ledger, publish_artifacts


def _flow_run_name() -> str:
    """``train-<run id>`` in the UI (``train-new`` while the id is still to be generated)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters.get("params")
    rid = getattr(p, "run_id", None) if not isinstance(p, dict) else p.get("run_id")
    return f"train-{rid or 'new'}"


@flow(name="train-run", flow_run_name=_flow_run_name, description="Fault-tolerant data-parallel training with "
      "incremental, validated checkpoints: rounds of shard tasks, a consistent cut after each.",
      task_runner=ThreadPoolTaskRunner(max_workers=64), validate_parameters=True, persist_result=False)
def train_run(params: TrainParams = TrainParams()) -> dict[str, Any]:  # noqa: B008 (a pydantic default: a form)
    """Train ``params.rounds`` rounds (or continue a run with ``resume``); return a JSON summary."""
    from prefect.runtime import deployment, flow_run

    logger = get_run_logger()
    run_id = params.run_id or new_run_id()
    url = run_url(params.store, run_id)
    spec, settings, access = params.spec(), params.settings(), params.access()
    ledger = Ledger(params, run_id, url)
    resume, from_step = _start_point(params, run_id, url, access, ledger)
    plan = plan_run(url, spec, resume, run_id, access, from_step=from_step)
    logger.info("run %s at %s: %s", run_id, url, plan.note)
    store = Store.from_url(url, storage_options(access))
    info = CoordinatorInfo(run_id=run_id, spec=spec, settings=settings,
                           flow_run_id=str(flow_run.id) if flow_run.id else None,
                           deployment_id=str(deployment.id) if deployment.id else None)
    beat = CoordinatorBeat(store, info, every_s=settings.heartbeat_every_s).start()  # the run lives, for watchdogs
    shard_task = train_shard.with_options(retries=settings.shard_retries, retry_delay_seconds=settings.retry_delay_s)
    common = {"spec": spec, "access": access, "keyframe_every": settings.keyframe_every}
    try:
        with validation_runner(params.validation_runner) as vrunner, \
                shard_runner(settings.task_runner, spec.shards) as srunner:
            validations = Validations(vrunner, url, access, params)
            start = plan.start_step
            if start is None:
                start = 0
                ledger.add_cut(initial_cut(url, **common, run_meta=ledger.run_meta,
                                           commit_timeout_s=settings.commit_timeout_s))
                validations.submit(0)
            cut = Cut.of_step(start)
            ledger.start_rounds(plan, start)
            for r in range(start + 1, settings.rounds + 1):
                t0 = time.perf_counter()
                beat.update(round_no=r, phase="shards", cut=cut)
                live = live_generations(store)  # one listing for every shard
                generations = [live.get(shard_part(i), 0) for i in range(spec.shards)]
                futures = [submit(srunner, shard_task, run_url=url, **common, shard=i, round_no=r, cut=cut,
                                  chaos=settings.chaos, heartbeat_every_s=settings.heartbeat_every_s,
                                  heartbeat_events=settings.heartbeat_events,
                                  shard_checkpoint_every=settings.shard_checkpoint_every,
                                  local_tier=settings.local_tier)
                           for i in range(spec.shards)]
                shards = _wait_for_shards(futures, store, r, generations)
                t1 = time.perf_counter()
                beat.update(phase="cut")
                result = checkpoint_cut(url, round_no=r, cut=cut, run_meta=ledger.run_meta,
                                        publish=r % settings.checkpoint_every == 0 or r == settings.rounds,
                                        commit_timeout_s=settings.commit_timeout_s, **common)
                ledger.add_round(r, shards, result, t0, t1, time.perf_counter())
                if result.committed:
                    validations.submit(r)
                cut = result.next_cut()
            ledger.rounds_done()
            beat.update(phase="validations")
            verdicts = validations.wait_all()
    except BaseException as e:
        beat.finish("failed", error=f"{type(e).__name__}: {e}")
        raise
    beat.finish("finished")
    summary = ledger.summary(verdicts)
    publish_artifacts(summary)
    if summary["failed_validation"]:
        logger.warning("checkpoints %s failed validation: they are not healthy (see %s/validations/)",
                       summary["failed_validation"], url)
    return summary


def _start_point(params: TrainParams, run_id: str, url: str, access: StoreAccess,
                 ledger: Ledger) -> tuple[bool, int | None]:
    """(resume, from_step): where the run starts. A retry of this flow run (Retry in the UI, a flow
    retry) resumes: its first attempt wrote the checkpoints. ``start_from`` another run branches it
    into this one first (``branch-run``), then resumes from the branched step; of this run, resumes
    from the chosen step. The lineage goes into every manifest's meta (``run_meta``)."""
    from prefect.runtime import flow_run

    resume = params.resume or int(flow_run.run_count or 1) > 1
    src = params.start_from
    if src is None:
        return resume, None
    if src.run_id == run_id:
        return True, None if src.step < 0 else src.step
    branched = branch_run(run_url(params.store, src.run_id), src.step, url, access)
    ledger.run_meta["lineage"] = branched["lineage"]
    return True, branched["step"]


class Validations:
    """Validation of committed steps, submitted to ``runner`` (never awaited before the end)."""

    def __init__(self, runner: Any, url: str, access: StoreAccess, params: TrainParams):
        self.runner, self.url, self.access = runner, url, access
        self.enabled, self.thresholds = params.validate_checkpoints, params.thresholds.to_dict()
        self.futures: dict[int, Any] = {}

    def submit(self, step: int) -> None:
        if self.enabled:
            self.futures[step] = submit(self.runner, validate_step, run_url=self.url, step=step, access=self.access,
                                        thresholds=self.thresholds)

    def wait_all(self) -> dict[int, Verdict]:
        verdicts = {}
        for step, fut in self.futures.items():
            try:
                verdicts[step] = fut.result()
            except Exception as e:  # noqa: BLE001 - the store stayed unreachable, or the validator crashed: not healthy
                verdicts[step] = error_verdict(step, self.url, e)
        return verdicts


def _wait_for_shards(futures: list[Any], store: Store, round_no: int, generations: list[int], *,
                     poll_s: float = 0.25) -> list[ShardResult]:
    """The shard tasks' results, in order. A task whose attempt was fenced is not waited for once
    the live generation has written its fragment (a hung thread or a stopped process may never
    return); a task that failed after being fenced is not an error (the live generation owns the
    shard and the cut waits for its fragment). Anything else that fails raises."""
    finished: queue.Queue[int] = queue.Queue()
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _f, i=i: finished.put(i))
    results: list[ShardResult | None] = [None] * len(futures)
    pending = set(range(len(futures)))
    while pending:
        try:
            done = {finished.get(timeout=poll_s)}
        except queue.Empty:
            done = set()
        while not finished.empty():
            done.add(finished.get_nowait())
        fences = live_generations(store)  # one listing per look, however many shards are pending
        for i in sorted(pending):
            part = shard_part(i)
            if i in done:
                results[i] = _settle(futures[i], store, round_no, part, generations[i], i)
            elif (live := superseded(store, part, round_no, generations[i], fences.get(part, 0))) is not None:
                results[i] = ShardResult(shard=i, round=round_no, part=part, status="replaced",
                                         generation=generations[i], live_generation=live)
            else:
                continue
            pending.discard(i)
    return [r for r in results if r is not None]


def _settle(future: Any, store: Store, round_no: int, part: str, generation: int, shard: int) -> ShardResult:
    try:
        res: ShardResult = future.result()
    except Exception as e:  # noqa: BLE001
        if live_generation(store, part) > generation:  # fenced meanwhile: the live generation owns the shard
            return ShardResult(shard=shard, round=round_no, part=part, status="replaced", generation=generation,
                               error=f"{type(e).__name__}: {e}")
        raise
    if res.finished and res.generation < live_generation(store, part):
        res = replace(res, status="superseded")  # a zombie that believed it was live
    return res


if __name__ == "__main__":  # python -m flows.train: one default run (ckpt train shows progress)
    import json

    from .api import prefect_api

    with prefect_api():
        print(json.dumps(train_run(TrainParams()), indent=2, default=str))
