"""Register the project's deployments on a process work pool (``make deploy``).

    python -m deployments.deploy [--stack-dir .stack] [--pool local-pool] [--store s3://checkpoints/runs]
                                 [--only train,gc] [--schedules-inactive] [--list]

What gets registered (``DEPLOYMENTS`` below; flow name / deployment name):

================================  ========================================  =============================
``train-run/train``               flows.train.train_run                     on demand (UI form, API, CLI)
``validate-checkpoint/validate``  flows.validate.validate_checkpoint_flow   on demand
``gc-store/gc``                   flows.gc.gc_store                         daily 03:30 UTC (inactive
                                                                            until switched on in the UI)
``<watchdog>/watchdog``           flows.watchdog (the flow in it)           one long-lived run, started
                                                                            here; concurrency 1,
                                                                            CANCEL_NEW; an automation
                                                                            starts another if it dies
================================  ========================================  =============================

Every deployment runs its flow runs with the job variable ``stream_output: false``: a flow-run
process whose output is piped to the worker crashes with BrokenPipeError once the worker dies;
without the pipe it outlives the worker (its logs reach the API either way). Automations
(``deployments/automations.py``): the watchdog's keeper, and with ``--webhook URL`` notifications
of failed validations, runs the watchdog gave up on and training runs that ended other than
Completed (failed, crashed, cancelled).

Every deployment's store URL parameter defaults to the stack's bucket (``s3://checkpoints/runs``,
from ``<stack-dir>/stack.json``; ``--store`` or ``CKPT_STORE`` override it), so the UI's run form
starts from the stack's store. Parameters are typed (pydantic) with descriptions, so the UI shows
a form; the training run's whole ``TrainParams`` is the default, because the server merges run
parameters into deployment parameters only at the top level.

Where Prefect is: ``PREFECT_API_URL`` if set, else the stack's (``stack.json``); its credentials
(``user:password``, Prefect's basic auth): ``PREFECT_API_AUTH_STRING`` if set, else the stack's when
the API is the stack's (the stack's server refuses every call without them). The code is taken
from this checkout (``flow.from_source(<repo dir>, entrypoint)``; the worker's pull step changes
into that directory), so workers on other machines need the same checkout at the same path, with
the project installed (``pip install -e .``), or pass ``--source`` with a git URL.

Entrypoints are *module paths* (``flows.train.train_run``), not file paths
(``flows/train.py:train_run``): the flows are modules of the project's packages (relative imports,
tasks pickled by module name into process pools), and loading ``flows/train.py`` as a loose script
breaks both (a validation in a process pool fails with "attempted relative import with no known
parent package").

Why a Python script rather than ``prefect.yaml`` + ``prefect deploy --all``: the defaults are
computed (the stack's store URL and pool, the absolute checkout path for the pull step, the full
``TrainParams`` default), a flow that does not exist yet is skipped with a message instead of
failing the whole command, the automations are created (or replaced) idempotently and the
watchdog's long-lived run started in the same command, and one Python process registers
everything (``prefect deploy`` builds each deployment by importing the flow anyway, and needs the
current directory to be the repo root and non-interactive flags to be safe in CI).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_STORE = "s3://checkpoints/runs"
DEFAULT_POOL = "local-pool"
TAGS = ["ckpt"]
# Names of flow parameters that hold a store or run URL (the watchdog's may be any of them).
STORE_PARAMS = ("store", "store_url", "store_root", "root", "url")


@dataclass
class Spec:
    """One deployment: which flow (entrypoint), its deployment name, schedule, defaults."""

    key: str  # --only name
    entrypoint: str  # "flows.x.func" (module path); func "*" = the only flow in the module
    name: str
    description: str
    interval_s: float | None = None
    cron: str | None = None
    schedule_active: bool = True
    concurrency_limit: Any = None  # an int, or a prefect ConcurrencyLimitConfig
    extra_defaults: dict[str, Any] = field(default_factory=dict)  # top-level parameters
    model_defaults: dict[str, Any] = field(default_factory=dict)  # fields of a pydantic-model parameter


DEPLOYMENTS = [
    Spec("train", "flows.train.train_run", "train",
         "A training run (rounds of shard tasks, consistent cuts, validated incremental checkpoints) "
         "with its checkpoints in the stack's S3 bucket.",
         # the watchdog reads the heartbeats from the store: no Prefect event per beat (they flooded the events)
         model_defaults={"heartbeat_events": False}),
    Spec("validate", "flows.validate.validate_checkpoint_flow", "validate",
         "Validate one committed checkpoint of a run (verdict, Data Docs report, artifacts)."),
    Spec("gc", "flows.gc.gc_store", "gc",
         "Garbage-collect every run under the store root (retention policy + sweep). The daily "
         "schedule starts inactive: switch it on in the UI.",
         cron="30 3 * * *", schedule_active=False, concurrency_limit=1),
    Spec("watchdog", "flows.watchdog.*", "watchdog",
         "Watch every run under the store root: fence silent or stuck shards and rerun them from the "
         "last healthy checkpoint; start dead deployment runs again. One long-lived run per store: a "
         "second one is cancelled at once; an automation starts another when it dies.",
         concurrency_limit="one, cancel new", extra_defaults={"duration_s": 0}),
]
# Flow runs must outlive the worker that starts them (see the module docstring).
JOB_VARIABLES = {"stream_output": False}


# --------------------------------------------------------------------------- configuration

def stack_info(stack_dir: str | os.PathLike) -> dict[str, Any] | None:
    try:
        return json.loads((Path(stack_dir) / "stack.json").read_text())
    except (OSError, ValueError):
        return None


def configure(stack_dir: str | os.PathLike) -> dict[str, Any]:
    """Point this process at the Prefect API and its credentials (before prefect is imported); return
    the stack's info."""
    info = stack_info(stack_dir) or {}
    if not os.environ.get("PREFECT_API_URL"):
        if not info:
            raise SystemExit(
                f"error: no Prefect API to deploy to: start the local stack (`make stack`, {stack_dir}/stack.json) "
                "or export PREFECT_API_URL=http://HOST:4200/api")
        os.environ["PREFECT_API_URL"] = info["api_url"]
    auth = info.get("env", {}).get("PREFECT_API_AUTH_STRING")
    if auth and os.environ["PREFECT_API_URL"].rstrip("/") == info["api_url"]:
        os.environ.setdefault("PREFECT_API_AUTH_STRING", auth)  # the stack's API: its credentials
    os.environ.setdefault("DO_NOT_TRACK", "1")
    return info


