"""Start a dead run again when it came from a deployment (the watchdog flow's ``resume`` hook).

The watchdog found the coordinator of a run silent (a ``run-dead`` decision). Its beat names the
Prefect flow run and deployment it came from; those names are only trusted as far as Prefect
confirms them: the flow run must exist, belong to that deployment and have trained that run id.
Then the old flow run is marked ``Crashed`` (when it is not final already) and the deployment runs
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
    from prefect.states import Crashed

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
            try:  # the UI should not show a dead run as running
                client.set_flow_run_state(old.id, Crashed(message=f"the watchdog found its coordinator silent: "
                                                                  f"{d.reason}"), force=True)
            except Exception as e:  # noqa: BLE001
                logger.debug("could not mark %s crashed: %s", old.id, e)
    base = dict((deployment.parameters or {}).get("params") or {})
    previous.pop("storage_options", None)  # masked in the API: keep the deployment's
    params = {**base, **previous, "resume": True, "run_id": run_id}
    new = run_deployment(name=deployment.id, parameters={"params": params}, timeout=0, as_subflow=False,
                         idempotency_key=f"ckpt-resume-{run_id}-{d.flow_run_id}")
    return Resumed(flow_run_id=str(new.id), flow_run_name=new.name,
                   reason=f"started again from deployment {deployment.name} as flow run {new.name} (resume)")
