"""The training run as a Prefect flow: ``train-run`` (composition only; the work is ``trainrun`` via ``tasks/``).

::

    plan-run ─> [initial-cut] ─> round 1: train-shard ×N ─> checkpoint-cut ─> round 2: ... ─> round R
                      │                                          │
                      └─> validate-step 0 (beside round 1)       └─> validate-step 1 (beside round 2) ...

Each round every shard is one retryable ``train-shard`` task (threads, or Dask processes); the
``checkpoint-cut`` task waits for every shard's fragment of the live generation, performs the outer
step and commits the cut (every ``checkpoint_every`` rounds and after the last); the validation of a
committed step runs in its own process beside the next round, and the flow waits for all of them
at the end. A step that failed validation (its task run Failed) stops the run after the round in
flight: it ends Failed, its message naming the step, the checks and the last healthy step. Tasks
pass only small values; the state travels through the store (``docs/run-layout.md``).

A resume takes its trajectory from the run (``plan-run``: ``trainrun.resume``); a deployment's run
given only some fields of ``params`` gets the deployment's for the others; a session that continues
another one (the coordinator's last beat names another flow run) names it in its log, tags and
summary (``flows/predecessor.py``).

The flow beats ``heartbeats/coordinator.json`` from a thread (``trainrun.beats.CoordinatorBeat``:
round, phase, the cut the round starts from, the spec and settings a rerun needs). A watchdog
(``flows/watchdog.py``) that finds a shard dead fences it and reruns it itself; the flow does not
wait for a fenced attempt once the live generation has written its fragment (``_wait_for_shards``),
and the cut takes the live generation's fragment, whoever produced it (``docs/watchdog.md``).

With ``min_shards`` K (quorum mode) a shard that failed an attempt of the round is left out of its
cut when at least K shards finished it cleanly: fenced, its part carried, back the next round
(``_wait``; ``docs/training.md``, Quorum mode).

Run it with ``ckpt train`` (live progress and a summary), ``python -m flows.train``, or from a
deployment, whose UI shows ``TrainParams`` as a form. ``docs/training.md`` explains rounds, the
cut, resume rules and determinism.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Cancelled, Failed
from prefect.task_runners import ThreadPoolTaskRunner

from ckptlib.commit import live_generation, live_generations
from ckptlib.errors import CheckpointError
from ckptlib.store import Store
from ckptlib.validate import Verdict
from tasks.access import storage_options
from tasks.checkpoint import branch_run, checkpoint_cut, initial_cut, plan_run
from tasks.shard import train_shard
from trainrun import preemption
from trainrun.beats import CoordinatorBeat
from trainrun.credentials import StoreAccess
from trainrun.documents import CoordinatorInfo, Cut
from trainrun.errors import Preempted
from trainrun.layout import new_run_id, run_url, shard_part
from trainrun.results import RunPlan, ShardResult
from trainrun.resume import given_fields
from trainrun.spec import check_min_shards
from trainrun.watchdog.judge import superseded

from .cancel import CancelWatch, RunCancelled, StopNotice
from .params import TrainParams
from .predecessor import announce, find_predecessor
from .runners import shard_runner, submit, validation_runner
from .summary import Ledger, publish_artifacts
from .validations import Validations


def _flow_run_name() -> str:
    """``train-<run id>`` in the UI (``train-new`` while the id is still to be generated)."""
    from prefect.runtime import flow_run

    p = flow_run.parameters.get("params")
    rid = getattr(p, "run_id", None) if not isinstance(p, dict) else p.get("run_id")
    return f"train-{rid or 'new'}"


class RunFailed(CheckpointError, RuntimeError):
    """The run ended but is not healthy: a committed step failed its validation. ``summary`` is the
    run's summary (as ``train_run`` returns it); the message names the step, the checks and the last
    healthy step to resume from. Raised to a caller of ``train_run``; the flow run ends Failed with
    the message."""

    def __init__(self, message: str, summary: dict[str, Any]):
        super().__init__(message)
        self.summary = summary

    def __reduce__(self) -> tuple[Any, ...]:
        return (RunFailed, (str(self), self.summary))


@flow(name="train-run", flow_run_name=_flow_run_name, description="Fault-tolerant data-parallel training with "
      "incremental, validated checkpoints: rounds of shard tasks, a consistent cut after each.",
      task_runner=ThreadPoolTaskRunner(max_workers=64), validate_parameters=True, persist_result=False)
def train_run(params: TrainParams = TrainParams()) -> Any:  # noqa: B008 (a pydantic default: a form)
    """Train ``params.rounds`` rounds (or continue a run with ``resume``); return a JSON summary.

    A run with a step that failed validation stops after the round in flight and ends Failed
    (``RunFailed`` to a Python caller, with the summary)."""
    from prefect.runtime import deployment, flow_run

    logger = get_run_logger()
    params = _with_deployment_defaults(params)
    run_id = params.run_id or _named(new_run_id())
    url = run_url(params.store, run_id)
    settings, access = params.settings(), params.access()
    store = Store.from_url(url, storage_options(access))
    own = str(flow_run.id) if flow_run.id else None
    preemption.reset()  # a session of its own, even in a process that outlived a cancelled one
    notice = StopNotice(store, own or run_id).start()  # a stop reaches shards in other processes too
    preemption.install(settings.preempt_grace_s)  # SIGTERM: the shards checkpoint first, then Prefect's handler
    watch = CancelWatch(own).start() if own else None  # a cancel of an in-process run reaches it only so
    pred = find_predecessor(store, own)
    ledger = Ledger(params, run_id, url)
    resume, from_step = _start_point(params, run_id, url, access, ledger)
    plan = plan_run(url, params.spec(), resume, run_id, access, from_step=from_step,
                    given=params.given if params.given is not None else
                    sorted(given_fields(params.spec(), params.model_fields_set)),
                    thresholds=params.thresholds.to_dict(), validate=params.validate_checkpoints)
    params = params.model_copy(update=plan.config or {})  # a resume's trajectory is the run's own
    spec = params.spec()
    check_min_shards(params.min_shards, spec.shards, spec.ranks_per_shard)  # against the run's own shards
    ledger.set_params(params)
    logger.info("run %s at %s: %s", run_id, url, plan.note)
    if pred is not None:
        ledger.predecessor = announce(pred, own, logger).to_dict()
    info = CoordinatorInfo(run_id=run_id, spec=spec, settings=settings, flow_run_id=own,
                           deployment_id=str(deployment.id) if deployment.id else None)
    beat = CoordinatorBeat(store, info, every_s=settings.heartbeat_every_s).start()  # the run lives, for watchdogs
    try:
        verdicts = _train(params, url, access, store, plan, ledger, beat)
    except BaseException as e:
        beat.finish("failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        if watch is not None:
            watch.stop()
        preemption.uninstall()
        notice.stop()
        if preemption.requested() == "cancel":  # this session's cancel: a later one in this process starts clean
            preemption.reset()
        if spec.ranks_per_shard > 1:  # the shards' groups were kept warm from round to round
            from trainrun.rank_group import end_groups

            end_groups(url)
    summary = ledger.summary(verdicts)
    failure = summary["failure"]
    if summary["cancelled"]:  # a cancel (or a preemption that left the process running): a state, not an error
        beat.finish("failed", error=summary["cancelled"])
        publish_artifacts(summary)
        return Cancelled(message=summary["cancelled"], data=RunCancelled(summary["cancelled"], summary))
    beat.finish("failed" if failure else "finished", error=failure)
    publish_artifacts(summary)
    if failure:
        return Failed(message=failure, data=RunFailed(failure, summary))
    return summary


def _train(params: TrainParams, url: str, access: StoreAccess, store: Store, plan: RunPlan, ledger: Ledger,
           beat: CoordinatorBeat) -> dict[int, Verdict]:
    """Step 0 when the plan says so, then the rounds, each validated beside the next; stops after the
    round in flight once a step failed validation. Returns every verdict."""
    spec, settings = params.spec(), params.settings()
    shard_task = train_shard.with_options(retries=settings.shard_retries, retry_delay_seconds=settings.retry_delay_s)
    common = {"spec": spec, "access": access, "keyframe_every": settings.keyframe_every}
    with validation_runner(params.validation_runner) as vrunner, \
            shard_runner(settings.task_runner, spec.shards, settings.preempt_grace_s) as srunner:
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
            if (why := preemption.requested()) is not None:  # asked between rounds: none started
                ledger.stop_requested(r - 1, [], why)
                break
            if (bad := validations.first_failure()) is not None:
                get_run_logger().warning("step %d failed validation (%s): no more rounds (%d of %d done)", bad.step,
                                         ", ".join(bad.failed), r - 1, settings.rounds)
                ledger.stopped_after = r - 1
                break
            t0 = time.perf_counter()
            beat.update(round_no=r, phase="shards", cut=cut)
            _void_marks(store, r)  # an earlier session's quorum marks of this round (a resumed run redoes it)
            live = live_generations(store)  # one listing for every shard
            generations = [live.get(shard_part(i), 0) for i in range(spec.shards)]
            futures = [submit(srunner, shard_task, run_url=url, **common, shard=i, round_no=r, cut=cut,
                              chaos=settings.chaos, heartbeat_every_s=settings.heartbeat_every_s,
                              heartbeat_events=settings.heartbeat_events,
                              shard_checkpoint_every=settings.shard_checkpoint_every, local_tier=settings.local_tier,
                              quorum=settings.min_shards is not None)
                       for i in range(spec.shards)]
            try:
                with _stopping_together(futures, srunner is not None, settings.preempt_grace_s):
                    shards, replaced_at, left_out = _wait(futures, store, r, generations, settings.min_shards)
            except Exception:
                if (why := preemption.requested()) is None:
                    raise
                # the shards were asked to stop: each checkpoints where it is; no cut of this round
                preemption.wait_stopped(settings.preempt_grace_s)
                ledger.stop_requested(r - 1, stopped_at(store, r, spec.shards), why)
                break
            t1 = time.perf_counter()
            beat.update(phase="cut")
            with preemption.training():  # a SIGTERM now waits (within its grace) for the commit
                _leave_out(store, r, left_out, generations)
                result = checkpoint_cut(url, round_no=r, cut=cut, run_meta=ledger.run_meta,
                                        publish=r % settings.checkpoint_every == 0 or r == settings.rounds,
                                        commit_timeout_s=settings.commit_timeout_s, left_out=left_out, **common)
            ledger.add_round(r, shards, result, t0, t1, time.perf_counter(), replaced_at=replaced_at,
                             left_out=left_out if settings.min_shards is not None else None)
            if result.committed:
                validations.submit(r)
            cut = result.next_cut()
        ledger.rounds_done()
        beat.update(phase="validations")
        return validations.wait_all()


@contextmanager
def _stopping_together(futures: list[Any], remote: bool, grace_s: float) -> Iterator[None]:
    """Shards in other processes (``remote``: Dask workers, a work pool) count as a training loop of
    this one: a SIGTERM goes on to Prefect's handler only once they stopped (within its grace), and
    on a stop every shard task is waited for (within the grace), so that where each stopped is stored."""
    if not remote:
        yield
        return
    with preemption.training():
        try:
            yield
        except Exception:
            if preemption.requested() is not None:
                deadline = time.monotonic() + grace_s
                for f in futures:
                    f.wait(max(0.0, deadline - time.monotonic()))
            raise


def stopped_at(store: Store, round_no: int, shards: int) -> list[int | None]:
    """Each shard's newest checkpoint step of round ``round_no`` (its live generation's), None: none."""
    from trainrun.resume_point import newest_of

    live = live_generations(store)
    refs = [newest_of(store, shard_part(i), round_no, live.get(shard_part(i), 0)) for i in range(shards)]
    return [ref.round_step if ref is not None else None for ref in refs]


def _named(run_id: str) -> str:
    """A generated run id; the flow run (``train-new`` so far) is renamed ``train-<run id>``: the UI
    shows which run it trains, and a watchdog can confirm it when the run dies (flows/resume.py)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run.id:
        try:
            with get_client(sync_client=True) as client:
                client.update_flow_run(flow_run.id, name=f"train-{run_id}")
        except Exception as e:  # noqa: BLE001 - a name is for people: train on
            get_run_logger().warning("could not rename the flow run to train-%s: %s", run_id, e)
    return run_id


