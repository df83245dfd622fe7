"""What a training run is told: its trajectory (``RunSpec``) and its other settings (``RunSettings``).

One schema, written here once. ``flows.params.TrainParams`` (the flow's parameter and the UI form)
derives from both models and adds where the run lives; ``ckpt train`` builds its options' defaults
and help texts from the same fields; the runtime, the coordinator's beat and the watchdog's
reruns carry these very models. Importing this module loads neither torch nor Prefect.

* ``RunSpec``: everything that determines the trajectory. Saved as ``config`` in every coordinator
  part (inside the digest) and hashed into every fragment's ``config_hash``; a resume that changes
  a field is refused.
* ``RunSettings``: how long, how often, where, with which drills. May change between sessions.

Neither model shows the values it was given in its errors (``hide_input_in_errors``): a form
that is refused must not echo what was typed into it.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ckptlib.encoding import DEFAULT_KEYFRAME_EVERY

if TYPE_CHECKING:
    from workloads import WorkloadConfig

DEFAULT_COMMIT_TIMEOUT_S = 600.0
# trajectory fields added after runs existed: at their default, absent from the config (and its hash)
FIELD_DEFAULTS_LEFT_OUT: dict[str, Any] = {"ranks_per_shard": 1, "parallelism": "ddp"}
TASK_RUNNERS = "threads | dask | dask://HOST:PORT | pool:FLOW/DEPLOYMENT"


class RunSpec(BaseModel):
    """Everything that determines a run's trajectory (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

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
    ranks_per_shard: int = Field(1, ge=1, le=64, description="Rank processes per shard task: a torch.distributed "
                                 "group (gloo on CPU) that trains the shard's batches with DDP, each rank a slice "
                                 "of every batch; 1 = the shard trains in the task's own process. A resume may "
                                 "change it (docs/training.md, Ranks per shard).")
    parallelism: Literal["ddp", "fsdp"] = Field("ddp", description="How a shard's group of ranks shares the "
                                                "work (with ranks_per_shard > 1): ddp = every rank a replica, "
                                                "gradients averaged; fsdp = FSDP2, each rank holds 1/R of the "
                                                "parameters and optimizer state. One of the workload's "
                                                "parallelisms (docs/workloads.md).")

    def to_dict(self) -> dict[str, Any]:
        """The JSON of the spec, as saved in checkpoints (``config``), field order as declared.
        ``ranks_per_shard`` 1 and ``parallelism`` "ddp" are left out: a run keeps the config, hash and
        digests it had before the fields existed (and an old config reads as 1 and "ddp"). So is
        ``parallelism`` with one rank per shard: one process shards nothing (the same trajectory)."""
        d = self.model_dump(mode="json", include=set(RunSpec.model_fields))
        for field, default in FIELD_DEFAULTS_LEFT_OUT.items():
            if d[field] == default or (field == "parallelism" and self.ranks_per_shard == 1):
                del d[field]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        """Strict: an unknown field or a bad value raises ValueError (pydantic's, naming the field)."""
        return RunSpec.model_validate(d)

    def trajectory(self) -> RunSpec:
        """The trajectory fields alone (a subclass such as TrainParams holds more)."""
        return RunSpec.model_validate(self.to_dict())

    def config_hash(self) -> str:
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def workload_config(self) -> WorkloadConfig:
        from workloads import WorkloadConfig

        return WorkloadConfig(name=self.workload, seed=self.seed, batch_size=self.batch_size, lr=self.lr,
                              size=self.workload_size, extra=dict(self.workload_extra))

    @property
    def plain_averaging(self) -> bool:
        """Outer step = the mean of the shards (no outer optimizer arithmetic at all)."""
        return self.outer_lr == 1.0 and self.outer_momentum == 0.0

    @property
    def parts(self) -> list[str]:
        from .layout import run_parts

        return run_parts(self.shards)


def _readable_every(schema: dict[str, Any]) -> None:
    """The form's two branches of ``shard_checkpoint_every``, named, the default first: pydantic
    writes ``Literal["auto"]`` as a ``const``, which the Prefect UI shows as "is a const and cannot
    be changed" until the integer branch is picked."""
    schema["anyOf"] = [{"type": "string", "enum": ["auto"], "title": "auto (about 2% of training time)"},
                       {"type": "integer", "minimum": 0, "title": "every N steps (0: never)"}]


def _readable_quorum(schema: dict[str, Any]) -> None:
    """The form's two branches of ``min_shards``, named, "off" first (pydantic's are untitled)."""
    schema["anyOf"] = [{"type": "null", "title": "off (wait for every shard)"},
                       {"type": "integer", "minimum": 1, "title": "quorum of K shards"}]


def check_min_shards(min_shards: int | None, shards: int, ranks_per_shard: int = 1) -> None:
    """Quorum mode's bounds: 1 <= K <= shards, and one process per shard (a left-out shard's part is
    carried by the coordinator, which writes no group of ranks). Raises ValueError naming the flag."""
    if min_shards is None:
        return
    if isinstance(min_shards, bool) or not 1 <= min_shards <= shards:
        raise ValueError(f"min_shards (--min-shards) must be between 1 and the run's {shards} shards, got "
                         f"{min_shards!r}: give a quorum K <= --shards, or leave it out to wait for every shard")
    if ranks_per_shard > 1:
        raise ValueError(f"min_shards (--min-shards) needs one process per shard, not --ranks-per-shard "
                         f"{ranks_per_shard}: leave one of the two out")


