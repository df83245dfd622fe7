"""The Prefect API as scripts and tests drive the stack from outside, through Prefect's own client.

    api = PrefectAPI("http://127.0.0.1:4200/api", auth="user:password")
    run = api.run_deployment("train-run/train", {"params": {"rounds": 2}}, name="try-1")
    run = api.wait(run["id"], timeout=600)          # a terminal state, or TimeoutError
    api.artifacts(run["id"])                        # [{key, type, data, ...}]
    api.client.read_work_pool("local-pool")         # anything else: Prefect's SyncPrefectClient

or from a shell (``PREFECT_API_URL`` as exported by ``. .stack/env``)::

    python -m deployments.client run train-run/train --set params.rounds=2 --set params.shards=1 --wait

Contract: what it talks to is the URL it is given, with the credentials it is given (``auth``,
``user:password``: a server started with ``PREFECT_SERVER_API_AUTH_STRING``, as the stack's is,
refuses every call without them), whatever the caller's Prefect profile says; ``auth`` defaults to
``PREFECT_API_AUTH_STRING``. Calls go through ``SyncPrefectClient`` (which retries 408/429/502/503 with
backoff, ``PREFECT_CLIENT_MAX_RETRIES`` times); ``wait`` is ``prefect.flow_runs.wait_for_flow_run``
(it follows the run's events, no polling) and ``emit_event`` Prefect's events client, both under
``temporary_settings`` naming this URL and credentials. Methods return Prefect's objects as JSON
dicts (``model_dump(mode="json")``: the API's own shapes). A refusal is one ``RuntimeError`` naming
the call and the status (for 401, which credentials to set). The credentials are in no message,
repr or traceback: they live only in the client's request headers, and a refusal is raised outside
the handler of Prefect's error (whose request carries them), so it keeps no reference to it.

What is the project's own, because no client does it:

* ``run_deployment`` merges. The server merges a run's parameters into the deployment's at the top
  level only, so ``prefect deployment run train-run/train --param params='{"rounds": 2}'`` would
  replace the whole ``params`` object and silently fall back to the flow's own defaults (a local
  ``./runs`` store instead of the stack's bucket). ``run_deployment`` deep-merges the given values
  into the deployment's parameters first (``merge=False`` sends them as they are).
* ``alive_flow_runs``: which flow runs emitted an event since a time (the watchdog keeper's sign of life).
* ``--set NAME=VALUE`` of the command line, dotted into nested parameters.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar
from uuid import UUID

import httpx
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from prefect.utilities.asyncutils import run_coro_as_sync

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
T = TypeVar("T")


class PrefectAPI:
    """Prefect's client on ``api_url`` with ``auth``; ``client`` is that ``SyncPrefectClient``."""

    def __init__(self, api_url: str, timeout: float = 30.0, auth: str | None = None):
        self.api_url = api_url.rstrip("/")
        auth = auth if auth is not None else os.environ.get("PREFECT_API_AUTH_STRING")
        self._settings = {PREFECT_API_URL: self.api_url, PREFECT_API_AUTH_STRING: auth or None}
        self.client = SyncPrefectClient(self.api_url, auth_string=auth or None, httpx_settings={"timeout": timeout})
        self.client.__enter__()

    def __repr__(self) -> str:  # never the credentials
        return f"PrefectAPI({self.api_url!r})"

    def _do(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``; an HTTP refusal becomes one RuntimeError naming the call and the fix."""
        try:
            return call(*args, **kwargs)
        except ObjectNotFound as e:
            if not isinstance(e.http_exc, httpx.HTTPStatusError):
                raise
            refused: httpx.HTTPStatusError = e.http_exc
        except httpx.HTTPStatusError as e:
            refused = e
        # Raised here, outside the handler: Prefect's error holds its request, and the request our credentials.
        raise RuntimeError(self._refusal(refused))

    def _refusal(self, e: httpx.HTTPStatusError) -> str:
        status, call = e.response.status_code, f"{e.request.method} {e.request.url}"
        if status == 401:
            return (f"{call} -> 401: the Prefect API refused " + ("these credentials" if self._settings[
                    PREFECT_API_AUTH_STRING] else "a call without credentials") + ": set PREFECT_API_AUTH_STRING "
                    "to the server's user:password (`set -a; . .stack/env; set +a` does for the local stack) or "
                    "pass auth=")
        retries = PREFECT_CLIENT_MAX_RETRIES.value()
        tried = f" (after {retries} retries)" if status in (408, 429, 502, 503) and retries else ""
        return f"{call} -> {status}{tried}: {e.response.text[:500]}"

    def _run_async(self, make: Callable[[], Any]) -> Any:
        """Run the coroutine ``make()`` under settings naming this API and its credentials (Prefect's event
        subscriber and events client read them from the settings only)."""
        async def under_settings() -> Any:
            with temporary_settings(self._settings):
                return await make()

        return run_coro_as_sync(under_settings())

    def healthy(self) -> bool:
        """Whether the API answers its health probe now (one try: no retries)."""
        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}):
            return self.client.api_healthcheck() is None

    def deployment(self, name: str) -> dict[str, Any]:
        """``name`` is ``<flow name>/<deployment name>``, e.g. ``train-run/train``, or a deployment's id."""
        if "/" in name:
            return self._do(self.client.read_deployment_by_name, name).model_dump(mode="json")
        return self._do(self.client.read_deployment, UUID(name)).model_dump(mode="json")

    def deployments(self) -> list[dict[str, Any]]:
        return [d.model_dump(mode="json") for d in self._do(self.client.read_deployments, limit=200)]

    def run_deployment(self, deployment: dict[str, Any] | str, parameters: dict[str, Any] | None = None,
                       name: str | None = None, tags: list[str] | None = None, merge: bool = True) -> dict[str, Any]:
        """Create a flow run of ``deployment`` (a dict or ``flow/deployment`` name); a worker runs it.

        ``parameters`` are deep-merged into the deployment's (see the module docstring) unless
        ``merge`` is False."""
        dep = self.deployment(deployment) if isinstance(deployment, str) else deployment
        params = deep_merge(dep.get("parameters") or {}, parameters or {}) if merge else (parameters or {})
        run = self._do(self.client.create_flow_run_from_deployment, UUID(dep["id"]), parameters=params,
                       name=name, tags=tags)
        return run.model_dump(mode="json")

    def flow_run(self, run_id: str) -> dict[str, Any]:
        return self._do(self.client.read_flow_run, UUID(run_id)).model_dump(mode="json")

    def wait(self, run_id: str, timeout: float = 600.0) -> dict[str, Any]:
        """The flow run once it is in a terminal state (following its events); TimeoutError names its state."""
        from prefect.exceptions import FlowRunWaitTimeout
        from prefect.flow_runs import wait_for_flow_run

        async def waited() -> Any:
            async with get_client() as client:
                return await wait_for_flow_run(UUID(run_id), timeout=math.ceil(timeout), client=client)

        try:
            return self._run_async(waited).model_dump(mode="json")
        except FlowRunWaitTimeout:
            pass  # said below, with the run's state, outside the handler
        run = self.flow_run(run_id)
        raise TimeoutError(f"flow run {run_id} still {run['state_type']} ({run['state_name']}) after {timeout:.0f} s: "
                           "is a worker polling its work pool?")

    def flow_runs(self, deployment_id: str) -> list[dict[str, Any]]:
        """Flow runs of one deployment, newest first."""
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
        from prefect.client.schemas.sorting import FlowRunSort

        runs = self._do(self.client.read_flow_runs, limit=200, sort=FlowRunSort.EXPECTED_START_TIME_DESC,
                        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[UUID(deployment_id)])))
        return [r.model_dump(mode="json") for r in runs]

    def emit_event(self, event: str, resource: dict[str, str], payload: dict[str, Any] | None = None) -> None:
        """Send one event through Prefect's events client (as ``prefect.events.emit_event`` does inside a run)."""
        from prefect.events import Event
        from prefect.events.clients import get_events_client

        async def emitted() -> None:
            async with get_events_client() as events:
                await events.emit(Event(event=event, resource=resource, payload=payload or {}))

        self._run_async(emitted)

    def events(self, names: list[str], since: float, limit: int = 200) -> list[dict[str, Any]]:
        """Events named ``names`` that occurred since ``since`` (wall time), newest first."""
        from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter

        start = datetime.datetime.fromtimestamp(since, datetime.UTC)
        page = self._do(self.client.read_events, limit=min(limit, 50),
                        filter=EventFilter(event=EventNameFilter(name=names), occurred=EventOccurredFilter(since=start)))
        out = list(page.events)
        while page.next_page and len(out) < limit:
            page = self._do(self.client.read_events_page, str(page.next_page))
            out += page.events
        return [e.model_dump(mode="json") for e in out]

    def alive_flow_runs(self, event: str, since: float) -> set[str]:
        """Ids of the flow runs that emitted ``event`` since ``since`` (its related flow-run resource)."""
        out = set()
        for e in self.events([event], since):
            for r in e.get("related") or []:
                rid = r.get("prefect.resource.id", "")
                if rid.startswith("prefect.flow-run."):
                    out.add(rid[len("prefect.flow-run."):])
        return out

    def set_state(self, flow_run_id: str, state_type: str, message: str, name: str | None = None) -> None:
        """Force a flow run into a state (e.g. CRASHED for one whose process is gone)."""
        from prefect.client.schemas.objects import State, StateType

        state: State[Any] = State(type=StateType(state_type), message=message, name=name)
        self._do(self.client.set_flow_run_state, UUID(flow_run_id), state, force=True)

    def artifacts(self, flow_run_id: str) -> list[dict[str, Any]]:
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        found = self._do(self.client.read_artifacts, limit=200,
                         artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)])))
        return [a.model_dump(mode="json") for a in found]

    def task_runs(self, flow_run_id: str) -> list[dict[str, Any]]:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        found = self._do(self.client.read_task_runs, limit=200,
                         flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)])))
        return [t.model_dump(mode="json") for t in found]

    def close(self) -> None:
        self.client.__exit__(None, None, None)

    def __enter__(self) -> PrefectAPI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` applied; nested dicts are merged key by key, anything else replaced."""
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _parse_sets(items: list[str]) -> dict[str, Any]:
    """``["params.rounds=2", "dry_run=true"]`` -> ``{"params": {"rounds": 2}, "dry_run": True}`` (values as JSON
    when they parse, else strings)."""
    import json

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"error: --set {item!r}: write NAME=VALUE, e.g. params.rounds=2")
        path, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m deployments.client",
                                 description="Start a deployment's run with some parameters changed.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a deployment (its parameters, deep-merged with --set values)")
    run.add_argument("deployment", help="flow/deployment, e.g. train-run/train")
    run.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=VALUE",
                     help="a parameter, dotted into objects: params.rounds=2 (repeatable; values are JSON)")
    run.add_argument("--name", default=None, help="the flow run's name")
    run.add_argument("--wait", action="store_true", help="wait until the run ends; exit 1 unless it completed")
    run.add_argument("--timeout", type=float, default=3600)
    run.add_argument("--api-url", default=os.environ.get("PREFECT_API_URL"),
                     help="default: PREFECT_API_URL (`. .stack/env` sets it)")
    a = ap.parse_args(argv)
    if not a.api_url:
        raise SystemExit("error: no Prefect API: export PREFECT_API_URL (`. .stack/env`) or pass --api-url")
    with PrefectAPI(a.api_url) as api:
        try:
            fr = api.run_deployment(a.deployment, _parse_sets(a.sets), name=a.name)
        except RuntimeError as e:  # the API's refusal, said once (401: which credentials to set)
            raise SystemExit(f"error: {e}") from None
        ui = os.environ.get("PREFECT_UI_URL") or a.api_url.rsplit("/api", 1)[0]
        print(f"flow run {fr['name']} ({fr['id']}) scheduled: {ui}/runs/flow-run/{fr['id']}", flush=True)
        if not a.wait:
            return 0
        fr = api.wait(fr["id"], timeout=a.timeout)
        message = fr["state"].get("message")
        print(f"{fr['name']}: {fr['state_name']}" + (f" ({message})" if message else ""))
        return 0 if fr["state_type"] == "COMPLETED" else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