# --------------------------------------------------------------------------- flows and defaults

def load_flow(spec: Spec, source: str):
    """The flow object of ``spec`` (from ``source``), or None when its file does not exist yet."""
    from prefect import Flow

    module, func = spec.entrypoint.rsplit(".", 1)
    path = module_file(spec)
    if "://" not in source and not (Path(source) / path).exists():
        return None
    if func == "*":
        import ast

        tree = ast.parse((Path(source) / path).read_text())
        flows = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and any(_is_flow_decorator(d) for d in n.decorator_list)]
        if len(flows) != 1:
            raise RuntimeError(f"{path} defines {len(flows)} flows ({flows}): name one in DEPLOYMENTS")
        spec.entrypoint = f"{module}.{flows[0]}"
    return Flow.from_source(source=source, entrypoint=spec.entrypoint)


def module_file(spec: Spec) -> str:
    """``flows/train.py`` for ``flows.train.train_run``."""
    return spec.entrypoint.rsplit(".", 1)[0].replace(".", "/") + ".py"


def _is_flow_decorator(node) -> bool:
    import ast

    target = node.func if isinstance(node, ast.Call) else node
    return (isinstance(target, ast.Name) and target.id == "flow") or (
        isinstance(target, ast.Attribute) and target.attr == "flow")


