"""``TrainParams``: the one parameter of the ``train-run`` flow (a form in the Prefect UI) and of ``ckpt train``.

Light on purpose (pydantic only): the CLI reads the defaults from here without importing Prefect
or torch. ``spec()`` splits off the fields that determine the trajectory (``tasks.rounds.RunSpec``);
those are saved in every checkpoint and may not change on resume.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
TASK_RUNNERS = "threads | dask | dask://HOST:PORT"


class SecretOptions(pydantic.Secret[dict[str, Any]]):
    """Storage options (s3fs arguments: endpoint_url, key, secret, ...): masked in the UI and the API."""


def new_run_id() -> str:
    """Date and time plus a short random suffix, e.g. ``20261130-142501-3fa2c1``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def run_url(store: str, run_id: str) -> str:
    """``<store>/<run_id>``; a local store becomes an absolute path (every worker then sees the same)."""
    if "://" in store:
        return f"{store.rstrip('/')}/{run_id}"
    return os.path.join(os.path.abspath(os.path.expanduser(store)), run_id)


class TrainParams(BaseModel):
    """A training run: a sequence of rounds; in each, every shard trains H steps from the last
    committed cut, then the coordinator combines the shards and commits a checkpoint."""

    model_config = ConfigDict(extra="forbid", title="Training run")

    # where
    store: str = Field("./runs", description="Where runs live: a local directory, file:///abs/path or "
                       "s3://bucket/prefix. The run's checkpoints are at <store>/<run_id>.")
    run_id: str | None = Field(None, description="The run's name under the store. Empty: generated "
                               "(date + short uuid). Must be new unless resume is set.")
    storage_options: SecretOptions | None = Field(None, description="s3fs arguments for an s3:// store "
                                                  "(endpoint_url, key, secret, ...). Prefer credentials from the "
                                                  "environment (AWS_ACCESS_KEY_ID, ...) on shared servers.")
    # what (the trajectory: may not change on resume)
    workload: str = Field("tinylm", description="A built-in workload (tinylm, recsys, finetune, finetune-bf16) "
                          "or your own as package.module:factory (docs/workloads.md).")
    workload_size: Literal["small", "bench"] = Field("small", description="Size preset of the workload.")
    workload_extra: dict[str, Any] = Field(default_factory=dict, description="Workload-specific knobs "
                                           "overriding the size preset (see each workload's SIZES).")
    batch_size: int | None = Field(None, ge=1, description="Per-shard batch size; empty = the workload's default.")
    lr: float | None = Field(None, gt=0, description="Inner learning rate; empty = the workload's default.")
    seed: int = Field(0, description="Run seed: model init, data order and every shard's generators derive "
                      "from (seed, shard, round).")
    shards: int = Field(2, ge=1, le=1024, description="Data-parallel shards (one Prefect task each per round).")
    steps_per_round: int = Field(150, ge=1, description="Inner steps H each shard trains per round.")
    outer_lr: float = Field(1.0, gt=0, description="Outer (cut) learning rate; 1 with momentum 0 = plain "
                            "parameter averaging.")
    outer_momentum: float = Field(0.0, ge=0, lt=1, description="Outer Nesterov momentum (DiLoCo uses 0.9 with "
                                  "outer_lr 0.7); its buffers are saved in the checkpoint.")
    torch_threads: int = Field(1, ge=1, le=256, description="torch.set_num_threads for every task: part of the "
                               "trajectory (matmul reductions depend on it).")
    # how long, how often (may change on resume)
    rounds: int = Field(8, ge=1, description="Total rounds of the run (a resume may extend it).")
    checkpoint_every: int = Field(1, ge=1, description="Publish a checkpoint every C rounds (and after the "
                                  "last); rounds between continue from the previous round's fragments.")
    keyframe_every: int = Field(32, ge=1, description="Longest delta chain + 1: restore reads at most this "
                                "many objects per chunk (chains also end once their deltas add up to twice "
                                "a keyframe: ckptlib's delta_budget).")
    resume: bool = Field(False, description="Continue the run from its last healthy (committed and validated) "
                         "checkpoint.")
    task_runner: str = Field("threads", description=f"Where shard tasks run: {TASK_RUNNERS} (an existing Dask "
                             "cluster; the store must then be reachable from every worker, e.g. S3).")
    chaos: list[str] = Field(default_factory=list, description="Fault injection for drills, e.g. "
                             "crash:shard=1,round=2 (the shard raises once; Prefect retries it); hang, zombie, stall, kill and stop "
                             "(the last two dask only) are silent failures for the watchdog (docs/watchdog.md).")
    shard_retries: int = Field(2, ge=0, description="Prefect retries of a failed shard task.")
    retry_delay_s: float = Field(1.0, ge=0, description="Delay before a shard task retry.")
    heartbeat_every_s: float = Field(2.0, gt=0, description="Seconds between a shard's heartbeats "
                                     "(heartbeats/shard-<i>.json).")
    heartbeat_events: bool = Field(False, description="Also emit each heartbeat as a Prefect event "
                                   "(ckpt.shard.heartbeat) for automations.")
    validate_checkpoints: bool = Field(True, description="Validate every committed checkpoint beside the next "
                                       "round. Only validated checkpoints are healthy (resume needs them).")
    validation_runner: Literal["process", "threads"] = Field("process", description="Where validations run: "
                                                           "one separate process (default) or the flow's threads.")
    thresholds: dict[str, Any] | None = Field(None, description="Validation thresholds (see tasks/validate.py).")
    commit_timeout_s: float = Field(600.0, gt=0, description="How long a cut waits for every shard's fragment.")

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, v: str | None) -> str | None:
        if v is not None and v != "" and not _RUN_ID.match(v):
            raise ValueError(f"run id {v!r} must be 1-128 letters, digits, '_', '.' or '-', starting with a "
                             "letter or digit")
        return v or None

    @field_validator("task_runner")
    @classmethod
    def _check_runner(cls, v: str) -> str:
        if v in ("threads", "dask") or (v.startswith("dask://") and ":" in v[len("dask://"):]):
            return v
        raise ValueError(f"task runner {v!r} is not one of {TASK_RUNNERS}")

    @field_validator("chaos")
    @classmethod
    def _check_chaos(cls, v: list[str]) -> list[str]:
        from tasks.chaos import parse_chaos

        return [str(parse_chaos(s)) for s in v]

    @field_validator("store")
    @classmethod
    def _check_store(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("store must not be empty: a local directory, file:///abs/path or s3://bucket/prefix")
        return v.strip()

    # --- derived -------------------------------------------------------------------------------

    def spec(self):
        """The trajectory configuration (``tasks.rounds.RunSpec``)."""
        from tasks.rounds import RunSpec

        return RunSpec(workload=self.workload, workload_size=self.workload_size,
                       workload_extra=dict(self.workload_extra), batch_size=self.batch_size, lr=self.lr,
                       seed=self.seed, shards=self.shards, steps_per_round=self.steps_per_round,
                       outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                       torch_threads=self.torch_threads)

    def storage_options_dict(self) -> dict[str, Any] | None:
        return dict(self.storage_options.get_secret_value()) if self.storage_options is not None else None

    def public_dict(self) -> dict[str, Any]:
        """The parameters without secrets (for manifests' meta and reports)."""
        d = self.model_dump(mode="json", exclude={"storage_options"})
        d["storage_options"] = sorted(self.storage_options_dict() or {})  # names only
        return d
