"""Where a run starts: the resume rules (``docs/training.md``, *Resume rules*), without Prefect or torch.

``where_to_start`` reads the run's committed steps, its verdicts and the configuration stored in a
checkpoint, and either says where the run starts or refuses (``RunRefused``) with the fix. The CLI
asks before Prefect starts (fast refusals); the flow's ``plan-run`` task asks again (deployments).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from ckptlib import Checkpointer
from ckptlib.tree import unflatten

from .errors import RunRefused
from .layout import COORDINATOR
from .results import Reshard, RunPlan
from .spec import RunSpec, describe_changes

# How to resume, said to both kinds of users: the CLI's and the form's (deployments, the UI).
HOW_TO_RESUME = "resume (`ckpt train --resume`, or resume: true in the form), with the same run id and store"


def stored_config(ck: Checkpointer, step: int) -> dict[str, Any] | None:
    """The ``config`` of the coordinator part of committed ``step`` (its fragment; no chunk read)."""
    if COORDINATOR not in ck.manifest(step).parts:
        return None
    skeleton = getattr(ck.fragment(step, COORDINATOR), "skeleton", None)  # None: a group's part (docs/distributed.md)
    if not isinstance(skeleton, dict) or "config" not in skeleton:
        return None
    config = unflatten(skeleton["config"], [])
    return config if isinstance(config, dict) else None


def where_to_start(ck: Checkpointer, spec: RunSpec, *, resume: bool, run_id: str = "",
                   from_step: int | None = None) -> RunPlan:
    """Where a run starts. Raises RunRefused when it must not start (see the resume rules).

    ``from_step`` (with ``resume``): start from this committed step rather than the last healthy
    one (the form's ``start_from``; it need not be validated: it is validated again as the run goes).
    ``RunPlan.start_step`` None means "from scratch" (write step 0 first). A resume with another ``shards`` (and every other trajectory field
    the same) reshards from the last healthy step (``trainrun.reshard``) when that step is the
    latest committed one. Cost: one listing of the manifests, and verdicts read from the newest
    step back to the first healthy one (not every step's: runs may hold thousands).
    """
    t0 = time.perf_counter()
    plan = _plan(ck, spec.trajectory(), resume=resume, run_id=run_id, from_step=from_step)
    return replace(plan, seconds=round(time.perf_counter() - t0, 4))


def _plan(ck: Checkpointer, spec: RunSpec, *, resume: bool, run_id: str, from_step: int | None) -> RunPlan:
    steps = ck.steps()
    where = f"run '{run_id}' at {ck.url}" if run_id else ck.url
    if steps and not resume:
        raise RunRefused(
            f"{where} already has committed checkpoints (steps {steps[0]}..{steps[-1]}). Continue it with "
            f"{HOW_TO_RESUME}, or start a new run with another run id.")
    if from_step is not None and from_step not in steps:
        raise RunRefused(f"{where} has no committed step {from_step} to start from (committed: "
                         f"{', '.join(map(str, steps[-8:])) or 'none'}): choose one of them")
    if not steps:
        note = "nothing to resume: starting from scratch" if resume else "new run"
        return RunPlan(start_step=None, committed=0, latest=None, note=note)
    at = steps[-1] if from_step is None else from_step
    old = stored_config(ck, at)
    if old is None:
        raise RunRefused(f"{where}: step {at} has no coordinator config; it was not written by a "
                         "training run. Choose another run id.")
    new = spec.to_dict()
    changed = [k for k in dict.fromkeys([*old, *new]) if old.get(k, "<absent>") != new.get(k, "<absent>")]
    if changed and (changed != ["shards"] or from_step is not None):
        raise RunRefused(
            f"cannot resume {where}: these settings differ from the run's and would change its trajectory: "
            f"{'; '.join(describe_changes(old, new))}. Resume with the run's settings (only rounds, shards, "
            f"checkpoint_every, keyframe_every, task_runner may change; shards only when resuming from the "
            f"last healthy step, not from a chosen one), or start a new run id.")
    committed, latest = len(steps), steps[-1]
    if from_step is not None:
        validated = (ck.verdict(from_step) or {}).get("passed") is True
        return RunPlan(from_step, committed, latest, f"starting from committed step {from_step}"
                       + ("" if validated else " (not validated: validated again as the run goes)"))
    healthy = ck.latest_step(healthy=True)
    if changed:
        if healthy != steps[-1]:
            what = f"step {healthy}" if healthy is not None else "no step"
            raise RunRefused(
                f"cannot reshard {where} from {old['shards']} to {spec.shards} shards yet: its latest committed "
                f"step {steps[-1]} is not validated ({what} is healthy). Resharding starts a new trajectory from "
                f"the latest committed step, which later steps of the old trajectory would contradict. Validate "
                f"step {steps[-1]} (`ckpt validate {ck.url} --step {steps[-1]}`), or resume once with "
                f"--shards {old['shards']}, then resume with --shards {spec.shards}.")
        return RunPlan(healthy, committed, latest, f"resuming from healthy step {healthy} with {spec.shards} shards "
                       f"instead of {old['shards']} (resharded: a new trajectory from step {healthy})",
                       reshard=Reshard(healthy, (old["shards"], spec.shards)))
    if healthy is None:
        return RunPlan(None, committed, latest, "no validated checkpoint yet: starting from scratch (committed "
                       "steps are recomputed identically)")
    return RunPlan(healthy, committed, latest, f"resuming from healthy step {healthy}")
