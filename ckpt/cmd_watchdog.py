"""``ckpt watchdog URL`` (the watchdog flow in the foreground) and ``ckpt status URL`` (each part's beat).

``watchdog`` runs ``flows.watchdog.watchdog`` here against ``PREFECT_API_URL`` (or a temporary local
Prefect server): every decision is printed as it is made, and the summary at the end. Ctrl-C stops
it after the current look (a rerun in flight is waited for). It reruns only built-in workloads and
those named with ``--allow-workload`` (a store cannot make it run code). ``status`` reads the store
only (no Prefect): the coordinator and every shard of each run, with the state the watchdog would
give them now (``trainrun.watchdog.assess_run``), and the fences so far with their reasons.
``docs/watchdog.md`` has the details.

Exit codes: 0 done; 2 bad arguments or nothing to watch; 3 the store cannot be reached.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from typing import Annotated, Any, Optional

import typer

from .app import app
from .common import STORAGE_OPTIONS_HELP, fail, storage_options_or_exit, url_or_exit

STATE_STYLE = {"running": "green", "finished": "green", "done": "green", "waiting": "dim", "replaced": "yellow",
               "fenced": "magenta", "failed": "red", "silent": "bold red", "stalled": "bold red", "lost": "bold red",
               "missing": "bold red", "dead": "bold red"}


@app.command("watchdog")
def watchdog(
    url: Annotated[str, typer.Argument(help="A store root holding runs (./runs, s3://bucket/runs) or one run's URL.")],
    run_id: Annotated[Optional[str], typer.Option("--run-id", metavar="ID", help="Watch only <URL>/<ID>.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", metavar="S", min=0.1,
                                           help="A shard silent or not advancing this long is dead.")] = 30.0,
    poll: Annotated[float, typer.Option("--poll", metavar="S", min=0.05, help="Seconds between two looks.")] = 2.0,
    duration: Annotated[float, typer.Option("--duration", metavar="S", min=0,
                                            help="Stop after S seconds (0: until Ctrl-C).")] = 0.0,
    until_done: Annotated[bool, typer.Option("--until-done", help="Stop once every watched run has finished.")] = False,
    no_rerun: Annotated[bool, typer.Option("--no-rerun", help="Only fence and report; rerun nothing here.")] = False,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="Do not start dead deployment runs again.")] = False,
    start_timeout: Annotated[Optional[float], typer.Option("--start-timeout", metavar="S",
                                                           help="How long a task may take to start beating, and each "
                                                                "start phase of a rank group at least its floor "
                                                                "(default max(2 x timeout, timeout + 30)).")] = None,
    allow_workload: Annotated[Optional[list[str]], typer.Option(
        "--allow-workload", metavar="module:factory",
        help="A workload a store's runs may name that this watchdog reruns (repeatable); the built-ins "
             "always are. Any other is reported, never imported.")] = None,
    storage_options: Annotated[Optional[str], typer.Option("--storage-options", metavar="@FILE|JSON",
                                                           help=STORAGE_OPTIONS_HELP)] = None,
    credentials_block: Annotated[Optional[str], typer.Option("--credentials-block", metavar="NAME",
                                                             help="A Prefect Secret block holding the s3fs options.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Watch training runs: fence silent or stuck shards and rerun them from the last checkpoint."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    from ckptlib.errors import StoreError
    from ckptlib.store import Store
    from trainrun.credentials import export_storage_options
    from trainrun.layout import check_run_id, child_url, find_runs, run_url, store_url

    url = url_or_exit(url)
    try:
        target = run_url(url, check_run_id(run_id)) if run_id is not None else store_url(url)
    except ValueError as e:
        fail(str(e))
    so = storage_options_or_exit(storage_options)
    export_storage_options(storage_options)  # the flow (no secret in its parameters) reads them from the environment
    try:
        runs = [child_url(target, p) for p in find_runs(Store.from_url(target, so))]
    except StoreError as e:
        fail(str(e), 3)
    typer.echo(f"watching {len(runs)} run(s) under {url}" + (f": {', '.join(r.rsplit('/', 1)[-1] for r in runs)}"
                                                           if runs else " (none yet: new runs are picked up)"))
    from flows.api import PrefectAPI
    from flows.watchdog import stop_event
    from flows.watchdog import watchdog as watchdog_flow
    from trainrun.watchdog import Decision, describe

    key = f"cli-{uuid.uuid4().hex[:8]}"
    stop = stop_event(key)
    previous = signal.signal(signal.SIGINT, lambda *_: (typer.echo("stopping after this look...", err=True), stop.set()))
    api = PrefectAPI()
    try:
        with api.use():
            summary = watchdog_flow(store=url, run_id=run_id, timeout_s=timeout, poll_s=poll, duration_s=duration,
                                    until_done=until_done, rerun=not no_rerun, resume=not no_resume,
                                    start_timeout_s=start_timeout, credentials_block=credentials_block,
                                    allow_workloads=list(allow_workload or []), stop_key=key)
    except Exception as e:  # noqa: BLE001
        fail(f"the watchdog failed: {type(e).__name__}: {e}", 1)
    finally:
        signal.signal(signal.SIGINT, previous)
        api.stop()
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    ds = summary["decisions"]
    typer.echo(f"watchdog done: {summary['polls']} looks in {summary['seconds']:.0f} s, {len(ds)} decision(s)")
    for d in ds:
        typer.echo(f"  {d['kind']:14s} {describe(Decision.from_dict(d))}")


# --- status -------------------------------------------------------------------------------------------

def status_of(url: str, storage_options: dict | None = None, *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Every run under ``url``: ``{"url", "run", "state", "committed", "coordinator", "parts": [...], "fences": [...]}``."""
    from ckptlib.store import Store
    from trainrun.layout import child_url, find_runs
    from trainrun.watchdog import assess_run, read_fences

    root = Store.from_url(url, storage_options)
    out = []
    for prefix in find_runs(root):
        store = root.child(prefix) if prefix else root
        run = child_url(url, prefix)
        view = assess_run(store, run, timeout_s=timeout_s)
        fences = [f.to_dict() for part in sorted(store.list_dirs("fences")) for f in read_fences(store, part)]
        c = view.coordinator
        phase = view.info.phase if view.info is not None else None
        out.append({"url": run, "run": view.run, "state": view.state, "committed": view.committed,
                    "coordinator": c.row() | {"phase": phase} if c else None,
                    "parts": [p.row() | rank_rows(store, p.part) for p in view.shards], "fences": fences})
    return out


