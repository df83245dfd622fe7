"""``TrainParams``: the one parameter of the ``train-run`` flow (a form in the Prefect UI) and of ``ckpt train``.

It derives from ``trainrun.spec.RunSpec`` (the trajectory: saved in every checkpoint, may not change
on resume) and ``RunSettings`` (the rest of what the runtime is told), and adds where the run lives
and how it is validated. One schema: the runtime, the form and the CLI's options all read it.
Light on purpose (pydantic only): the CLI reads the defaults from here without importing Prefect
or torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from trainrun.credentials import StorageOptions, StoreAccess, check_url
from trainrun.layout import check_run_id
from trainrun.spec import RunSettings, RunSpec, check_min_shards


class ValidationThresholds(BaseModel):
    """The bounds of a checkpoint's validation (``ckptlib.validate.Thresholds``, docs/validation.md), as a
    form: every field a number with ckptlib's default, so the UI shows them filled in. The defaults
    are repeated here because importing ckptlib.validate loads torch (this module must not); a test
    checks them against ckptlib's (tests/test_operate.py)."""

    model_config = ConfigDict(extra="forbid", title="Validation thresholds")

    max_abs_value: float = Field(1e4, ge=0, description="Largest |value| of a model "
                                 "tensor (parameters and buffers).")
    max_norm: float = Field(1e6, ge=0, description="Largest L2 norm of one model tensor.")
    max_rel_change: float = Field(10.0, ge=0, description="Largest relative change of a "
                                  "model tensor against the previous healthy checkpoint (an exploding update "
                                  "fails it).")
    rel_change_floor: float = Field(0.05, ge=0, description="Floor of the relative "
                                    "change's denominator, per element (tensors that start at zero).")
    min_data_advance: int = Field(1, ge=0, description="Batches each shard must have "
                                  "consumed since the previous healthy checkpoint.")
    max_step_spread: int = Field(0, ge=0, description="Largest spread of an "
                                 "optimizer's per-parameter step counters.")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class StartFrom(BaseModel):
    """A committed checkpoint a run starts from: a step of this very run (resume from there) or of
    another run under the same store (a branch: a new run whose first checkpoint is that step, its
    objects referenced, not rewritten; its lineage in its manifests)."""

    model_config = ConfigDict(extra="forbid", title="Start from a checkpoint", hide_input_in_errors=True)

    run_id: str = Field(title="Source run", description="The run whose checkpoint to start from (under the same store). This run's "
                        "own id: resume from that step; another run's: branch from it.")
    step: int = Field(-1, ge=-1, description="Its committed step; -1: its last healthy (validated) step.")

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, v: str) -> str:
        return check_run_id(v)


