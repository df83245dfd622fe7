"""Prefect tasks of the coordinator: plan a run, write step 0, perform each round's cut.

Thin wrappers around ``tasks.rounds`` (``plan_run``, ``initial_cut``, ``cut_round``): a Checkpointer
per call, small JSON in and out. The cut waits for every shard's fragment of the live generation,
combines the shards (the outer step), writes the ``coordinator`` part and, when asked to publish,
commits the manifest; only new chunks (deltas) are uploaded.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE


@task(name="plan-run", retries=0, cache_policy=NO_CACHE)
def plan_run(run_url: str, spec: dict, resume: bool, run_id: str = "", storage_options: dict | None = None) -> dict:
    """Where the run starts: ``{"start_step": int | None, "committed", "healthy", "note"}``.
    Raises RunRefused (no retry) when the run must not start: see ``tasks.rounds.plan_run``."""
    from ckptlib import Checkpointer

    from .rounds import RunSpec
    from .rounds import plan_run as plan

    ck = Checkpointer(run_url, storage_options)
    try:
        out = plan(ck, RunSpec.from_dict(spec), resume=resume, run_id=run_id)
    finally:
        ck.close()
    get_run_logger().info("%s: %s", run_url, out["note"])
    return out


@task(name="initial-cut", retries=1, retry_delay_seconds=1, cache_policy=NO_CACHE)
def initial_cut(run_url: str, spec: dict, storage_options: dict | None = None, keyframe_every: int = 32,
                run_meta: dict | None = None, commit_timeout_s: float = 600.0) -> dict:
    """Write and commit step 0 (every shard's fresh state + the coordinator's); idempotent."""
    from ckptlib import Checkpointer

    from .rounds import RunSpec
    from .rounds import initial_cut as write_initial

    ck = Checkpointer(run_url, storage_options, keyframe_every=keyframe_every)
    try:
        return write_initial(ck, RunSpec.from_dict(spec), run_meta=run_meta, commit_timeout_s=commit_timeout_s)
    finally:
        ck.close()


@task(name="checkpoint-cut", task_run_name="cut-round-{round}", retries=2, retry_delay_seconds=1,
      cache_policy=NO_CACHE)
def checkpoint_cut(run_url: str, spec: dict, round: int, source: dict, publish: bool,
                   storage_options: dict | None = None, keyframe_every: int = 32, run_meta: dict | None = None,
                   commit_timeout_s: float = 600.0) -> dict:
    """The cut after round ``round``: gather the shards' live fragments, outer step, coordinator part,
    and (``publish``) the manifest of step ``round``. Returns sizes, digest, loss and timings."""
    from ckptlib import Checkpointer

    from .rounds import RunSpec, cut_round

    ck = Checkpointer(run_url, storage_options, keyframe_every=keyframe_every)
    try:
        out = cut_round(ck, RunSpec.from_dict(spec), round, source, publish=publish,
                        commit_timeout_s=commit_timeout_s, run_meta=run_meta)
    finally:
        ck.close()
    if out["committed"]:
        get_run_logger().info("step %d committed: loss %.4f, eval %.4f, digest %s", round, out["loss"],
                              out["eval_loss"], out["digest"])
    return out
