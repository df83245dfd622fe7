"""Start a dead run again when it came from a deployment (the watchdog flow's ``resume`` hook).

The watchdog found the coordinator of a run silent (a ``run-dead`` decision). Its beat names the
Prefect flow run and deployment it came from; those names are only trusted as far as Prefect
confirms them: the flow run must exist, belong to that deployment and have trained that run id.
Then the old flow run is marked ``Crashed`` (when it is not final already), with every task run of it
that was still running (their process is gone: nobody else would end them), and the deployment runs
again with ``resume: true`` and the same run id (``run_deployment(..., timeout=0)``, idempotent per
dead flow run). A flow run that ended otherwise (cancelled, failed) is not restarted. Parameters are
the dead run's over the deployment's, except masked storage options, which stay the deployment's.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from trainrun.watchdog.decisions import Decision, Resumed


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
        if old.deployment_id != deployment.id or previous.get("run_id") != run_id:
            logger.warning("run %s: its heartbeat names flow run %s of deployment %s, which Prefect does not confirm "
                           "(another deployment or run id): not started again", d.run, d.flow_run_id, d.deployment_id)
            return None
        if old.state is not None and old.state.is_final() and not old.state.is_crashed():
            logger.warning("run %s: its flow run %s is %s, not crashed: not started again", d.run, old.name,
                           old.state.name)
            return None
        if old.state is not None and not old.state.is_final():
            end_dead_run(client, old.id, f"the watchdog found its coordinator silent: {d.reason}", logger)
    base = dict((deployment.parameters or {}).get("params") or {})
    previous.pop("storage_options", None)  # masked in the API: keep the deployment's
    previous.pop("start_from", None)  # a branch is made once: the restart continues the run itself
    params = {**base, **previous, "resume": True, "run_id": run_id}
    new = run_deployment(name=deployment.id, parameters={"params": params}, timeout=0, as_subflow=False,
                         idempotency_key=f"ckpt-resume-{run_id}-{d.flow_run_id}")
    return Resumed(flow_run_id=str(new.id), flow_run_name=new.name,
                   reason=f"started again from deployment {deployment.name} as flow run {new.name} (resume)")


def end_dead_run(client: Any, flow_run_id: UUID, message: str, logger: Any) -> None:
    """Mark a dead flow run ``Crashed`` and so every task run of it that is not final: the process that
    would have ended them is gone, and the UI should not show them running forever."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    try:
        client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
        live = [StateType.RUNNING, StateType.PENDING, StateType.SCHEDULED, StateType.CANCELLING]
        for tr in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                        task_run_filter=TaskRunFilter(state=TaskRunFilterState(
                                            type=TaskRunFilterStateType(any_=live))), limit=200):
            client.set_task_run_state(tr.id, Crashed(message=f"its flow run died: {message}"), force=True)
    except Exception as e:  # noqa: BLE001 - the restart matters more than the UI's picture of the dead run
        logger.warning("could not mark the dead flow run %s and its task runs crashed: %s", flow_run_id, e)
