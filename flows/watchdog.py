"""The ``watchdog`` flow: watch one run or every run under a store root; fence dead shards, rerun them.

::

    every poll_s:  look at each run (heartbeats/, fences/)  ──>  a shard silent or stuck > timeout_s?
                     │                                              │ yes
                     │                                              ├─ fence: fences/<part>/<gen+1> (put-if-absent;
                     │                                              │          a losing watchdog does nothing)
                     │                                              └─ rerun: a train-shard task run of this flow,
                     │                                                        same cut, generation gen+1
                     └─ the coordinator silent > timeout_s?  ──>  report; from a deployment: run it again (resume)

Every decision is a log line, a Prefect event (``ckpt.watchdog.<kind>``, resource
``ckpt.shard.<run>.<part>``) and, for fences and dead runs, a markdown artifact; the flow ends
with a table artifact of all its decisions. The logic is ``tasks/watchdog.py`` (no Prefect);
``docs/watchdog.md`` explains the rules, the rerun path and the measured figures.

Ways to run it: ``ckpt watchdog URL`` (foreground), beside every ``ckpt train`` (a thread of the
CLI's process, unless ``--no-watchdog``), the ``watchdog/watchdog`` deployment (``make deploy``:
every 2 minutes for 110 s, and started by the automation that fires when shard heartbeat events
stop), ``python -m flows.watchdog URL``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.watchdog import DEFAULT_POLL_S, DEFAULT_TIMEOUT_S, Watchdog, run_name, watchdog_name

from .params import SecretOptions, run_url

# stop_key -> Event: how a process that started the flow in a thread (ckpt train) stops it
_STOPS: dict[str, threading.Event] = {}
ARTIFACT_KINDS = ("fenced", "run-dead", "resumed", "resume-failed", "gave-up", "cannot-rerun", "rerun-failed")


def stop_event(key: str) -> threading.Event:
    """The event that stops the watchdog flow started with ``stop_key=key`` (in this process)."""
    return _STOPS.setdefault(key, threading.Event())


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    p = flow_run.parameters
    return f"watchdog-{p.get('run_id') or run_name(str(p.get('store') or 'runs'))}"


@flow(name="watchdog", flow_run_name=_flow_run_name, task_runner=ThreadPoolTaskRunner(max_workers=16),
      persist_result=False, validate_parameters=True,
      description="Watch training runs' heartbeats: fence silent or stuck shards and rerun them from the "
                  "last checkpoint; restart dead runs that came from a deployment.")
def watchdog(
    store: str = "./runs",
    run_id: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    poll_s: float = DEFAULT_POLL_S,
    duration_s: float = 110.0,
    until_done: bool = False,
    rerun: bool = True,
    resume: bool = True,
    start_timeout_s: float | None = None,
    storage_options: SecretOptions | None = None,
    stop_key: str | None = None,
) -> dict[str, Any]:
    """Watch the runs under ``store`` (or the run ``run_id``) and act on dead shards.

    Args:
        store: A store root holding runs (s3://checkpoints/runs, ./runs) or one run's URL.
        run_id: Watch only this run (<store>/<run_id>). Empty: every run under the store.
        timeout_s: A shard that has not beaten, or not advanced, for this long is dead (seconds).
        poll_s: Seconds between two looks at the store.
        duration_s: Stop after this long (0: run until stopped); reruns in flight are waited for.
        until_done: Also stop once every watched run has finished.
        rerun: Rerun dead shards here (a train-shard task run). Off: only fence and report.
        resume: Start a dead run (coordinator silent) again when it came from a deployment.
        start_timeout_s: How long a task may take to start beating (default max(2 x timeout, timeout + 30)).
        storage_options: s3fs arguments for an s3:// store (default: the environment's credentials).
        stop_key: Internal: a key of this process's stop events (ckpt train stops its watchdog so).
    """
    from tasks.shard import train_shard

    logger = get_run_logger()
    t0 = time.time()
    so = dict(storage_options.get_secret_value()) if storage_options is not None else None
    url = run_url(store, run_id) if run_id else (store if "://" in store else os.path.abspath(os.path.expanduser(store)))
    stop = stop_event(stop_key) if stop_key else None
    futures: dict[str, Any] = {}

    def submit_rerun(req: dict) -> str:
        key = f"{req['run_url']}|shard-{req['shard']}|r{req['round']}|g{req['generation']}"
        task = train_shard.with_options(
            task_run_name=f"rerun-shard-{req['shard']}-round-{req['round']}-g{req['generation']}",
            retries=req["retries"], retry_delay_seconds=req["retry_delay_s"])
        futures[key] = task.submit(
            run_url=req["run_url"], spec=req["spec"], shard=req["shard"], round=req["round"], source=req["source"],
            storage_options=req["storage_options"], keyframe_every=req["keyframe_every"], chaos=req["chaos"],
            heartbeat_every_s=req["heartbeat_every_s"], heartbeat_events=req["heartbeat_events"],
            attempt_offset=req["attempt_offset"])
        return key

    wd = Watchdog(url, so, timeout_s=timeout_s, start_timeout_s=start_timeout_s,
                  rerun=submit_rerun if rerun else None, resume=_resume_from_deployment if resume else None,
                  by=f"{watchdog_name()} ({_flow_run_label()})")
    logger.info("watching %s: dead after %g s without a beat or progress, a look every %g s%s", url, timeout_s,
                poll_s, f", for {duration_s:g} s" if duration_s > 0 else "")
    polls = 0
    while True:
        for d in wd.poll():
            _publish(d, logger)
        polls += 1
        for key in [k for k, f in futures.items() if _future_done(f)]:
            f = futures.pop(key)
            try:
                res = f.result()
                logger.info("rerun %s ended: %s", key, res.get("status"))
                done = wd.rerun_done(key, True, result=res)
            except Exception as e:  # noqa: BLE001 - the rerun failed after its retries
                done = wd.rerun_done(key, False, f"{type(e).__name__}: {e}")
            for d in done:
                _publish(d, logger)
        if stop is not None and stop.is_set():
            break
        if until_done and polls > 1 and not futures and not wd.active():
            logger.info("every watched run has finished")
            break
        if duration_s > 0 and time.time() - t0 >= duration_s and not futures:
            break
        if stop is not None:
            stop.wait(poll_s)
        else:
            time.sleep(poll_s)
    summary = {"url": url, "runs": sorted(wd.runs), "polls": polls, "seconds": round(time.time() - t0, 3),
               "decisions": wd.decisions, "by": wd.by}
    _table_artifact(url, wd.decisions)
    if stop_key:
        _STOPS.pop(stop_key, None)
    return summary


def _future_done(f: Any) -> bool:
    wrapped = getattr(f, "wrapped_future", None)
    return bool(wrapped.done()) if wrapped is not None else f.state.is_final()


def _flow_run_label() -> str:
    try:
        from prefect.runtime import flow_run

        return f"flow run {flow_run.name}"
    except Exception:  # noqa: BLE001
        return "no flow run"


# --- making decisions visible ---------------------------------------------------------------------------

def describe(d: dict) -> str:
    """One line per decision, for logs and the CLI."""
    where = f"{d['part']} of run {d['run']}" + (f" round {d['round']}" if d.get("round") is not None else "")
    kind = d["kind"]
    if kind == "fenced":
        extra = f"; strike {d['strike_latency_s']:.1f} s ago" if d.get("strike_latency_s") is not None else ""
        rerun = d.get("rerun")
        return (f"{where}: {d['reason']} -> fenced generation {d['generation']} ({d['detection_latency_s']:.1f} s "
                f"after its last sign of life{extra}); "
                + (f"rerun as attempt {rerun['attempt_offset'] + 1}" if rerun else "not rerun here"))
    if kind == "running-again":
        return f"{where}: {d['reason']} (restart {d['restart_s']:.1f} s after the decision)"
    if kind == "lost-race":
        return f"{where}: {d['reason']}"
    return f"{where}: {kind}: {d.get('reason')}"


def _publish(d: dict, logger: Any) -> None:
    line = describe(d)
    (logger.warning if d["kind"] in ARTIFACT_KINDS else logger.info)("%s", line)
    _event(d)
    if d["kind"] in ARTIFACT_KINDS:
        try:
            from prefect.artifacts import create_markdown_artifact

            create_markdown_artifact(markdown=_markdown(d), description=f"watchdog: {d['kind']} {d['part']} of {d['run']}")
        except Exception as e:  # noqa: BLE001 - visibility must never stop the watchdog
            logger.debug("artifact not created: %s", e)


def _event(d: dict) -> None:
    try:
        from prefect.events import emit_event

        resource_id = f"ckpt.shard.{d['run']}.{d['part']}" if d.get("shard") is not None else f"ckpt.run.{d['run']}"
        payload = {k: v for k, v in d.items() if isinstance(v, (str, int, float, bool, type(None)))}
        emit_event(event=f"ckpt.watchdog.{d['kind']}",
                   resource={"prefect.resource.id": resource_id, "ckpt.run-id": d["run"], "ckpt.part": d["part"]},
                   payload=payload)
    except Exception:  # noqa: BLE001
        pass


def _markdown(d: dict) -> str:
    rows = [("decision", d["kind"]), ("run", f"`{d['run_url']}`"), ("part", d["part"]), ("round", d.get("round")),
            ("why", d.get("reason")), ("dead generation / attempt", f"{d.get('dead_generation')} / {d.get('dead_attempt')}"),
            ("new generation", d.get("generation")), ("last beat", _ts(d.get("last_beat"))),
            ("detected", _ts(d.get("detected"))), ("detection latency", f"{d.get('detection_latency_s')} s"),
            ("steps lost", d.get("steps_lost")), ("by", d.get("by"))]
    if d.get("resumed"):
        rows.append(("started again", f"flow run {d['resumed'].get('flow_run_id')}"))
    body = "\n".join(f"| {k} | {v} |" for k, v in rows if v is not None)
    return f"# Watchdog: {d['kind']} {d['part']}\n\n| | |\n|---|---|\n{body}\n"


def _ts(t: float | None) -> str | None:
    if not t:
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(t))) + f".{int((float(t) % 1) * 1000):03d} UTC"


def _table_artifact(url: str, decisions: list[dict]) -> None:
    if not decisions:
        return
    try:
        import re

        from prefect.artifacts import create_table_artifact

        cols = ("kind", "run", "part", "round", "dead_generation", "generation", "state", "detection_latency_s",
                "running_again_s", "steps_lost", "reason")
        key = "watchdog-" + re.sub(r"[^a-z0-9-]+", "-", run_name(url).lower()).strip("-")[:60]
        create_table_artifact(table=[{c: d.get(c) for c in cols} for d in decisions], key=key,
                              description=f"Watchdog decisions for {url}")
    except Exception:  # noqa: BLE001
        pass


# --- a dead run from a deployment: start it again ------------------------------------------------------

def _resume_from_deployment(d: dict) -> dict | None:
    """Start the deployment the dead run came from again, with ``resume`` (idempotent per dead flow run).
    None when the run did not come from a deployment (``ckpt train``: resume it by hand)."""
    logger = get_run_logger()
    dep, fr = d.get("deployment_id"), d.get("flow_run_id")
    if not dep:
        logger.warning("run %s is dead and did not come from a deployment: continue it with "
                       "`ckpt train --resume --run-id %s --store <its store>`", d["run"], d.get("run_id") or d["run"])
        return None
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(UUID(dep))
        base = dict((deployment.parameters or {}).get("params") or {})
        previous = {}
        if fr:
            old = client.read_flow_run(UUID(fr))
            previous = dict((old.parameters or {}).get("params") or {})
            if old.state is not None and old.state.is_final() and not old.state.is_crashed():
                logger.warning("run %s: its flow run %s is %s, not crashed: not started again", d["run"], old.name,
                               old.state.name)
                return None
            if old.state is not None and not old.state.is_final():
                try:  # the UI should not show a dead run as running
                    client.set_flow_run_state(UUID(fr), Crashed(message=f"the watchdog found its coordinator silent: "
                                                                        f"{d.get('reason')}"), force=True)
                except Exception as e:  # noqa: BLE001
                    logger.debug("could not mark %s crashed: %s", fr, e)
    previous.pop("storage_options", None)  # masked in the API: keep the deployment's
    params = {**base, **previous, "resume": True, "run_id": d.get("run_id") or d["run"]}
    new = run_deployment(name=UUID(dep), parameters={"params": params}, timeout=0, as_subflow=False,
                         idempotency_key=f"ckpt-resume-{params['run_id']}-{fr or d.get('last_beat')}")
    return {"flow_run_id": str(new.id), "flow_run_name": new.name,
            "reason": f"started again from deployment {deployment.name} as flow run {new.name} (resume)"}


if __name__ == "__main__":  # python -m flows.watchdog URL [--timeout-s S] [--duration-s S]
    import argparse
    import json

    from .api import prefect_api

    ap = argparse.ArgumentParser(prog="python -m flows.watchdog")
    ap.add_argument("store")
    ap.add_argument("--run-id")
    ap.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    ap.add_argument("--poll-s", type=float, default=DEFAULT_POLL_S)
    ap.add_argument("--duration-s", type=float, default=0.0)
    a = ap.parse_args()
    with prefect_api():
        print(json.dumps(watchdog(a.store, a.run_id, a.timeout_s, a.poll_s, a.duration_s), indent=2, default=str))
