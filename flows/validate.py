"""The ``validate-checkpoint`` flow: validate any committed checkpoint of a run on demand.

Deployable, so the UI can re-validate a checkpoint (after a fix, with other thresholds, or one the
training flow could not validate). Serve it locally with ``python -m flows.validate`` or deploy
``flows.validate:validate_checkpoint_flow`` to a work pool. Composition only: the work is the
``validate_step`` task (tasks/validate.py) around ``ckptlib.validate``.
"""

from __future__ import annotations

from typing import Any

from prefect import flow


@flow(name="validate-checkpoint", log_prints=True, validate_parameters=True)
def validate_checkpoint_flow(run_url: str, step: int | None = None, storage_options: dict[str, Any] | None = None,
                             thresholds: dict[str, Any] | None = None) -> dict:
    """Validate one committed checkpoint of a training run and store its verdict and report.

    Args:
        run_url: The run's store URL (a path, file:///abs/path, or s3://bucket/prefix/run-id).
        step: The checkpoint step to validate; empty = the latest committed step.
        storage_options: s3fs options for s3:// URLs, e.g. {"endpoint_url": "http://127.0.0.1:8333",
            "key": "...", "secret": "..."}.
        thresholds: Overrides of the numeric bounds, e.g. {"max_rel_change": 20}; see
            docs/validation.md (max_abs_value, max_norm, max_rel_change, rel_change_floor,
            min_data_advance, max_step_spread).

    Returns the verdict (also stored as validations/<step>.json).
    """
    from ckptlib import Checkpointer
    from tasks.validate import validate_step

    if step is None:
        with Checkpointer(run_url, storage_options) as ck:
            step = ck.latest_step()
        if step is None:
            raise ValueError(f"no committed checkpoint in {run_url}: nothing to validate")
    return validate_step(run_url, step, storage_options, thresholds)


if __name__ == "__main__":
    validate_checkpoint_flow.serve(name="validate-checkpoint")