def rank_rows(store: Any, part: str) -> dict[str, Any]:
    """A group's part (``--ranks-per-shard`` > 1): ``{"rank": 0, "ranks": [one row per rank of its
    group], "foreign_beats": n}``, each row with its ``part`` and ``rank`` (rank 0's is the part's own
    beat), ``n`` the beats there of no rank of the group (counted, not read); ``{}`` for one process."""
    from ckptlib.heartbeat import read_rank_heartbeats

    beats = read_rank_heartbeats(store, part)
    if 0 not in beats:  # the part's beat is one process's (rank rows, if any, are of an earlier session)
        return {}
    now = time.time()
    return {"rank": 0, "ranks": [{"part": part, "rank": r, "status": b.status, "generation": b.generation,
                                  "attempt": b.attempt, "round": b.round, "step": b.step, "round_step": b.round_step,
                                  "steps_per_round": b.steps_per_round, "age_s": b.age(now), "pid": b.pid,
                                  "host": b.host, "error": b.error} for r, b in beats.items()],
            "foreign_beats": beats.ignored}


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def render_status(runs: list[dict[str, Any]]):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    items: list[Any] = []
    if not runs:
        items.append(Text("no run here (a run is a folder with manifests/ or heartbeats/)", style="dim"))
    for r in runs:
        c = r["coordinator"]
        head = Text.assemble(("run ", "bold"), (r["run"], "bold cyan"), "  ", (r["state"], STATE_STYLE.get(r["state"], "")),
                             f"  committed step {r['committed'] if r['committed'] is not None else '-'}")
        if c:
            head.append(f"  coordinator: round {c['round']} ({c.get('phase') or '-'}), last beat {_age(c['age_s'])} ago")
            if c.get("reason"):
                head.append(f" - {c['reason']}", style="red")
        items.append(head)
        t = Table(box=None, pad_edge=False, header_style="dim")
        for col in ("part", "state", "gen", "attempt", "round", "step", "last beat", "process", "note"):
            t.add_column(col, justify="right" if col in ("gen", "attempt", "round", "step", "last beat") else "left")
        for p in r["parts"]:
            step = "-" if p["round_step"] is None else f"{p['round_step']}/{p['steps_per_round']}"
            gen = str(p["live"]) if p["generation"] in (None, p["live"]) else f"{p['generation']}->{p['live']}"
            proc = f"{p['pid']}@{p['host']}" if p["pid"] else "-"
            t.add_row(p["part"], Text(p["state"], style=STATE_STYLE.get(p["state"], "")), gen, str(p["attempt"] or "-"),
                      str(p["round"] if p["round"] is not None else "-"), step,
                      _age(p["age_s"]) + (" ago" if p["age_s"] is not None else ""), proc, p["reason"] or "")
            for k in p.get("ranks", [])[1:]:  # the group's other ranks, under its part
                rstep = "-" if k["round_step"] is None else f"{k['round_step']}/{k['steps_per_round']}"
                t.add_row(f"  rank {k['rank']}", Text(k["status"], style="dim"), str(k["generation"]),
                          str(k["attempt"] or "-"), str(k["round"]), rstep, _age(k["age_s"]) + " ago",
                          f"{k['pid']}@{k['host']}", k["error"] or "")
            if p.get("foreign_beats"):
                t.add_row("", Text(f"{p['foreign_beats']} foreign heartbeats ignored", style="yellow"))
        items.append(t)
        for f in r["fences"]:
            lat = f.get("detection_latency_s")
            items.append(Text(f"  fence {f['part']} g{f['generation']} at {time.strftime('%H:%M:%S', time.localtime(f.get('time') or 0))}"
                              f" by {f.get('by') or '?'}: {f.get('reason') or '-'}"
                              + (f" (detected {lat:.1f} s after its last sign of life)" if lat is not None else ""),
                              style="dim"))
        items.append(Text(""))
    return Group(*items)


