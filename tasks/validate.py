"""Prefect task: validate one committed checkpoint and write its verdict (validations/<step>.json).

Minimal first version (integrity via Checkpointer.verify); grows into the full Great Expectations
validation in ckptlib.validate. The signature of ``validate_step`` is stable.
"""

from __future__ import annotations

import json
import time

from prefect import task


@task(name="validate-checkpoint-step", retries=0)
def validate_step(run_url: str, step: int, storage_options: dict | None = None,
                  thresholds: dict | None = None) -> dict:
    """Validate checkpoint ``step`` of the run at ``run_url``; return (and store) the verdict."""
    from ckptlib import Checkpointer
    from ckptlib.commit import validation_key

    t0 = time.perf_counter()
    ck = Checkpointer(run_url, storage_options)
    try:
        problems = []
        try:
            problems = [str(p) for p in ck.verify(step)]
        except Exception as e:  # an unreadable manifest: still a verdict
            problems = [f"step {step}: {type(e).__name__}: {e}"]
        verdict = {
            "step": step,
            "passed": not problems,
            "failed": ["checkpoint_integrity"] if problems else [],
            "problems": problems,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        ck.store.put(validation_key(step), json.dumps(verdict, indent=2).encode())
        return verdict
    finally:
        ck.close()