def _with_deployment_defaults(params: TrainParams) -> TrainParams:
    """A deployment's run given only some fields of ``params`` gets the deployment's for the others.

    Prefect merges a run's parameters into its deployment's only at the top level: ``prefect
    deployment run train-run/train --param params='{"rounds": 2}'`` replaces the whole object, and
    the run would train with the flow's own defaults (a local ``./runs``, no S3). The fields the run
    was given are those pydantic saw (``model_fields_set``); the UI's form and the watchdog send
    every field, so for them nothing changes. Outside a deployment: ``params`` as given."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment

    base = None
    if deployment.id:  # (prefect.runtime.deployment.parameters are the flow run's, not the deployment's)
        try:
            with get_client(sync_client=True) as client:
                base = (client.read_deployment(UUID(str(deployment.id))).parameters or {}).get("params")
        except Exception as e:  # noqa: BLE001 - no API to ask: the parameters as given
            get_run_logger().warning("could not read the deployment's parameters (%s): the run's as given", e)
    if not isinstance(base, dict) or params.model_fields_set >= set(base):
        return params
    given = params.model_dump(mode="json", include=params.model_fields_set, exclude={"storage_options"})
    merged = TrainParams.model_validate({**base, **given})
    return merged.model_copy(update={"storage_options": params.storage_options}) if params.storage_options else merged


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


def _wait_for_shards(futures: list[Any], store: Store, round_no: int, generations: list[int], *,
                     poll_s: float = 0.25) -> tuple[list[ShardResult], float | None]:
    """The shard tasks' results, in order, and when the last shard that was replaced settled (None:
    none was). A task whose attempt was fenced is not waited for once the live generation has
    written its fragment (a hung thread or a stopped process may never return); a task that failed
    after being fenced is not an error (the live generation owns the shard and the cut waits for
    its fragment). Anything else that fails raises."""
    finished: queue.Queue[int] = queue.Queue()
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _f, i=i: finished.put(i))
    results: list[ShardResult | None] = [None] * len(futures)
    pending = set(range(len(futures)))
    replaced_at = None
    while pending:
        done = _drain(finished, poll_s)
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
            if not results[i].finished:  # type: ignore[union-attr]  # set just above
                replaced_at = time.perf_counter()
    return [r for r in results if r is not None], replaced_at


# --- quorum mode (``min_shards``): docs/training.md, Quorum mode ---------------------------------------

def _wait(futures: list[Any], store: Store, round_no: int, generations: list[int],
          min_shards: int | None) -> tuple[list[ShardResult], float | None, list[int]]:
    """The round's shard results, when the last replaced shard settled, and the shards left out of
    its cut: none without ``min_shards`` (every shard is waited for, ``_wait_for_shards``)."""
    if min_shards is None:
        return (*_wait_for_shards(futures, store, round_no, generations), [])
    clean, failed = _split(futures, store, round_no, generations)
    if not failed:
        return [clean[i] for i in sorted(clean)], None, []
    if len(clean) >= min_shards:
        get_run_logger().warning("round %d: shards %s failed an attempt: the cut goes ahead with shards %s "
                                 "(min_shards %d); they rejoin at round %d", round_no, sorted(failed),
                                 sorted(clean), min_shards, round_no + 1)
        out = {**clean, **{i: ShardResult(shard=i, round=round_no, part=shard_part(i), status="fenced",
                                          generation=generations[i], error=f"left out of the quorum cut: {why}")
                           for i, why in failed.items()}}
        return [out[i] for i in sorted(out)], None, sorted(failed)
    get_run_logger().warning("round %d: %d shard(s) finished cleanly, fewer than min_shards %d: the round waits for "
                             "the retries of shards %s, as without quorum", round_no, len(clean), min_shards,
                             sorted(failed))
    return (*_wait_for_shards(futures, store, round_no, generations), [])


def _split(futures: list[Any], store: Store, round_no: int, generations: list[int], *,
           poll_s: float = 0.25) -> tuple[dict[int, ShardResult], dict[int, str]]:
    """Wait until every shard either finished round ``round_no`` with no failed attempt (its result)
    or failed one (why): its task marked it (``tasks.shard``: it raised, or its rerun found it
    dead), it was fenced, its result is a retry's, or its task failed. Which shards are which does
    not depend on timing: a shard that failed is not clean, even if its retry has finished."""
    from tasks.shard import FAILED, marked

    finished: queue.Queue[int] = queue.Queue()
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _f, i=i: finished.put(i))
    clean: dict[int, ShardResult] = {}
    failed: dict[int, str] = {}
    pending = set(range(len(futures)))
    while pending:
        done = _drain(finished, poll_s)
        marks = marked(store, round_no, FAILED)  # listed after ``done``: a retry that finished is marked already
        fences = live_generations(store)
        for i in sorted(pending):
            part = shard_part(i)
            if i in marks:
                failed[i] = "an attempt failed"
            elif fences.get(part, 0) > generations[i]:
                failed[i] = f"fenced (generation {fences[part]})"
            elif i in done:
                try:
                    res = _settle(futures[i], store, round_no, part, generations[i], i)
                except Exception as e:  # noqa: BLE001 - a task that failed for good: left out, or waited for
                    if preemption.requested() is not None:
                        raise
                    res = ShardResult(shard=i, round=round_no, part=part, status="fenced",
                                      generation=generations[i], error=f"{type(e).__name__}: {e}")
                if res.finished and (res.attempt or 1) == 1:
                    clean[i] = res
                else:
                    failed[i] = f"attempt {res.attempt}" if res.finished else res.error or res.status
            else:
                continue
            pending.discard(i)
    return clean, failed


def _drain(finished: queue.Queue[int], poll_s: float) -> set[int]:
    """The futures done since the last look (waits up to ``poll_s`` for the first)."""
    try:
        done = {finished.get(timeout=poll_s)}
    except queue.Empty:
        done = set()
    while not finished.empty():
        done.add(finished.get_nowait())
    return done


def _leave_out(store: Store, round_no: int, left_out: list[int], generations: list[int]) -> None:
    """Make the left-out shards' attempts of round ``round_no`` harmless before the cut: a mark their
    retries find before they train (``tasks.shard``), then a new generation (a fence), so an attempt
    still running stops at its next beat, checkpoint or write, and nothing it writes is taken; the
    cut writes the shard's carried part as that generation."""
    from ckptlib.commit import fence
    from tasks.shard import LEFT_OUT, mark

    for i in left_out:
        part = shard_part(i)
        mark(store, part, round_no, LEFT_OUT, generation=generations[i], reason="an attempt failed")
        while not fence(store, part, live_generation(store, part) + 1, by="train flow (quorum)",
                        reason=f"left out of round {round_no}'s quorum cut: an attempt failed",
                        details={"quorum_round": round_no}):
            pass  # another fence won that generation (a watchdog): take the next one


def _void_marks(store: Store, round_no: int) -> None:
    """A round starts: quorum marks of it are an earlier session's (a resumed run redoes the round),
    and void. A shard that session left out is fenced anew, so that its attempts of this session
    never meet the part the old cut carried under its generation."""
    from ckptlib.commit import fence
    from tasks.shard import LEFT_OUT, marked

    keys = store.list(f"quorum/{round_no}/")
    for i in marked(store, round_no, LEFT_OUT) if keys else ():
        part = shard_part(i)
        fence(store, part, live_generation(store, part) + 1, by="train flow (quorum)",
              reason=f"a new session redoes round {round_no}")
    for key in keys:
        store.delete(key)


def _settle(future: Any, store: Store, round_no: int, part: str, generation: int, shard: int) -> ShardResult:
    try:
        res: ShardResult = future.result()
        if isinstance(res, dict) and res.get("status") == "preempted":  # tasks.shard: it checkpointed and stopped
            raise Preempted(f"{part} round {round_no} stopped at step {res.get('round_step')} ({res.get('reason')})",
                            part=part, round_no=round_no, round_step=int(res.get("round_step") or 0),
                            reason=str(res.get("reason")))
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
