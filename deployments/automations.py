"""The Prefect automations ``make deploy`` creates: keeping one watchdog alive, and notifications.

Each is (re)created by name, so ``make deploy`` can run again without duplicates.

* ``ckpt-watchdog-keeper`` (``watchdog_keeper``): the watchdog deployment runs one long-lived flow
  run per store (``duration_s`` 0, deployment concurrency 1 with ``CANCEL_NEW``: a second run is
  cancelled at once, never queued). That run emits ``ckpt.watchdog.alive`` every 10 s and
  ``ckpt.watchdog.stopped`` when it ends (even by an error: such a watchdog is not restarted in a
  loop). When neither comes for ``within_s`` (its process was killed, its machine died), the
  keeper marks that flow run ``Crashed`` (which frees its concurrency slot) and runs the deployment
  again. This is the only automation on the watchdog's path: shards' heartbeats go to the store,
  which the running watchdog reads.
* Notifications (``notifications``): to a ``Webhook`` block (its URL may hold a token, so it is a
  block, never a parameter), one automation each for a checkpoint that failed validation
  (``ckpt.validation.failed``), a run the watchdog gave up on or could not start again
  (``ckpt.watchdog.gave-up``, ``resume-failed``, ``cannot-rerun``), and a flow run of the training
  flow that ended in any final state but Completed (``prefect.flow-run.Failed``, ``Crashed``,
  ``Cancelled``, ``TimedOut``). The body is JSON naming what happened and where, typed (a step is a
  number, failed checks a list) and with HTTP links: the report as the stack serves it, the flow
  run's page in the UI.

``ensure_watchdog`` starts the watchdog deployment when no watchdog of its store is alive (``make
deploy`` calls it; the keeper does the same later).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any
from uuid import UUID

KEEPER = "ckpt-watchdog-keeper"
KEEPER_WITHIN_S = 60.0  # 6 missed signs of life (every 10 s): a busy machine does not look like a dead one
WEBHOOK_BLOCK = "ckpt-notify"
NOTIFY_VALIDATION = "ckpt-notify-validation-failed"
NOTIFY_GAVE_UP = "ckpt-notify-watchdog-gave-up"
NOTIFY_RUN_ENDED = "ckpt-notify-run-not-completed"
RETIRED = ("ckpt-notify-run-crashed",)  # replaced by NOTIFY_RUN_ENDED: removed by make deploy
TRAIN_FLOW = "train-run"
NOT_COMPLETED = ("Failed", "Crashed", "Cancelled", "TimedOut")  # final flow-run states worth a notification


def replace_automation(automation: Any) -> str:
    """Create ``automation`` after deleting any of the same name; return its id."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(automation.name):
            client.delete_automation(old.id)
    return str(automation.create().id)


def watchdog_keeper(deployment_id: str, store: str, *, within_s: float = KEEPER_WITHIN_S) -> str:
    """Create (replace) the keeper of the watchdog of ``store`` (see the module docstring); its id."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState, RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture

    from flows.watchdog import watchdog_resource

    return replace_automation(Automation(
        name=KEEPER,
        description=f"The watchdog of {store} showed no sign of life for {within_s:.0f} s: mark its flow run crashed "
                    "and start the watchdog deployment again (deployments/automations.py).",
        trigger=EventTrigger(
            match={"prefect.resource.id": watchdog_resource(store)},
            after={"ckpt.watchdog.alive"}, expect={"ckpt.watchdog.alive", "ckpt.watchdog.stopped"},
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
            within=timedelta(seconds=within_s)),
        actions=[
            # the flow run the last sign of life came from (its related resource): a zombie "Running" otherwise
            ChangeFlowRunState(source="inferred", state=StateType.CRASHED,
                               message=f"no sign of life from this watchdog for {within_s:.0f} s"),
            RunDeployment(source="selected", deployment_id=UUID(deployment_id), parameters={}),
        ],
    ))


def ensure_watchdog(api: Any, deployment: dict[str, Any], *, alive_within_s: float = KEEPER_WITHIN_S) -> str | None:
    """Start a run of the watchdog ``deployment`` unless one is alive: running with a sign of life
    in the last ``alive_within_s`` seconds (or started since), or about to start. A run that claims
    to be running without a sign of life (its process died with the stack) is marked crashed first,
    which frees the deployment's concurrency slot. ``api``: a ``deployments.client.PrefectAPI``.
    Returns the new flow run's id, or None when one is alive."""
    since = time.time() - alive_within_s
    runs = api.flow_runs(deployment["id"])
    if any(r["state_type"] in ("SCHEDULED", "PENDING") for r in runs):
        return None
    alive = api.alive_flow_runs("ckpt.watchdog.alive", since)
    running = [r for r in runs if r["state_type"] in ("RUNNING", "CANCELLING")]
    for r in running:
        started = _timestamp(r.get("start_time"))
        if r["id"] in alive or (started is not None and started >= since):
            return None
    for r in running:
        api.set_state(r["id"], "CRASHED", f"no sign of life from this watchdog for {alive_within_s:.0f} s")
    return api.run_deployment(deployment, {}, name=None)["id"]