@app.command("status")
def status(
    url: Annotated[str, typer.Argument(help="A run's URL or a store root holding runs.")],
    timeout: Annotated[float, typer.Option("--timeout", metavar="S", min=0.1,
                                           help="Call a shard silent after S seconds without a beat.")] = 30.0,
    storage_options: Annotated[Optional[str], typer.Option("--storage-options", metavar="@FILE|JSON",
                                                           help=STORAGE_OPTIONS_HELP)] = None,
    watch: Annotated[Optional[float], typer.Option("--watch", metavar="S", help="Refresh every S seconds until Ctrl-C.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Each shard's last beat (age), step, generation and state, per run; the fences and why."""
    from ckptlib.errors import StoreError
    from trainrun.layout import store_url

    so = storage_options_or_exit(storage_options)
    target = store_url(url_or_exit(url))
    try:
        runs = status_of(target, so, timeout_s=timeout)
    except StoreError as e:
        fail(str(e), 3)
    if as_json:
        print(json.dumps(runs, indent=2, default=str))
        return
    from rich.console import Console

    console = Console()
    if not watch:
        console.print(render_status(runs))
        return
    from rich.live import Live

    with Live(render_status(runs), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(watch)
                live.update(render_status(status_of(target, so, timeout_s=timeout)))
        except KeyboardInterrupt:
            pass