class TrainParams(RunSettings, RunSpec):
    """A training run: a sequence of rounds; in each, every shard trains H steps from the last
    committed cut, then the coordinator combines the shards and commits a checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=False, title="Training run", hide_input_in_errors=True)

    # where
    store: str = Field("./runs", description="Where runs live: a local directory, file:///abs/path or "
                       "s3://bucket/prefix. The run's checkpoints are at store/run_id, e.g. "
                       "s3://checkpoints/runs/my-run.")
    run_id: str | None = Field(None, description="The run's name under the store. Empty: generated "
                               "(date + short uuid). Must be new unless resume is set.")
    credentials_block: str | None = Field(None, description="Name of a Prefect Secret block holding the s3fs "
                                          "options of an s3:// store as JSON (endpoint_url, key, secret, ...). "
                                          "Empty: the environment of the processes that run the tasks "
                                          "(AWS_ACCESS_KEY_ID, ...).")
    store_block: str | None = Field(None, description="Name of a Checkpoint Store block (the store's URL and its "
                                    "s3fs options in one block, read where the run runs). Set: it replaces store and "
                                    "credentials_block (leave credentials_block empty).")
    # Not in the form (SkipJsonSchema): a secret is typed into a Secret block, never into a run's parameters.
    storage_options: SkipJsonSchema[StorageOptions | None] = Field(
        None, description="s3fs options, from Python only (masked in every record); prefer credentials_block.")
    resume: bool = Field(False, description="Continue the run from its last healthy (committed and validated) "
                         "checkpoint, with the run's own trajectory: a trajectory field left at its default takes "
                         "the run's value, one set to another value must match it. A retry of the flow run (Retry "
                         "in the UI) resumes too.")
    # Not in the form: `ckpt train` knows which options were typed (a form sends every field, so the
    # flow counts a field equal to its default as not given: a resume could not go back to a default)
    given: SkipJsonSchema[list[str] | None] = Field(
        None, description="On resume: the trajectory fields chosen by the caller (the others are the run's); "
                          "None: those set to other values than their defaults.")
    start_from: StartFrom | None = Field(None, title="Start From", description="Start from a chosen committed checkpoint: of this run "
                                         "(resume from that step) or of another run (branch).")
    # validation
    validate_checkpoints: bool = Field(True, description="Validate every committed checkpoint beside the next "
                                       "round. Only validated checkpoints are healthy (resume needs them).")
    validation_runner: Literal["process", "threads"] = Field("process", description="Where validations run: "
                                                           "one separate process (default) or the flow's threads.")
    thresholds: ValidationThresholds = Field(default_factory=ValidationThresholds,
                                             description="Bounds of the validation (docs/validation.md).")

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, v: str | None) -> str | None:
        return check_run_id(v) if v else None

    @field_validator("thresholds", mode="before")
    @classmethod
    def _default_thresholds(cls, v: Any) -> Any:
        return {} if v is None else v  # None (older callers): the defaults

    @field_validator("store")
    @classmethod
    def _check_store(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("store must not be empty: a local directory, file:///abs/path or s3://bucket/prefix")
        return check_url(v.strip())

    @field_validator("store_block")
    @classmethod
    def _check_store_block(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or "/" in v):
            raise ValueError(f"store_block {v!r} is not a block name: give the name of a Checkpoint Store block "
                             "(e.g. prod-store), without its type")
        return v.strip() if v else None

    @model_validator(mode="after")
    def _check_quorum_size(self) -> TrainParams:
        """``min_shards`` against this run's shards (``trainrun.spec.check_min_shards``)."""
        check_min_shards(self.min_shards, self.shards, self.ranks_per_shard)
        return self

    @model_validator(mode="after")
    def _store_from_block(self) -> TrainParams:
        """``store_block``: ``store`` becomes the block's URL (read from Prefect here: not a secret) and
        ``credentials_block`` its slug ``checkpoint-store/NAME``, so every task, shard pool and
        watchdog that reaches the store by ``credentials_block`` reads the block's options itself."""
        if not self.store_block:
            return self
        ref = f"checkpoint-store/{self.store_block}"
        if self.storage_options is not None or self.credentials_block not in (None, ref):
            raise ValueError(f"store_block {self.store_block!r} holds the store's credentials: leave "
                             "credentials_block and storage_options empty (or drop store_block)")
        from tasks.store_block import load_store  # Prefect, only when a block is named

        self.store, self.credentials_block = load_store(self.store_block).url, ref
        return self

    # --- derived -------------------------------------------------------------------------------

    def spec(self) -> RunSpec:
        """The trajectory configuration."""
        return self.trajectory()

    def settings(self) -> RunSettings:
        return self.run_settings()

    def access(self) -> StoreAccess:
        """How tasks reach the store (never a plain dict of options: see trainrun.credentials)."""
        return StoreAccess(block=self.credentials_block, options=self.storage_options)

    def public_dict(self) -> dict[str, Any]:
        """The parameters without secrets (for manifests' meta and reports)."""
        d = self.model_dump(mode="json", exclude={"storage_options"})
        d["storage_options"] = sorted(self.storage_options.get_secret_value()) if self.storage_options else []
        return d
