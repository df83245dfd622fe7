"""Start a dead run again when it came from a deployment (the watchdog flow's ``resume`` hook).

The watchdog found the coordinator of a run silent (a ``run-dead`` decision). Its beat names the
Prefect flow run and deployment it came from; those names are only trusted as far as Prefect
confirms them: the flow run must exist, belong to that deployment and have trained that run id
(its ``run_id`` parameter, or its name ``train-<run id>`` when the id was generated), **in the
watchdog's own store**: the run the flow run's parameters (over the deployment's) point at must be
the very run the watchdog found dead. A beat naming a flow run of another store (anyone who can
write this store can write a beat) is refused (``ResumeRefused``: a ``resume-failed`` decision, so
it is seen and notified), and nothing is started.
Then the old flow run is marked ``Crashed`` (when it is not final already: its worker may have seen the
process exit first), with every task run of it that was still running (their process is gone: nobody
else would end them, not even that worker), and the deployment runs
again with ``resume: true`` and the same run id (``run_deployment(..., timeout=0)``, idempotent per
dead flow run). A flow run that ended otherwise (cancelled, failed) is not restarted. Parameters are
the dead run's over the deployment's, except masked storage options, which stay the deployment's.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from uuid import UUID

from ckptlib.errors import CheckpointError
from trainrun.layout import run_url, store_url
from trainrun.watchdog.decisions import Decision, Resumed


class ResumeRefused(CheckpointError, ValueError):
    """The dead run's beat names a flow run that trained another run (another store): not started."""


def same_place(a: str, b: str) -> bool:
    """Whether two run URLs name the same run (``file://`` or a plain path; trailing slashes)."""

    def norm(u: str) -> str:
        return store_url(u[len("file://"):] if u.startswith("file://") else u).rstrip("/")

    return norm(a) == norm(b)


def resume_from_deployment(d: Decision, logger: Any) -> Resumed | None:
    """Start the deployment the dead run came from again (see the module docstring); None when the
    run did not come from a deployment (``ckpt train``: resume it by hand) or may not be restarted."""
    if not d.deployment_id or not d.flow_run_id:
        logger.warning("run %s is dead and did not come from a deployment: continue it with "
                       "`ckpt train --resume --run-id %s --store <its store>`", d.run, d.run_id or d.run)
        return None
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    run_id = d.run_id or d.run
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(UUID(d.deployment_id))
        old = client.read_flow_run(UUID(d.flow_run_id))
        previous = dict((old.parameters or {}).get("params") or {})
        base = dict((deployment.parameters or {}).get("params") or {})
        trained = previous.get("run_id") or (old.name[len("train-"):] if old.name.startswith("train-") else None)
        if old.deployment_id != deployment.id or trained != run_id:
            logger.warning("run %s: its heartbeat names flow run %s of deployment %s, which Prefect does not confirm "
                           "(another deployment or run id): not started again", d.run, d.flow_run_id, d.deployment_id)
            return None
        store = previous.get("store") or base.get("store")
        if not store or not same_place(run_url(store, run_id), d.run_url):
            raise ResumeRefused(
                f"the heartbeat of {d.run_url} names flow run {old.name} ({d.flow_run_id}), which trained run "
                f"{run_id} of store {store!r}, not the run this watchdog found dead: not started again (a watchdog "
                "resumes only runs of its own store). Resume the run by hand if it is yours.")
        if old.state is not None and old.state.is_final() and not old.state.is_crashed():
            logger.warning("run %s: its flow run %s is %s, not crashed: not started again", d.run, old.name,
                           old.state.name)
            return None
        # Crashed already when its worker saw the process exit: its task runs still need ending
        end_dead_run(client, old.id, f"the watchdog found its coordinator silent: {d.reason}", logger,
                     mark_flow_run=old.state is None or not old.state.is_final())
    previous.pop("storage_options", None)  # masked in the API: keep the deployment's
    previous.pop("start_from", None)  # a branch is made once: the restart continues the run itself
    params = {**base, **previous, "resume": True, "run_id": run_id}
    new = run_deployment(name=deployment.id, parameters={"params": params}, timeout=0, as_subflow=False,
                         idempotency_key=f"ckpt-resume-{run_id}-{d.flow_run_id}",
                         tags=["ckpt", "resumed", f"resumes:{d.flow_run_id[:8]}"])
    return Resumed(flow_run_id=str(new.id), flow_run_name=new.name,
                   reason=f"started again from deployment {deployment.name} as flow run {new.name} (resume)")


# Task-run states reach Prefect's database as events, through its task-run recorder (batches,
# flushed every 5 s by default): a state the dead process sent just before it died can be recorded
# after the first sweep below, as a task run that is Running again or new. Later sweeps end those.
RESWEEP_AFTER_S = (15.0, 45.0)


def end_dead_run(client: Any, flow_run_id: UUID, message: str, logger: Any, mark_flow_run: bool = True) -> None:
    """Mark a dead flow run ``Crashed`` (unless ``mark_flow_run`` is false: its worker did) and so every
    task run of it that is not final: the process that would have ended them is gone, and the UI should
    not show them running forever. The task runs are swept again later (``RESWEEP_AFTER_S``, in the
    background), for states recorded late."""
    try:
        from prefect.states import Crashed

        if mark_flow_run:
            client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
        _crash_live_task_runs(client, flow_run_id, message)
    except Exception as e:  # noqa: BLE001 - the restart matters more than the UI's picture of the dead run
        logger.warning("could not mark the dead flow run %s and its task runs crashed: %s", flow_run_id, e)
    threading.Thread(target=_sweep_later, args=(flow_run_id, message, logger), daemon=True,
                     name=f"ckpt-sweep-{flow_run_id}").start()


def _sweep_later(flow_run_id: UUID, message: str, logger: Any) -> None:
    from prefect.client.orchestration import get_client

    waited = 0.0
    for at in RESWEEP_AFTER_S:
        time.sleep(at - waited)
        waited = at
        try:
            with get_client(sync_client=True) as client:
                n = _crash_live_task_runs(client, flow_run_id, message)
            if n:
                logger.info("marked %d task runs of the dead flow run %s crashed (their states arrived late)", n,
                            flow_run_id)
        except Exception as e:  # noqa: BLE001 - best effort, as above
            logger.warning("could not sweep the task runs of the dead flow run %s: %s", flow_run_id, e)


def _crash_live_task_runs(client: Any, flow_run_id: UUID, message: str) -> int:
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    live = [StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED, StateType.CANCELLING]
    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                 task_run_filter=TaskRunFilter(state=TaskRunFilterState(
                                     type=TaskRunFilterStateType(any_=live))), limit=200)
    for tr in runs:
        client.set_task_run_state(tr.id, Crashed(message=f"its flow run died: {message}"), force=True)
    return len(runs)