def store_defaults(flow, store: str, model_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """Deployment parameters that point ``flow`` at ``store``.

    A string parameter named like a store (``STORE_PARAMS``) gets ``store``; ``run_url`` gets
    ``<store>/`` (the run id is to be appended); a pydantic-model parameter with a ``store`` field
    gets the model's full default with that field (and ``model_defaults``) replaced (the server
    merges run parameters into deployment parameters at the top level only, so a partial object
    would lose fields)."""
    import pydantic

    out: dict[str, Any] = {}
    for name, p in inspect.signature(flow.fn).parameters.items():
        ann = p.annotation
        default = p.default
        model = type(default) if isinstance(default, pydantic.BaseModel) else ann
        if inspect.isclass(model) and issubclass(model, pydantic.BaseModel) and "store" in model.model_fields:
            try:
                base = default if isinstance(default, pydantic.BaseModel) else model()
            except pydantic.ValidationError:
                continue  # required fields: leave the form to the user
            extra = {k: v for k, v in (model_defaults or {}).items() if k in model.model_fields}
            # validated, so a renamed or retyped field fails here and not in the UI
            full = model.model_validate({**base.model_dump(mode="json"), "store": store, **extra}).model_dump(mode="json")
            shown = model.model_json_schema()["properties"]  # not the fields kept out of the form (credentials)
            out[name] = {k: v for k, v in full.items() if k in shown}
        elif name in STORE_PARAMS:
            out[name] = store
        elif name == "run_url":
            out[name] = store.rstrip("/") + "/"
    return out


# --------------------------------------------------------------------------- deploy

def deploy(spec: Spec, *, source: str, pool: str, store: str, schedules_active: bool | None,
           extra: dict[str, Any] | None = None) -> tuple[str, str] | None:
    """Register one deployment; return (flow name, deployment id), or None when its flow does not exist yet."""
    from prefect.schedules import Cron, Interval

    flow = load_flow(spec, source)
    if flow is None:
        return None
    active = spec.schedule_active if schedules_active is None else schedules_active
    schedules = []
    if spec.interval_s:
        schedules.append(Interval(timedelta(seconds=spec.interval_s), active=active))
    if spec.cron:
        schedules.append(Cron(spec.cron, timezone="UTC", active=active))
    parameters = {**store_defaults(flow, store, spec.model_defaults), **spec.extra_defaults, **(extra or {})}
    limit = spec.concurrency_limit
    if limit == "one, cancel new":
        from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

        limit = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
    quiet = io.StringIO()  # .deploy() prints a table per deployment; main() prints one line instead
    with contextlib.redirect_stdout(quiet):
        dep_id = flow.deploy(
            name=spec.name, work_pool_name=pool, parameters=parameters, description=spec.description,
            tags=TAGS, schedules=schedules or None, concurrency_limit=limit, job_variables=JOB_VARIABLES,
            print_next_steps=False, ignore_warnings=True,
        )
    return flow.name, str(dep_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deployments.deploy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack-dir", default=os.environ.get("CKPT_STACK_DIR", ".stack"),
                    help="the local stack whose API, pool and store to use (default .stack)")
    ap.add_argument("--pool", default=None, help="work pool (default: the stack's, else local-pool)")
    ap.add_argument("--store", default=None,
                    help="default store root of the deployments "
                         "(default: CKPT_STORE, else the stack's, else s3://checkpoints/runs)")
    ap.add_argument("--source", default=str(REPO),
                    help="where workers get the code: this checkout (default) or a git URL")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {[d.key for d in DEPLOYMENTS]}")
    ap.add_argument("--schedules-inactive", action="store_true",
                    help="register every schedule inactive (tests, or to switch them on in the UI)")
    ap.add_argument("--list", action="store_true", help="list what would be registered and exit")
    ap.add_argument("--watchdog-timeout", type=float, default=None,
                    help="the watchdog's timeout_s: a shard silent or stuck this long is dead (default 30)")
    ap.add_argument("--watchdog-poll", type=float, default=None, help="the watchdog's poll_s (default 2)")
    ap.add_argument("--keeper-within", type=float, default=None,
                    help="seconds without a sign of life of the watchdog before another is started (default 60)")
    ap.add_argument("--no-watchdog-run", action="store_true",
                    help="register the watchdog without starting its long-lived run")
    ap.add_argument("--webhook", default=os.environ.get("CKPT_NOTIFY_WEBHOOK"),
                    help="notify this URL (a Webhook block) of failed validations, runs the watchdog gave up on "
                         "and training runs that failed, crashed or were cancelled (default: CKPT_NOTIFY_WEBHOOK; "
                         "none: no notifications)")
    a = ap.parse_args(argv)

    specs = DEPLOYMENTS
    if a.only:
        wanted = {s.strip() for s in a.only.split(",") if s.strip()}
        unknown = wanted - {d.key for d in DEPLOYMENTS}
        if unknown:
            print(f"error: unknown deployment(s) {sorted(unknown)}: choose from {[d.key for d in DEPLOYMENTS]}",
                  file=sys.stderr)
            return 2
        specs = [d for d in DEPLOYMENTS if d.key in wanted]
    if a.list:
        for d in specs:
            print(f"{d.key:9s} {d.entrypoint:45s} {d.description}")
        return 0

    info = configure(a.stack_dir)
    pool = a.pool or info.get("pool") or os.environ.get("CKPT_WORK_POOL") or DEFAULT_POOL
    store = a.store or os.environ.get("CKPT_STORE") or info.get("store") or DEFAULT_STORE
    schedules_active = False if a.schedules_inactive else None
    api_url = os.environ["PREFECT_API_URL"]
    refused = _refusal(api_url)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 1
    print(f"Registering deployments on work pool {pool!r} of {os.environ['PREFECT_API_URL']} "
          f"(code: {a.source}; default store: {store})", flush=True)
    failed = 0
    watchdog_params = {k: v for k, v in (("timeout_s", a.watchdog_timeout), ("poll_s", a.watchdog_poll))
                       if v is not None}
    for spec in specs:
        try:
            done = deploy(spec, source=a.source, pool=pool, store=store, schedules_active=schedules_active,
                          extra=watchdog_params if spec.key == "watchdog" else None)
        except Exception as e:  # noqa: BLE001 - one broken flow does not keep the others from registering
            failed += 1
            print(f"  FAILED  {spec.key}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        if done is None:
            print(f"  skipped {spec.key}: {module_file(spec)} does not exist yet", flush=True)
            continue
        flow_name, dep_id = done
        print(f"  ok      {flow_name}/{spec.name}  ({spec.entrypoint})  id {dep_id}", flush=True)
        if spec.key == "watchdog":
            failed += _watchdog_extras(dep_id, store, a)
    if a.webhook:
        try:
            from deployments.automations import notifications

            ui_url = info.get("ui_url") or os.environ.get("PREFECT_UI_URL")
            for name, aid in notifications(a.webhook, ui_url=ui_url).items():
                print(f"  ok      automation {name} (-> webhook block ckpt-notify)  id {aid}", flush=True)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"  FAILED  notifications: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    ui = info.get("ui_url") or os.environ.get("PREFECT_UI_URL")
    if ui:
        print(f"Open {ui} (Deployments) to run them.")
    return 1 if failed else 0


def _watchdog_extras(dep_id: str, store: str, a: argparse.Namespace) -> int:
    """The keeper automation, and the long-lived run (unless one is alive); returns failures (0 or 1)."""
    from deployments.automations import KEEPER, KEEPER_WITHIN_S, ensure_watchdog, watchdog_keeper
    from deployments.client import PrefectAPI

    within = a.keeper_within or KEEPER_WITHIN_S
    try:
        aid = watchdog_keeper(dep_id, store, within_s=within)
        print(f"  ok      automation {KEEPER} (no sign of life for {within:.0f} s -> another watchdog)  id {aid}",
              flush=True)
        if not a.no_watchdog_run:
            with PrefectAPI(os.environ["PREFECT_API_URL"]) as api:
                started = ensure_watchdog(api, api.deployment(dep_id), alive_within_s=within)
            print(f"  ok      watchdog of {store}: " + (f"started (flow run {started})" if started else
                                                         "already running"), flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"  FAILED  watchdog keeper / run: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def _refusal(api_url: str) -> str | None:
    """Why the API at ``api_url`` will not take our calls (it does not answer, or refuses our
    credentials), or None when it will. Prefect's client, with the credentials of our environment as
    ``main`` left it (``PREFECT_API_AUTH_STRING`` for a server with basic auth, as the stack's;
    ``PREFECT_API_KEY`` for Prefect Cloud)."""
    import httpx
    from prefect.client.orchestration import SyncPrefectClient

    auth, key = os.environ.get("PREFECT_API_AUTH_STRING"), os.environ.get("PREFECT_API_KEY")
    try:  # not /health: it answers without credentials
        with SyncPrefectClient(api_url, auth_string=auth, api_key=key, httpx_settings={"timeout": 10}) as client:
            client.api_version()
        return None
    except httpx.HTTPStatusError as e:
        if e.response.status_code == 401:
            return (f"the Prefect API at {api_url} refused " + ("these credentials" if auth or key else "a call without "
                    "credentials") + ": set PREFECT_API_AUTH_STRING to its user:password (`set -a; . .stack/env; "
                    "set +a` does for the local stack; --stack-dir finds the stack's by itself)")
        return None  # it answered (Prefect Cloud has no /admin): what else is wrong, Prefect's client says
    except (httpx.TransportError, OSError):
        return (f"the Prefect API at {api_url} does not answer: start the stack (`make stack`) or set "
                "PREFECT_API_URL to a running server")


if __name__ == "__main__":
    sys.exit(main())
