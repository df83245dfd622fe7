"""``TrainParams``: the one parameter of the ``train-run`` flow (a form in the Prefect UI) and of ``ckpt train``.

It derives from ``trainrun.spec.RunSpec`` (the trajectory: saved in every checkpoint, may not change
on resume) and ``RunSettings`` (the rest of what the runtime is told), and adds where the run lives
and how it is validated. One schema: the runtime, the form and the CLI's options all read it.
Light on purpose (pydantic only): the CLI reads the defaults from here without importing Prefect
or torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from trainrun.credentials import StorageOptions, StoreAccess, check_url
from trainrun.layout import check_run_id
from trainrun.spec import RunSettings, RunSpec


class TrainParams(RunSettings, RunSpec):
    """A training run: a sequence of rounds; in each, every shard trains H steps from the last
    committed cut, then the coordinator combines the shards and commits a checkpoint."""

    model_config = ConfigDict(extra="forbid", frozen=False, title="Training run", hide_input_in_errors=True)

    # where
    store: str = Field("./runs", description="Where runs live: a local directory, file:///abs/path or "
                       "s3://bucket/prefix. The run's checkpoints are at <store>/<run_id>.")
    run_id: str | None = Field(None, description="The run's name under the store. Empty: generated "
                               "(date + short uuid). Must be new unless resume is set.")
    credentials_block: str | None = Field(None, description="Name of a Prefect Secret block holding the s3fs "
                                          "options of an s3:// store as JSON (endpoint_url, key, secret, ...). "
                                          "Empty: the environment of the processes that run the tasks "
                                          "(AWS_ACCESS_KEY_ID, ...).")
    storage_options: StorageOptions | None = Field(None, description="s3fs options, from Python only (masked in "
                                                   "the UI and the API); prefer credentials_block.")
    resume: bool = Field(False, description="Continue the run from its last healthy (committed and validated) "
                         "checkpoint.")
    # validation
    validate_checkpoints: bool = Field(True, description="Validate every committed checkpoint beside the next "
                                       "round. Only validated checkpoints are healthy (resume needs them).")
    validation_runner: Literal["process", "threads"] = Field("process", description="Where validations run: "
                                                           "one separate process (default) or the flow's threads.")
    thresholds: dict[str, Any] | None = Field(None, description="Validation thresholds (docs/validation.md).")

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, v: str | None) -> str | None:
        return check_run_id(v) if v else None

    @field_validator("store")
    @classmethod
    def _check_store(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("store must not be empty: a local directory, file:///abs/path or s3://bucket/prefix")
        return check_url(v.strip())

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
