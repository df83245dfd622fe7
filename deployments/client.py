"""A few calls of the Prefect REST API, for scripts and tests that drive the stack from outside.

    api = PrefectAPI("http://127.0.0.1:4200/api")
    run = api.run_deployment("train-run/train", {"params": {"rounds": 2}}, name="try-1")
    run = api.wait(run["id"], timeout=600)          # a terminal state, or TimeoutError
    api.artifacts(run["id"])                        # [{key, type, data, ...}]

or from a shell (``PREFECT_API_URL`` as exported by ``. .stack/env``)::

    python -m deployments.client run train-run/train --set params.rounds=2 --set params.shards=1 --wait

Plain HTTP (``httpx``, a Prefect dependency), so a caller needs no Prefect settings or profile:
what it talks to is the URL it passes, with the credentials it passes (``auth``, ``user:password``:
a server started with ``PREFECT_SERVER_API_AUTH_STRING``, as the stack's is, refuses every call
without them). ``auth`` defaults to ``PREFECT_API_AUTH_STRING``, what Prefect's own client sends.

Why ``run_deployment`` merges: the server merges a run's parameters into the deployment's at the
top level only, so ``prefect deployment run train-run/train --param params='{"rounds": 2}'`` would
replace the whole ``params`` object and silently fall back to the flow's own defaults (a local
``./runs`` store instead of the stack's bucket). ``run_deployment`` deep-merges the given values
into the deployment's parameters first (``merge=False`` sends them as they are).
"""

from __future__ import annotations

import base64
import os
import random
import time
from typing import Any

import httpx

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


# Prefect's server answers 503 for errors a client may retry (a busy or briefly unreachable
# database: the request's transaction was rolled back) and 429 when it sheds load; its own client
# retries both with exponential backoff and jitter (PREFECT_CLIENT_MAX_RETRIES, default 5). So do we.
RETRY_STATUS = {429, 503}


class PrefectAPI:
    def __init__(self, api_url: str, timeout: float = 30.0, retries: int = 5, backoff_s: float = 1.0,
                 auth: str | None = None):
        self.api_url = api_url.rstrip("/")
        auth = auth if auth is not None else os.environ.get("PREFECT_API_AUTH_STRING")
        # Prefect's basic auth: the whole "user:password" string is the server's secret (never logged here)
        headers = {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}
        self._http = httpx.Client(base_url=self.api_url, timeout=timeout, headers=headers)
        self.retries, self.backoff_s = retries, backoff_s

    def _call(self, method: str, path: str, json: Any = None) -> Any:
        for attempt in range(self.retries + 1):
            r = self._http.request(method, path, json=json)
            if r.status_code not in RETRY_STATUS or attempt == self.retries:
                break
            time.sleep(self._delay(attempt, r.headers.get("Retry-After")))
        if r.status_code == 401:
            raise RuntimeError(f"{method} {self.api_url}{path} -> 401: the Prefect API refused "
                               + ("these credentials" if "Authorization" in self._http.headers else "a call without "
                                  "credentials") + ": set PREFECT_API_AUTH_STRING to the server's user:password "
                               "(`set -a; . .stack/env; set +a` does for the local stack) or pass auth=")
        if r.status_code >= 400:
            tried = f" (after {self.retries} retries)" if r.status_code in RETRY_STATUS and self.retries else ""
            raise RuntimeError(f"{method} {self.api_url}{path} -> {r.status_code}{tried}: {r.text[:500]}")
        return r.json() if r.content else None

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        try:
            if retry_after is not None:
                return min(float(retry_after), 60.0)
        except ValueError:
            pass  # an HTTP date: use our own backoff
        return self.backoff_s * 2 ** attempt * random.uniform(0.8, 1.2)

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
                       name: str | None = None, tags: list[str] | None = None, merge: bool = True) -> dict[str, Any]:
        """Create a flow run of ``deployment`` (a dict or ``flow/deployment`` name); a worker runs it.

        ``parameters`` are deep-merged into the deployment's (see the module docstring) unless
        ``merge`` is False."""
        dep = self.deployment(deployment) if isinstance(deployment, str) else deployment
        params = deep_merge(dep.get("parameters") or {}, parameters or {}) if merge else (parameters or {})
        body: dict[str, Any] = {"parameters": params}
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
            "id": str(uuid.uuid4()), "occurred": datetime.datetime.now(datetime.UTC).isoformat(),
            "event": event, "resource": resource, "payload": payload or {}, "related": []}])

    def events(self, names: list[str], since: float, limit: int = 200) -> list[dict[str, Any]]:
        """Events named ``names`` that occurred since ``since`` (wall time), newest first."""
        import datetime

        start = datetime.datetime.fromtimestamp(since, datetime.UTC).isoformat()
        page = self._call("POST", "/events/filter", {"filter": {"event": {"name": names}, "occurred": {"since": start}},
                                                     "limit": min(limit, 50)})
        out = list(page.get("events") or [])
        while page.get("next_page") and len(out) < limit:
            r = self._http.get(page["next_page"])
            page = r.json() if r.status_code < 400 else {}
            out += page.get("events") or []
        return out

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
        state: dict[str, Any] = {"type": state_type, "message": message}
        if name:
            state["name"] = name
        self._call("POST", f"/flow_runs/{flow_run_id}/set_state", {"state": state, "force": True})

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
