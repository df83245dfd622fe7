"""The ``watchdog`` flow: watch one run or every run under a store root; fence dead shards, rerun them.

::

    every poll_s:  look at each run (heartbeats/, fences/)  ──>  a shard silent or stuck > timeout_s?
                     │                                              │ yes
                     │                                              ├─ fence: fences/<part>/<gen+1> (put-if-absent;
                     │                                              │          a losing watchdog does nothing)
                     │                                              └─ rerun: a train-shard task run of this flow,
                     │                                                        same cut, generation gen+1
                     └─ the coordinator silent > timeout_s?  ──>  report; from a deployment: run it again (resume)

Composition only: the rules and the state machine are ``trainrun.watchdog``; a rerun is the
``train-shard`` task; restarting a dead deployment run is ``flows/resume.py``. Every decision is a
log line, a Prefect event (``ckpt.watchdog.<kind>``, resource ``ckpt.shard.<run>.<part>``) and, for
the notable ones, a markdown artifact; the flow ends with a table artifact of all its decisions.
``docs/watchdog.md`` explains the rules, the rerun path and the measured figures.

The watchdog runs nothing the store names: a rerun uses the run's spec as this flow was given it
(``spec``, which ``ckpt train`` passes to the watchdog beside its run), or a spec read from the store
whose workload is a built-in or in ``allow_workloads``.

Ways to run it: ``ckpt watchdog URL`` (foreground), beside every ``ckpt train`` (a thread of the
CLI's process, unless ``--no-watchdog``; it judges that session's beats only: ``since``), the
``watchdog/watchdog`` deployment (``make deploy``: one long-lived run per store, started again by
the keeper automation when it dies), ``python -m flows.watchdog URL``.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.access import storage_options
from tasks.links import flow_run_url, md_link
from tasks.shard import rerun_name, train_shard
from trainrun.credentials import StoreAccess, check_url
from trainrun.layout import check_run_id, run_name, run_url, store_url
from trainrun.spec import RunSpec
from trainrun.watchdog import (
    DEFAULT_POLL_S,
    DEFAULT_TIMEOUT_S,
    Decision,
    RerunRequest,
    Watchdog,
    describe,
    watchdog_name,
)
from trainrun.watchdog.decisions import NOTABLE

from .resume import resume_from_deployment

# stop_key -> Event: how a process that started the flow in a thread (ckpt train) stops it
_STOPS: dict[str, threading.Event] = {}
# A watchdog's own sign of life, for the automation that starts another when it dies
# (deployments/automations.py): ``ckpt.watchdog.alive`` this often, ``ckpt.watchdog.stopped`` at its end.
ALIVE_EVERY_S = 10.0


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
    credentials_block: str | None = None,
    spec: RunSpec | None = None,
    allow_workloads: list[str] | None = None,
    stop_key: str | None = None,
    since: float | None = None,
) -> dict[str, Any]:
    """Watch the runs under ``store`` (or the run ``run_id``) and act on dead shards.

    Args:
        store: A store root holding runs (s3://checkpoints/runs, ./runs) or one run's URL.
        run_id: Watch only this run (store/run_id). Empty: every run under the store.
        timeout_s: A shard that has not beaten, or not advanced, for this long is dead (seconds).
        poll_s: Seconds between two looks at the store.
        duration_s: Stop after this long (0: run until stopped); reruns in flight are waited for.
        until_done: Also stop once every watched run has finished.
        rerun: Rerun dead shards here (a train-shard task run). Off: only fence and report.
        resume: Start a dead run (coordinator silent) again when it came from a deployment.
        start_timeout_s: How long a task may take to start beating (default max(2 x timeout, timeout + 30)); each
            start phase of a rank group (spawn, rendezvous, load, build) is timed from its own beat, at least its
            measured floor (docs/watchdog.md).
        credentials_block: Name of a Prefect Secret block holding the s3fs options of an s3:// store as JSON.
            Empty: the environment of the process that runs this flow (AWS_ACCESS_KEY_ID, ...).
        spec: The watched run's own spec (with run_id): reruns use it, never the store's.
        allow_workloads: Workloads (module:factory) a spec read from the store may name, beyond the built-ins.
        stop_key: Internal: a key of this process's stop events (ckpt train stops its watchdog so).
        since: Ignore heartbeats written before this wall time (seconds since the epoch): the watchdog beside
            one session of a run (ckpt train) judges that session, not a predecessor that died.
    """
    logger = get_run_logger()
    t0 = time.time()
    url = run_url(store, run_id) if run_id else store_url(check_url(store))
    if spec is not None and not run_id:
        raise ValueError("spec is the spec of one run: give run_id too")
    access = StoreAccess(block=credentials_block)
    stop = stop_event(stop_key) if stop_key else None
    futures: dict[str, Any] = {}
    ended: queue.Queue[str] = queue.Queue()

    def submit_rerun(req: RerunRequest) -> str:
        s = req.settings
        task = train_shard.with_options(task_run_name=rerun_name(req.shard, req.round, req.generation),
                                        retries=s.shard_retries, retry_delay_seconds=s.retry_delay_s)
        futures[req.key] = task.submit(
            run_url=req.run_url, spec=req.spec, shard=req.shard, round_no=req.round, cut=req.cut, access=access,
            keyframe_every=s.keyframe_every, chaos=s.chaos, heartbeat_every_s=s.heartbeat_every_s,
            heartbeat_events=s.heartbeat_events, attempt_offset=req.attempt_offset,
            shard_checkpoint_every=s.shard_checkpoint_every, local_tier=s.local_tier)
        futures[req.key].add_done_callback(lambda _f, k=req.key: ended.put(k))
        return req.key

    wd = Watchdog(url, storage_options(access), timeout_s=timeout_s, start_timeout_s=start_timeout_s,
                  rerun=submit_rerun if rerun else None,
                  resume=(lambda d: resume_from_deployment(d, logger)) if resume else None,
                  specs={url: spec} if spec is not None else None, allow_workloads=allow_workloads or (),
                  by=f"{watchdog_name()} ({_flow_run_label()})", by_flow_run_id=_flow_run_id(), since=since)
    logger.info("watching %s: dead after %g s without a beat or progress, a look every %g s%s", url, timeout_s,
                poll_s, f", for {duration_s:g} s" if duration_s > 0 else " until stopped")
    polls = 0
    try:
        polls = _watch(wd, logger, poll_s, duration_s, until_done, stop, futures, ended, t0, url)
    finally:
        _alive(url, "stopped")  # a watchdog that ends (even by an error) is not restarted by the keeper
    decisions = [d.to_dict() for d in wd.decisions]
    _table_artifact(url, wd.decisions)
    if stop_key:
        _STOPS.pop(stop_key, None)
    return {"url": url, "runs": sorted(wd.runs), "polls": polls, "seconds": round(time.time() - t0, 3),
            "decisions": decisions, "by": wd.by}


def _watch(wd: Watchdog, logger: Any, poll_s: float, duration_s: float, until_done: bool,
           stop: threading.Event | None, futures: dict[str, Any], ended: queue.Queue[str], t0: float,
           url: str) -> int:
    """The loop: look, publish decisions, settle ended reruns, beat; returns the number of looks."""
    polls, alive_at = 0, float("-inf")
    while True:
        if time.monotonic() - alive_at >= ALIVE_EVERY_S:
            alive_at = time.monotonic()
            _alive(url, "alive")
        for d in wd.poll():
            _publish(d, logger)
        polls += 1
        while not ended.empty():
            key = ended.get_nowait()
            f = futures.pop(key)
            try:
                res = f.result()
                logger.info("rerun %s ended: %s", key, res.status)
                done = wd.rerun_done(key, True, result=res)
            except Exception as e:  # noqa: BLE001 - the rerun failed after its retries, or was fenced itself
                if getattr(f.state, "name", None) == "Fenced":  # another generation owns the shard: not a failure
                    logger.info("rerun %s ended: fenced", key)
                    done = wd.rerun_done(key, True)
                else:
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
    return polls


def watchdog_resource(url: str) -> str:
    """The Prefect event resource of the watchdog of the store (root) ``url``: ``ckpt.watchdog.<slug>``."""
    return "ckpt.watchdog." + re.sub(r"[^a-z0-9-]+", "-", url.lower()).strip("-")


def _alive(url: str, kind: str) -> None:
    try:
        from prefect.events import emit_event

        emit_event(event=f"ckpt.watchdog.{kind}", resource={"prefect.resource.id": watchdog_resource(url),
                                                             "prefect.resource.name": f"watchdog of {url}",
                                                             "ckpt.store": url})
    except Exception:  # noqa: BLE001 - visibility must never stop the watchdog
        pass


def _flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:  # noqa: BLE001
        return None


def _flow_run_label() -> str:
    try:
        from prefect.runtime import flow_run

        return f"flow run {flow_run.name}"
    except Exception:  # noqa: BLE001
        return "no flow run"


# --- making decisions visible ---------------------------------------------------------------------------

def _publish(d: Decision, logger: Any) -> None:
    (logger.warning if d.kind in NOTABLE else logger.info)("%s", describe(d))
    _event(d)
    if d.kind in NOTABLE:
        try:
            from prefect.artifacts import create_markdown_artifact

            create_markdown_artifact(markdown=_markdown(d), description=f"watchdog: {d.kind} {d.part} of {d.run}")
        except Exception as e:  # noqa: BLE001 - visibility must never stop the watchdog
            logger.debug("artifact not created: %s", e)


def _event(d: Decision) -> None:
    try:
        from prefect.events import emit_event

        resource_id = f"ckpt.shard.{d.run}.{d.part}" if d.shard is not None else f"ckpt.run.{d.run}"
        emit_event(event=f"ckpt.watchdog.{d.kind}",
                   resource={"prefect.resource.id": resource_id, "ckpt.run-id": d.run, "ckpt.part": d.part},
                   payload=d.scalars())
    except Exception:  # noqa: BLE001
        pass


def _markdown(d: Decision) -> str:
    rows = [("decision", d.kind), ("run", f"`{d.run_url}`"), ("part", d.part), ("round", d.round),
            ("why", d.reason), ("dead generation / attempt", f"{d.dead_generation} / {d.dead_attempt}"),
            ("new generation", d.generation), ("last beat", _ts(d.last_beat)), ("detected", _ts(d.detected)),
            ("detection latency", f"{d.detection_latency_s} s"), ("steps lost", d.steps_lost), ("by", d.by)]
    if d.resumed is not None:
        link = flow_run_url(d.resumed.flow_run_id)
        name = f"flow run {d.resumed.flow_run_name}"
        rows.append(("started again", f"[{name}]({link})" if link else name))
    if d.flow_run_id and d.kind in ("run-dead", "resumed", "resume-failed"):
        link = flow_run_url(d.flow_run_id)
        rows.append(("dead flow run", f"[{d.flow_run_id}]({link})" if link else d.flow_run_id))
    rows.append(("reports", md_link("the run's checkpoints and verdicts", f"{d.run_url}/reports/index.html")))
    body = "\n".join(f"| {k} | {v} |" for k, v in rows if v is not None)
    return f"# Watchdog: {d.kind} {d.part}\n\n| | |\n|---|---|\n{body}\n"


def _ts(t: float | None) -> str | None:
    if not t:
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(t))) + f".{int((float(t) % 1) * 1000):03d} UTC"


def _table_artifact(url: str, decisions: list[Decision]) -> None:
    if not decisions:
        return
    try:
        from prefect.artifacts import create_table_artifact

        cols = ("kind", "run", "part", "round", "dead_generation", "generation", "state", "detection_latency_s",
                "running_again_s", "steps_lost", "reason")
        key = "watchdog-" + re.sub(r"[^a-z0-9-]+", "-", run_name(url).lower()).strip("-")[:60]
        create_table_artifact(table=[{c: d.to_dict().get(c) for c in cols} for d in decisions], key=key,
                              description=f"Watchdog decisions for {url}")
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":  # python -m flows.watchdog URL [--timeout-s S] [--duration-s S]
    import argparse
    import json

    from .api import prefect_api

    ap = argparse.ArgumentParser(prog="python -m flows.watchdog")
    ap.add_argument("store")
    ap.add_argument("--run-id", type=lambda v: check_run_id(v))
    ap.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    ap.add_argument("--poll-s", type=float, default=DEFAULT_POLL_S)
    ap.add_argument("--duration-s", type=float, default=0.0)
    a = ap.parse_args()
    with prefect_api():
        print(json.dumps(watchdog(a.store, a.run_id, a.timeout_s, a.poll_s, a.duration_s), indent=2, default=str))
