"""A few calls of the Prefect REST API, for scripts and tests that drive the stack from outside.

    api = PrefectAPI("http://127.0.0.1:4200/api")
    dep = api.deployment("train-run/train")
    run = api.run_deployment(dep, {"params": {**dep["parameters"]["params"], "rounds": 2}}, name="try-1")
    run = api.wait(run["id"], timeout=600)          # a terminal state, or TimeoutError
    api.artifacts(run["id"])                        # [{key, type, data, ...}]

Plain HTTP (``httpx``, a Prefect dependency), so a caller needs no Prefect settings or profile:
what it talks to is the URL it passes. Note: the server merges a run's parameters into the
deployment's at the top level only; pass whole objects (as above), not a partial ``params``.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class PrefectAPI:
    def __init__(self, api_url: str, timeout: float = 30.0):
        self.api_url = api_url.rstrip("/")
        self._http = httpx.Client(base_url=self.api_url, timeout=timeout)

    def _call(self, method: str, path: str, json: Any = None) -> Any:
        r = self._http.request(method, path, json=json)
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {self.api_url}{path} -> {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def healthy(self) -> bool:
        try:
            return self._call("GET", "/health") is True
        except (httpx.HTTPError, RuntimeError):
            return False

    def deployment(self, name: str) -> dict[str, Any]:
        """``name`` is ``<flow name>/<deployment name>``, e.g. ``train-run/train``."""
        flow, dep = name.split("/", 1)
        return self._call("GET", f"/deployments/name/{flow}/{dep}")

    def deployments(self) -> list[dict[str, Any]]:
        return self._call("POST", "/deployments/filter", {"limit": 200})

    def run_deployment(self, deployment: dict[str, Any] | str, parameters: dict[str, Any] | None = None,
                       name: str | None = None, tags: list[str] | None = None) -> dict[str, Any]:
        """Create a flow run of ``deployment`` (a dict or ``flow/deployment`` name); a worker runs it."""
        dep = self.deployment(deployment) if isinstance(deployment, str) else deployment
        body: dict[str, Any] = {"parameters": parameters or {}}
        if name:
            body["name"] = name
        if tags:
            body["tags"] = tags
        return self._call("POST", f"/deployments/{dep['id']}/create_flow_run", body)

    def flow_run(self, run_id: str) -> dict[str, Any]:
        return self._call("GET", f"/flow_runs/{run_id}")

    def wait(self, run_id: str, timeout: float = 600.0, poll: float = 1.0) -> dict[str, Any]:
        """Poll until the flow run is in a terminal state; return it. TimeoutError names the last state."""
        deadline = time.monotonic() + timeout
        run = self.flow_run(run_id)
        while run["state_type"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {run_id} still {run['state_type']} ({run['state_name']}) after "
                                   f"{timeout:.0f} s: is a worker polling its work pool?")
            time.sleep(poll)
            run = self.flow_run(run_id)
        return run

    def flow_runs(self, deployment_id: str) -> list[dict[str, Any]]:
        """Flow runs of one deployment, newest first."""
        return self._call("POST", "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}},
                                                         "sort": "EXPECTED_START_TIME_DESC", "limit": 200})

    def emit_event(self, event: str, resource: dict[str, str], payload: dict[str, Any] | None = None) -> None:
        """Post one event (what ``prefect.events.emit_event`` sends from inside a run)."""
        import datetime
        import uuid

        self._call("POST", "/events", [{
            "id": str(uuid.uuid4()), "occurred": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "event": event, "resource": resource, "payload": payload or {}, "related": []}])

    def artifacts(self, flow_run_id: str) -> list[dict[str, Any]]:
        return self._call("POST", "/artifacts/filter",
                          {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200})

    def task_runs(self, flow_run_id: str) -> list[dict[str, Any]]:
        return self._call("POST", "/task_runs/filter",
                          {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PrefectAPI:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
