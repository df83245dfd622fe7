"""The shard flow ``train-shard``: one shard's round as a flow run, for shards on a Prefect work pool.

A Prefect worker runs flow runs, not task runs. So in the work-pool mode (``--task-runner
pool:train-shard/shard``, ``flows/runners.py``) the training flow starts each shard of each round as
a run of a deployment of this flow (``run_deployment``), and every worker of the pool picks them up
as they come (``deployments/shard_pool.py`` registers the deployment and starts workers). The flow
is a shell around the very task the other runners run (``tasks.shard.train_shard``, with its
retries), so the fragment, and the digest, are the same whichever runner trained the shard.

Parameters hold no secret: the store's credentials are the worker's own (its environment:
``AWS_*`` or ``CKPT_STORAGE_OPTIONS``) or a Prefect Secret block named in ``credentials_block``.
The result travels through the store, like everything else between tasks: the training flow reads
the shard's fragment (``flows.runners.DeploymentFuture``), so no result storage has to be shared
between machines.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.shard import train_shard
from trainrun.credentials import StoreAccess
from trainrun.documents import Cut
from trainrun.layout import run_name
from trainrun.spec import RunSettings, RunSpec

_DEFAULTS = RunSettings()


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return f"{run_name(str(p.get('run_url', '')))}-shard-{p.get('shard')}-round-{p.get('round_no')}"


@flow(name="train-shard", flow_run_name=_flow_run_name, persist_result=False, validate_parameters=True,
      description="One shard's round of a training run (started by train-run with --task-runner pool:...).")
def train_shard_flow(run_url: str, spec: RunSpec, shard: int, round_no: int, cut: dict[str, Any],
                     credentials_block: str | None = None, keyframe_every: int = _DEFAULTS.keyframe_every,
                     chaos: list[str] | None = None, heartbeat_every_s: float = _DEFAULTS.heartbeat_every_s,
                     heartbeat_events: bool = False, attempt_offset: int = 0,
                     retries: int = _DEFAULTS.shard_retries, retry_delay_s: float = _DEFAULTS.retry_delay_s,
                     shard_checkpoint_every: int | str = _DEFAULTS.shard_checkpoint_every,
                     local_tier: bool = _DEFAULTS.local_tier) -> dict:
    """Train shard ``shard`` for round ``round_no`` from ``cut`` (``trainrun.documents.Cut`` as JSON) and
    write its fragment; the task's own retries (``retries``) handle loud failures."""
    from trainrun import preemption

    task = train_shard.with_options(retries=retries, retry_delay_seconds=retry_delay_s)
    # the runner cancels (or a worker shuts down) with SIGTERM: the shard checkpoints where it is first,
    # then Prefect's handler ends this flow run (Cancelled, or Crashed: started again, from the checkpoint)
    preemption.install(_DEFAULTS.preempt_grace_s)
    try:
        return task(run_url=run_url, spec=spec, shard=shard, round_no=round_no, cut=Cut.from_dict(cut),
                    access=StoreAccess(block=credentials_block), keyframe_every=keyframe_every, chaos=chaos,
                    heartbeat_every_s=heartbeat_every_s, heartbeat_events=heartbeat_events,
                    attempt_offset=attempt_offset,
                    shard_checkpoint_every=shard_checkpoint_every, local_tier=local_tier)
    finally:
        preemption.uninstall()