def _timestamp(iso: str | None) -> float | None:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def webhook_block(url: str) -> str:
    """Save (overwrite) the ``Webhook`` block ``ckpt-notify`` posting JSON to ``url``; return its id."""
    from prefect.blocks.webhook import Webhook

    return str(Webhook(method="POST", url=url).save(WEBHOOK_BLOCK, overwrite=True))


_BODY = ('{"ckpt": "%s", "event": "{{ event.event }}", "resource": "{{ event.resource.id }}", '
         '"occurred": "{{ event.occurred }}", "what": %s}')


def notifications(webhook_url: str, ui_url: str | None = None) -> dict[str, str]:
    """Create (replace) the three notification automations to the webhook at ``webhook_url``;
    ``{name: id}``. ``ui_url``: the Prefect UI, for links to flow runs (none: ``url`` is null)."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.events.actions import CallWebhook
    from prefect.events.schemas.automations import EventTrigger, Posture

    block = UUID(webhook_block(webhook_url))
    with get_client(sync_client=True) as client:
        for name in RETIRED:
            for old in client.read_automations_by_name(name):
                client.delete_automation(old.id)
    run_link = (f'"{ui_url.rstrip("/")}/runs/flow-run/{{{{ event.resource.id | replace(\'prefect.flow-run.\', \'\') }}}}"'
                if ui_url else "null")

    def reactive(name: str, description: str, events: set[str], match: dict[str, Any], what: str,
                 match_related: dict[str, Any] | None = None) -> Automation:
        return Automation(
            name=name, description=description,
            trigger=EventTrigger(expect=events, match=match, match_related=match_related or {},
                                 posture=Posture.Reactive, threshold=1, within=timedelta(0)),
            actions=[CallWebhook(block_document_id=block, payload=_BODY % (name, what))])

    automations = [
        reactive(NOTIFY_VALIDATION, "A checkpoint failed its validation: it is not healthy.",
                 {"ckpt.validation.failed"}, {"prefect.resource.id": "ckpt.run.*"},
                 '{"run": {{ event.resource.get(\'ckpt.run-url\', \'\') | tojson }}, '
                 '"step": {{ event.payload.step | tojson }}, "failed": {{ event.payload.failed | tojson }}, '
                 '"report": {{ (event.payload.report_http or event.payload.report_url) | tojson }}, '
                 '"report_url": {{ event.payload.report_url | tojson }}}'),
        reactive(NOTIFY_GAVE_UP, "The watchdog gave up on a shard or a run (reruns kept dying, a dead run could "
                 "not be started again, or a rerun it may not run).",
                 {"ckpt.watchdog.gave-up", "ckpt.watchdog.resume-failed", "ckpt.watchdog.cannot-rerun"},
                 {"prefect.resource.id": ["ckpt.shard.*", "ckpt.run.*"]},
                 '{"run": "{{ event.payload.run }}", "part": "{{ event.payload.part }}", '
                 '"reason": {{ event.payload.reason | tojson }}}'),
        reactive(NOTIFY_RUN_ENDED, "A training run ended but did not complete: failed (e.g. a checkpoint failed "
                 "validation), crashed (its process or infrastructure died), cancelled or timed out.",
                 {f"prefect.flow-run.{state}" for state in NOT_COMPLETED}, {"prefect.resource.id": "prefect.flow-run.*"},
                 '{"flow_run": {{ event.resource.name | tojson }}, '
                 '"state": {{ event.event | replace(\'prefect.flow-run.\', \'\') | tojson }}, '
                 '"message": {{ event.payload.get(\'validated_state\', {}).get(\'message\', \'\') | tojson }}, '
                 '"url": ' + run_link + '}',
                 match_related={"prefect.resource.role": "flow", "prefect.resource.name": TRAIN_FLOW}),
    ]
    return {a.name: replace_automation(a) for a in automations}
