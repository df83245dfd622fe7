"""Where a run starts: the resume rules (``docs/training.md``, *Resume rules*), without Prefect or torch.

(Where one shard attempt continues *within* its round, from a shard checkpoint, is
``trainrun.resume_point``'s.)

``where_to_start`` reads the run's committed steps, its verdicts and the configuration stored in a
checkpoint, and either says where the run starts, and with which trajectory, or refuses
(``RunRefused``) with the fix. The CLI asks before Prefect starts (fast refusals); the flow's
``plan-run`` task asks again (deployments).

A resume takes its trajectory from the run itself (``stored_config`` of the step it starts from):
the fields the caller *gave* (``given``) are checked against it and a changed one is refused by
name; the others are the run's. ``ckpt train`` knows which options were typed; a flow run knows
only what differs from the schema's defaults (``given_fields``): a form shows every field filled in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

from ckptlib import Checkpointer
from ckptlib.errors import CheckpointError
from ckptlib.quarantine import quarantine_step
from ckptlib.tree import unflatten

from .errors import RunRefused
from .layout import COORDINATOR
from .results import Reshard, RunPlan
from .spec import FIELD_DEFAULTS_LEFT_OUT, RunSpec, describe_changes

# How to resume, said to both kinds of users: the CLI's and the form's (deployments, the UI).
# the trajectory fields a resume may change (from the last healthy step): a new trajectory from there
RESIZES = ("shards", "ranks_per_shard", "parallelism")
HOW_TO_RESUME = "resume (`ckpt train --resume`, or resume: true in the form), with the same run id and store"

# validate(step) -> passed: validates a committed step that has no verdict yet (plan-run passes one)
Validator = Callable[[int], bool]


def stored_config(ck: Checkpointer, step: int) -> dict[str, Any] | None:
    """The ``config`` of the coordinator part of committed ``step`` (its fragment; no chunk read)."""
    if COORDINATOR not in ck.manifest(step).parts:
        return None
    skeleton = getattr(ck.fragment(step, COORDINATOR), "skeleton", None)  # None: a group's part (docs/distributed.md)
    if not isinstance(skeleton, dict) or "config" not in skeleton:
        return None
    config = unflatten(skeleton["config"], [])
    return config if isinstance(config, dict) else None


def given_fields(spec: RunSpec, fields_set: Collection[str]) -> set[str]:
    """The trajectory fields a flow run was given: set explicitly and unlike the schema's default
    (a form sends every field; a value equal to its default cannot be told from one left alone)."""
    default = RunSpec().to_dict()
    mine = spec.to_dict()
    return {k for k in mine if k in fields_set and mine[k] != default.get(k)}  # (ranks_per_shard: only when > 1)


def where_to_start(ck: Checkpointer, spec: RunSpec, *, resume: bool, run_id: str = "",
                   from_step: int | None = None, given: Collection[str] | None = None,
                   validate: Validator | None = None) -> RunPlan:
    """Where a run starts, and its trajectory (``RunPlan.config``). Raises RunRefused when it must
    not start (see the resume rules).

    ``given``: the fields of ``spec`` the caller chose (None: all of them); on a resume the others
    come from the run's stored config. ``from_step`` (with ``resume``): start from this committed
    step rather than the last healthy one (the form's ``start_from``; it need not be validated: it
    is validated again as the run goes). ``validate``: committed steps newer than the last healthy
    one that have no verdict yet are validated first, newest first, and the run resumes from the
    first that passes (a kill then loses at most the round in flight, not every step whose
    validation had not finished). ``RunPlan.start_step`` None means "from scratch" (write step 0
    first). A resume with another ``shards`` (and every other trajectory field the same) reshards
    from the last healthy step (``trainrun.reshard``) when that step is the latest committed one.
    Cost: one listing of the manifests, and verdicts read from the newest step back to the first
    healthy one (not every step's: runs may hold thousands).
    """
    t0 = time.perf_counter()
    plan = _plan(ck, spec.trajectory(), resume=resume, run_id=run_id, from_step=from_step,
                 given=set(RunSpec.model_fields) if given is None else set(given), validate=validate)
    return replace(plan, seconds=round(time.perf_counter() - t0, 4))


def _plan(ck: Checkpointer, spec: RunSpec, *, resume: bool, run_id: str, from_step: int | None,
          given: set[str], validate: Validator | None) -> RunPlan:
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
        return RunPlan(start_step=None, committed=0, latest=None, note=note, config=spec.to_dict())
    at = steps[-1] if from_step is None else from_step
    old = stored_config(ck, at)
    if old is None:
        raise RunRefused(f"{where}: step {at} has no coordinator config; it was not written by a "
                         "training run. Choose another run id.")
    spec, changed = _resolved(spec, old, given, where, reshard_ok=from_step is None)
    committed, latest, config = len(steps), steps[-1], spec.to_dict()
    if from_step is not None:
        validated = (ck.verdict(from_step) or {}).get("passed") is True
        return RunPlan(from_step, committed, latest, f"starting from committed step {from_step}"
                       + ("" if validated else " (not validated: validated again as the run goes)"), config=config)
    healthy, checked = _healthy_after_validating(ck, steps, validate)
    healthy, damaged = _restorable(ck, healthy)
    if damaged:  # quarantined: no longer committed
        steps = ck.steps()
        if not steps:
            return RunPlan(None, 0, None, f"starting from scratch: {_damaged_note(damaged)}", config=config)
        committed, latest = len(steps), steps[-1]
    old_ranks = old.get("ranks_per_shard", 1)
    old_par = old.get("parallelism", "ddp")
    same_par = old_par == spec.parallelism
    old_group = str(old_ranks) if same_par else f"{old_ranks} ({old_par})"
    new_group = f"{spec.ranks_per_shard} ranks per shard" + ("" if same_par else f" ({spec.parallelism})")
    if changed:
        if healthy != steps[-1]:
            what = f"step {healthy}" if healthy is not None else "no step"
            resize = (f"from {old['shards']} to {spec.shards} shards" if "shards" in changed else
                      f"from {old_group} to {new_group}")  # "from 2 to 1 ranks per shard"
            raise RunRefused(
                f"cannot reshard {where} {resize} yet: its latest committed "
                f"step {steps[-1]} is not validated ({what} is healthy). Resharding starts a new trajectory from "
                f"the latest committed step, which later steps of the old trajectory would contradict. Validate "
                f"step {steps[-1]} (`ckpt validate {ck.url} --step {steps[-1]}`), or resume once with "
                f"{'--shards ' + str(old['shards']) if 'shards' in changed else _old_group_options(old)}"
                f", then resume with the new value.")
        if "shards" not in changed:
            return RunPlan(healthy, committed, latest, f"resuming from healthy step {healthy} with "
                           f"{new_group} instead of {old_group} (a new "
                           f"trajectory from step {healthy}: the gradients' reduction order changes)", config=config)
        return RunPlan(healthy, committed, latest, f"resuming from healthy step {healthy} with {spec.shards} shards "
                       f"instead of {old['shards']} (resharded: a new trajectory from step {healthy})",
                       reshard=Reshard(healthy, (old["shards"], spec.shards)), config=config)
    note = _pending_note(ck, steps, healthy, checked, validate) + (f"; {_damaged_note(damaged)}" if damaged else "")
    if healthy is None:
        return RunPlan(None, committed, latest, "no validated checkpoint yet: starting from scratch (committed "
                       f"steps are recomputed identically){note}", config=config)
    return RunPlan(healthy, committed, latest, f"resuming from healthy step {healthy}{note}", config=config)


def _resolved(spec: RunSpec, old: dict[str, Any], given: set[str], where: str, *,
              reshard_ok: bool) -> tuple[RunSpec, list[str]]:
    """The run's trajectory with the ``given`` fields of ``spec`` (RunRefused naming each that
    changed, but ``shards`` and ``ranks_per_shard`` where a resize may follow); and which of those changed."""
    mine = spec.to_dict()
    old = {**FIELD_DEFAULTS_LEFT_OUT, **old}  # a config without the fields: one process per shard, ddp
    merged = {**FIELD_DEFAULTS_LEFT_OUT, **mine, **{k: v for k, v in old.items() if k not in given}}
    changed = [k for k in dict.fromkeys([*old, *merged]) if old.get(k, "<absent>") != merged.get(k, "<absent>")]
    if changed and (not set(changed) <= set(RESIZES) or not reshard_ok):
        raise RunRefused(
            f"cannot resume {where}: these settings differ from the run's and would change its trajectory: "
            f"{'; '.join(describe_changes(old, merged))}. Resume without them (a resume takes the run's own "
            f"settings) or with the run's values (only rounds, shards, ranks_per_shard, parallelism, checkpoint_every, "
            f"keyframe_every, task_runner may change; shards, ranks_per_shard and parallelism only when resuming from the last "
            f"healthy step, not from a chosen one), or start a new run id.")
    try:
        resolved = RunSpec.from_dict({k: merged[k] for k in RunSpec.model_fields if k in merged})
    except ValueError as e:
        raise RunRefused(f"{where}: the run's stored config does not parse ({e}): choose another run id") from None
    return resolved, changed


def _old_group_options(old: dict[str, Any]) -> str:
    """The options that give a run its stored group shape back."""
    return f"--ranks-per-shard {old.get('ranks_per_shard', 1)} --parallelism {old.get('parallelism', 'ddp')}"


def _healthy_after_validating(ck: Checkpointer, steps: list[int], validate: Validator | None) -> tuple[int | None, list[int]]:
    """The last healthy step, after validating (``validate``) the committed steps newer than it that
    have no verdict yet, newest first, until one passes; and the steps validated so."""
    healthy = ck.latest_step(healthy=True)
    if validate is None:
        return healthy, []
    checked = []
    for step in reversed([s for s in steps if healthy is None or s > healthy]):
        if ck.verdict(step) is not None:
            continue  # validated already (and failed): not healthy
        checked.append(step)
        if validate(step):
            return step, checked
    return healthy, checked


def _restorable(ck: Checkpointer, healthy: int | None) -> tuple[int | None, dict[int, str]]:
    """The newest healthy step from ``healthy`` back whose every object decodes to its checksum
    (``Checkpointer.verify``: one read of the step, what the shards would read), and the steps found
    damaged on the way, each quarantined with the first problem as its reason (the quarantine's log
    line names it: one line a step; a resume falls back past them instead of failing in every shard)."""
    damaged: dict[int, str] = {}
    while healthy is not None:
        problems = ck.verify(healthy)  # also records them: saves distrust its damaged objects
        if not problems:
            break
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        # the quarantine's own log line names the step and this reason: the one line a user reads
        reason = f"a resume found it damaged: {problems[0]}{more}; the run resumes from the healthy step before it"
        try:
            quarantine_step(ck.store, healthy, reason[:1000])
        except CheckpointError as e:
            raise RunRefused(f"{ck.url}: step {healthy} is damaged ({problems[0]}) and could not be quarantined "
                             f"({e}); fix the store's permissions, or `ckpt quarantine {ck.url} --step {healthy}`, then "
                             "resume again") from None
        damaged[healthy] = str(problems[0])
        healthy = ck.latest_step(healthy=True)
    return healthy, damaged


def _damaged_note(damaged: dict[int, str]) -> str:
    return "; ".join(f"step {s} was damaged ({why}) and is quarantined" for s, why in damaged.items())


def _pending_note(ck: Checkpointer, steps: list[int], healthy: int | None, checked: list[int],
                  validate: Validator | None) -> str:
    """What the plan did about steps newer than the healthy one that had no verdict (or would do)."""
    if checked:
        passed = [s for s in checked if s == healthy]
        return (f" (validated now: step{'s' if len(checked) > 1 else ''} {', '.join(map(str, checked))}"
                + (f"; step {passed[0]} passed" if passed else ": none passed") + ")")
    if validate is not None:
        return ""
    pending = [s for s in steps if (healthy is None or s > healthy) and ck.verdict(s) is None]
    if not pending:
        return ""
    return (f" for now: committed step{'s' if len(pending) > 1 else ''} {', '.join(map(str, pending[-4:]))} "
            "not validated yet; the run validates them first and resumes from the newest that passes")
