"""The ``validate-checkpoint`` flow: validate any committed checkpoint of a run on demand.

Deployable, so the UI can re-validate a checkpoint (after a fix, with other thresholds, or one the
training flow could not validate). Serve it locally with ``python -m flows.validate`` or deploy
``flows.validate:validate_checkpoint_flow`` to a work pool. Composition only: the work is the
``validate_step`` task (tasks/validate.py) around ``ckptlib.validate`` with the run's checks.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.states import Failed

from ckptlib import Checkpointer
from tasks.access import storage_options
from tasks.validate import ValidationFailed, validate_step
from trainrun.credentials import StoreAccess, check_url


@flow(name="validate-checkpoint", log_prints=True, validate_parameters=True)
def validate_checkpoint_flow(run_url: str, step: int | None = None, credentials_block: str | None = None,
                             thresholds: dict[str, Any] | None = None) -> Any:
    """Validate one committed checkpoint of a training run and store its verdict and report.

    Args:
        run_url: The run's store URL (a path, file:///abs/path, or s3://bucket/prefix/run-id).
        step: The checkpoint step to validate; empty = the latest committed step.
        credentials_block: Name of a Prefect Secret block holding the s3fs options of an s3:// store as
            JSON (endpoint_url, key, secret, ...). Empty: the environment of the process that runs the
            flow (AWS_ACCESS_KEY_ID, ...).
        thresholds: Overrides of the numeric bounds, e.g. {"max_rel_change": 20}; see
            docs/validation.md (max_abs_value, max_norm, max_rel_change, rel_change_floor,
            min_data_advance, max_step_spread).

    Returns the verdict as JSON (also stored as validations/<step>.json). A checkpoint that fails its
    validation ends the flow run Failed (its message names the step, the checks and the report; a
    Python caller gets ``tasks.validate.ValidationFailed`` with the verdict).
    """
    access = StoreAccess(block=credentials_block)
    check_url(run_url)
    if step is None:
        with Checkpointer(run_url, storage_options(access)) as ck:
            step = ck.latest_step()
        if step is None:
            raise ValueError(f"no committed checkpoint in {run_url}: nothing to validate")
    state = validate_step(run_url, step, access, thresholds, return_state=True)
    if state.is_failed():
        failure = state.result(raise_on_failure=False)
        if isinstance(failure, ValidationFailed):  # the verdict, not an error: no traceback, one message
            return Failed(message=str(failure), data=failure)
    return state.result().to_dict()


if __name__ == "__main__":
    validate_checkpoint_flow.serve(name="validate-checkpoint")
