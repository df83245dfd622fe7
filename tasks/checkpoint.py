"""Prefect tasks of the coordinator: plan a run, write step 0, perform each round's cut.

Each is one call into ``trainrun`` (``resume.where_to_start``, ``step_zero.write_step_zero``,
``cut.cut_round``) with a Checkpointer of its own; small values in and out (``trainrun.results``). Planning is never retried (a refusal is
final); writing retries only a store that could not be reached, never a conflicting commit.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptlib import Checkpointer, branch
from ckptlib.encoding import DEFAULT_KEYFRAME_EVERY
from ckptlib.store import Store
from ckptlib.validate import Thresholds
from trainrun.credentials import StoreAccess
from trainrun.cut import cut_round
from trainrun.documents import Cut
from trainrun.results import CutResult, RunPlan
from trainrun.resume import where_to_start
from trainrun.spec import DEFAULT_COMMIT_TIMEOUT_S, RunSpec
from trainrun.step_zero import write_step_zero

from .access import storage_options
from .retry import transient_store_error


@task(name="plan-run", retries=0, cache_policy=NO_CACHE)
def plan_run(run_url: str, spec: RunSpec, resume: bool, run_id: str = "", access: StoreAccess | None = None,
             from_step: int | None = None, given: list[str] | None = None,
             thresholds: dict[str, Any] | None = None, validate: bool = True) -> RunPlan:
    """Where the run starts and its trajectory (``trainrun.resume.where_to_start``: a resume takes the
    run's own config but for the ``given`` fields); RunRefused when it must not start. With
    ``validate``, committed steps newer than the last healthy one that were never validated (the
    run was killed before their validation ended) are validated here first, newest first."""
    logger = get_run_logger()
    options = storage_options(access)

    def validated(step: int) -> bool:
        from trainrun.checks import validate_run_checkpoint

        from .validate import publish

        verdict = validate_run_checkpoint(run_url, step, storage_options=options,
                                          thresholds=Thresholds.from_dict(thresholds))
        logger.info("%s: validated committed step %d before resuming: %s", run_url, step,
                    "passed" if verdict.passed else f"FAILED ({', '.join(verdict.failed)})")
        publish(run_url, verdict, logger)
        return verdict.passed

    with Checkpointer(run_url, options) as ck:
        plan = where_to_start(ck, spec, resume=resume, run_id=run_id, from_step=from_step, given=given,
                              validate=validated if validate else None)
    logger.info("%s: %s", run_url, plan.note)
    return plan


@task(name="branch-run", retries=2, retry_delay_seconds=1, retry_condition_fn=transient_store_error,
      cache_policy=NO_CACHE)
def branch_run(source_url: str, step: int, target_url: str, access: StoreAccess | None = None) -> dict:
    """Make committed ``step`` of the run at ``source_url`` (-1: its last healthy step) the first
    checkpoint of the run at ``target_url`` (``ckptlib.branch``: objects copied server-side or
    linked, the verdict with them, lineage in the manifest). Idempotent: a retry, or a target that
    already starts there, is fine; a target with other checkpoints is refused (CommitConflict)."""
    options = storage_options(access)
    with Checkpointer(source_url, options) as src:
        if step < 0:
            healthy = src.latest_step(healthy=True)
            if healthy is None:
                raise ValueError(f"run {source_url} has no healthy (validated) checkpoint to branch from: name a "
                                 f"committed step (start_from.step; committed: {src.steps()[-5:]})")
            step = healthy
        if step not in src.steps():
            raise ValueError(f"run {source_url} has no committed step {step} (committed: {src.steps()[-5:]}): "
                             "choose one of its committed steps")
    manifest = branch(Store.from_url(source_url, options), step, Store.from_url(target_url, options))
    get_run_logger().info("%s starts from step %d of %s (digest %s)", target_url, step, source_url, manifest.digest)
    return {"step": step, "digest": manifest.digest, "lineage": manifest.lineage or {"run": source_url, "step": step}}


@task(name="initial-cut", retries=2, retry_delay_seconds=1, retry_condition_fn=transient_store_error,
      cache_policy=NO_CACHE)
def initial_cut(run_url: str, spec: RunSpec, access: StoreAccess | None = None,
                keyframe_every: int = DEFAULT_KEYFRAME_EVERY, run_meta: dict | None = None,
                commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S) -> CutResult:
    """Write and commit step 0 (every shard's fresh state + the coordinator's); idempotent."""
    with Checkpointer(run_url, storage_options(access), keyframe_every=keyframe_every) as ck:
        return write_step_zero(ck, spec, run_meta=run_meta, commit_timeout_s=commit_timeout_s)


@task(name="checkpoint-cut", task_run_name="cut-round-{round_no}", retries=2, retry_delay_seconds=1,
      retry_condition_fn=transient_store_error, cache_policy=NO_CACHE)
def checkpoint_cut(run_url: str, spec: RunSpec, round_no: int, cut: Cut, publish: bool, access: StoreAccess | None = None,
                   keyframe_every: int = DEFAULT_KEYFRAME_EVERY, run_meta: dict | None = None,
                   commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S, left_out: list[int] | None = None) -> CutResult:
    """The cut after round ``round_no`` (``trainrun.cut.cut_round``); commits step ``round_no`` when ``publish``.
    ``left_out``: shards a quorum cut goes ahead without (their parts carried from ``cut``)."""
    with Checkpointer(run_url, storage_options(access), keyframe_every=keyframe_every) as ck:
        out = cut_round(ck, spec, round_no, cut, publish=publish, commit_timeout_s=commit_timeout_s, run_meta=run_meta,
                        left_out=left_out or ())
    if out.committed:
        get_run_logger().info("step %d committed: loss %.4f, eval %.4f, digest %s", round_no, out.loss,
                              out.eval_loss, out.digest)
    return out