class RunSettings(BaseModel):
    """How long, how often, where and with which drills a run trains (may change between sessions)."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    rounds: int = Field(8, ge=1, description="Total rounds of the run (a resume may extend it).")
    checkpoint_every: int = Field(1, ge=1, description="Publish a checkpoint every C rounds (and after the "
                                  "last); rounds between continue from the previous round's fragments.")
    keyframe_every: int = Field(DEFAULT_KEYFRAME_EVERY, ge=1, description="Longest delta chain + 1: restore reads "
                                "at most this many objects per chunk (chains also end once their deltas add up "
                                "to twice a keyframe: ckptlib's delta_budget).")
    task_runner: str = Field("threads", description=f"Where shard tasks run: {TASK_RUNNERS} (an existing Dask "
                             "cluster, or flow runs of a train-shard deployment on a work pool; the store must then "
                             "be reachable from every worker, e.g. S3).")
    chaos: list[str] = Field(default_factory=list, description="Fault injection for drills, e.g. "
                             "crash:shard=1,round=2 (the shard raises once; Prefect retries it); hang, zombie, stall, "
                             "kill and stop (the last two dask only) are silent failures for the watchdog "
                             "(docs/watchdog.md).")
    shard_retries: int = Field(2, ge=0, description="Prefect retries of a failed shard task.")
    retry_delay_s: float = Field(1.0, ge=0, description="Delay before a shard task retry.")
    heartbeat_every_s: float = Field(2.0, gt=0, description="Seconds between a shard's heartbeats "
                                     "(heartbeats/shard-N.json for shard N).")
    heartbeat_events: bool = Field(False, description="Also emit each heartbeat as a Prefect event "
                                   "(ckpt.shard.heartbeat) for automations.")
    commit_timeout_s: float = Field(DEFAULT_COMMIT_TIMEOUT_S, gt=0, description="How long a cut waits for every "
                                    "shard's fragment.")
    shard_checkpoint_every: int | Literal["auto"] = Field(
        "auto", description="Each shard checkpoints its own state every N steps of a round (0: never; auto: at about "
        "2% of its training time), so that a failed shard continues from there, not from the round's cut.",
        json_schema_extra=lambda schema: _readable_every(schema))
    local_tier: bool = Field(True, description="Also keep each shard's newest checkpoint on its host, in a private "
                             "folder ($XDG_RUNTIME_DIR, else /dev/shm; trainrun.local_tier), "
                             "where a rerun on the same host reads it at memory speed (the store stays the fallback).")
    preempt_grace_s: float = Field(30.0, gt=0, description="On SIGTERM (a preemption) or a cancel, each shard "
                                   "checkpoints at the step it is at and stops; the process then ends, at the "
                                   "latest this many seconds after the signal (Kubernetes gives 30).")
    min_shards: int | None = Field(
        None, title="Min shards (quorum)", description="Quorum mode: a round whose shard failed an attempt is cut "
        "with the shards that finished it cleanly, as long as there are at least this many; the failed shard is "
        "left out of that round and rejoins the next (docs/training.md, Quorum mode). Empty: off, every cut "
        "waits for every shard's retries.", json_schema_extra=lambda schema: _readable_quorum(schema))

    @field_validator("task_runner")
    @classmethod
    def _check_runner(cls, v: str) -> str:
        if v in ("threads", "dask") or (v.startswith("dask://") and ":" in v[len("dask://"):]):
            return v
        if v.startswith("pool:") and v.count("/") == 1 and all(v[len("pool:"):].split("/")):
            return v  # a deployment of the train-shard flow on a work pool (flows/runners.py)
        raise ValueError(f"task runner {v!r} is not one of {TASK_RUNNERS}")

    @field_validator("shard_checkpoint_every")
    @classmethod
    def _check_every(cls, v: int | str) -> int | str:
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"shard_checkpoint_every must be auto or a number of steps >= 0 (0: off), got {v!r}")
        return v

    @field_validator("min_shards")
    @classmethod
    def _check_quorum(cls, v: int | None) -> int | None:
        if v is not None and (isinstance(v, bool) or v < 1):
            raise ValueError(f"min_shards (--min-shards) must be a quorum K >= 1 (and <= the shards), got {v!r}; "
                             "leave it out to wait for every shard")
        return v

    @field_validator("chaos")
    @classmethod
    def _check_chaos(cls, v: list[str]) -> list[str]:
        from .chaos import parse_chaos

        return [str(parse_chaos(s)) for s in v]

    def run_settings(self) -> RunSettings:
        """These fields alone (a subclass such as TrainParams holds more)."""
        return RunSettings.model_validate(self.model_dump(include=set(RunSettings.model_fields)))


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["seed: 0 -> 1", ...]`` for every field that differs (in field order)."""
    names = list(old) + [k for k in new if k not in old]
    return [f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in names
            if old.get(k, "<absent>") != new.get(k, "<absent>")]
