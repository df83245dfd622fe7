"""``ckpt train``: run the ``train-run`` flow here, with live progress and a summary.

With no arguments it trains ``tinylm`` (small) with 2 shards for 8 rounds on this machine, stores
checkpoints under ``./runs/<run-id>`` and uses Prefect's ephemeral API (or the server in
``PREFECT_API_URL``). Progress comes from the store itself (heartbeats, manifests, verdicts:
``ckpt/progress.py``), so it looks the same whichever task runner trains the shards; a watchdog
runs beside the run (``ckpt/beside.py``). The options are ``ckpt/train_options.py``'s
``TrainOptions``. The last line is ``digest: <hex>``, the logical digest of the final checkpoint.

``--resume --run-id R --store S`` is enough to continue a run: its trajectory (workload, sizes,
seed, shards, steps per round, ...) and its rounds come from the run itself; an option typed again
is checked against the run, and one that would change its trajectory is refused by name, before
Prefect starts.

Exit codes: 0 done (every committed checkpoint validated); 1 the run failed, or a checkpoint failed
validation (one ``error:`` line naming the step, its checks and the last healthy step; the run stops
after the round in flight); 2 refused before training (bad option, existing run without
--resume, changed config).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import typer

from .app import app
from .common import WORKLOAD_EXTRA_EXAMPLE, fail, parse_json_object, storage_options_or_exit
from .progress import loss_text, size_text
from .train_options import TrainOptions, options_command, trajectory_fields

if TYPE_CHECKING:
    from flows.api import PrefectAPI
    from flows.params import TrainParams


@app.command("train")
@options_command
def train(o: TrainOptions, given: frozenset[str]) -> None:
    """Train a model as a Prefect flow with incremental, validated checkpoints (see docs/training.md)."""
    t_start = time.perf_counter()
    _quiet_prefect(o.verbose)
    params, so = _params_or_exit(o)
    # Before Prefect is even imported: whether the run may start (and a resume's own settings); the
    # flow's plan-run checks the same again (deployments reach it without this command).
    params = _refuse_early(params, so, given)
    from flows.api import PrefectAPI

    api = PrefectAPI()  # the temporary Prefect server (when PREFECT_API_URL is unset)
    t_ready = time.perf_counter()
    summary, failure, guard, (t_flow_call, t_flow_end) = _run_flow(api, params, so, o)
    t_end = time.perf_counter()
    sec = summary["seconds"]
    sec["cli_total"] = round(t_end - t_start, 3)
    sec["startup"] = round(t_ready - t_start, 3)  # options, imports, the resume/refusal check
    sec["prefect_api_wait"] = round(t_flow_call - t_ready, 3)  # the temporary server, beyond start-up
    sec["prefect_flow_start_stop"] = round(max(0.0, (t_flow_end - t_flow_call) - sec["flow"]), 3)
    sec["prefect_api_stop"] = round(t_end - t_flow_end, 3)
    sec["prefect_start_stop"] = round(sec["prefect_api_wait"] + sec["prefect_flow_start_stop"] + sec["prefect_api_stop"], 3)
    if guard is not None:
        summary["watchdog"] = guard.decisions()
    from rich.console import Console

    _print_summary(Console(), summary, params)
    if o.json_out:
        with open(o.json_out, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    # The interpreter's final garbage collection of everything Prefect, torch and the run left behind
    # takes seconds; nothing needs finalising any more (stores closed, Prefect drained): skip it.
    import gc

    gc.freeze()
    if summary.get("cancelled"):  # a state, not an error: the line says what was kept and how to continue
        typer.echo(summary["cancelled"], err=True)
        raise typer.Exit(1)
    if failure is not None:
        fail(failure, 1)
    if summary["failed_validation"]:
        raise typer.Exit(1)


def _quiet_prefect(verbose: bool) -> None:
    """Prefect's console logs stay under the live table unless ``--verbose``; no analytics."""
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_FLOW_RUNS_LEVEL", "WARNING")
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_TASK_RUNS_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")


def _params_or_exit(o: TrainOptions) -> tuple[TrainParams, dict[str, Any] | None]:
    """The flow's parameter and the s3fs options from the options; a bad one: one error line, exit 2."""
    from pydantic import ValidationError

    from trainrun.chaos import check_runner
    from trainrun.credentials import check_url, export_storage_options
    from trainrun.layout import check_run_id, new_run_id

    try:
        check_url(o.store)
        if o.run_id is not None:
            check_run_id(o.run_id)
        extra = parse_json_object(o.workload_extra, "--workload-extra", WORKLOAD_EXTRA_EXAMPLE) or {}
    except ValueError as e:
        fail(str(e))
    so = storage_options_or_exit(o.storage_options)
    export_storage_options(o.storage_options)  # for the watchdog beside the run (a flow: no secret in its parameters)
    if o.resume and not o.run_id:
        fail("--resume needs --run-id ID (and the same --store) of the run to continue")
    try:
        params = o.params(o.run_id or new_run_id(), extra, so)
    except ValidationError as e:
        fail("; ".join(f"{'.'.join(map(str, err['loc'])) or 'params'}: {err['msg']}" for err in e.errors()))
    try:
        check_runner(params.chaos, params.task_runner, params.ranks_per_shard)
    except ValueError as e:
        fail(str(e))
    if params.chaos and o.no_watchdog and any(c.split(":")[0] in ("hang", "zombie") for c in params.chaos):
        typer.echo("note: --chaos hang/zombie with --no-watchdog: the run waits until an external watchdog "
                   "(ckpt watchdog, the watchdog deployment) fences the shard", err=True)
    return params, so


def _refuse_early(params: TrainParams, so: dict[str, Any] | None, given: frozenset[str]) -> TrainParams:
    """Refuse before Prefect starts what the flow's plan-run would refuse (an unknown workload, an
    existing run without --resume, a changed trajectory): one error line, exit 2. A resume returns
    the parameters with the run's own trajectory for every trajectory option not ``given``, and the
    run's rounds unless ``--rounds`` was."""
    from ckptlib import Checkpointer, CheckpointError
    from trainrun.errors import RunRefused
    from trainrun.layout import run_url
    from trainrun.resume import where_to_start
    from workloads import resolve_factory

    assert params.run_id is not None
    try:
        if params.credentials_block is None:  # a Secret block needs the Prefect API: the flow's plan-run checks then
            with Checkpointer(run_url(params.store, params.run_id), so) as ck:
                plan = where_to_start(ck, params.spec(), resume=params.resume, run_id=params.run_id,
                                      given=trajectory_fields(given) if params.resume else None)
                rounds = _stored_rounds(ck) if params.resume and "rounds" not in given else None
            chosen = {"given": sorted(trajectory_fields(given))} if params.resume else {}
            params = params.model_copy(update={**(plan.config or {}), **({"rounds": rounds} if rounds else {}),
                                               **chosen})
            if params.resume:
                typer.echo(f"{params.run_id}: {plan.note}" + (f"; {params.rounds} rounds, as the run was started"
                                                              if rounds else ""))
        resolve_factory(params.workload)
    except (RunRefused, CheckpointError, ValueError, ImportError) as e:
        fail(str(e))
    return params


def _stored_rounds(ck: Any) -> int | None:
    """The rounds the run's latest checkpoint was trained towards (its manifest's ``meta.params``)."""
    steps = ck.steps()
    if not steps:
        return None
    rounds = (ck.manifest(steps[-1]).meta.get("params") or {}).get("rounds")
    return rounds if isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1 else None


def _run_flow(api: PrefectAPI, params: TrainParams, so: dict[str, Any] | None,
              o: TrainOptions) -> tuple[dict[str, Any], str | None, Any, tuple[float, float]]:
    """The ``train-run`` flow here (the live table, the watchdog beside it); its summary, the line
    saying why it is not healthy (a failed validation, ``RunFailed``), the watchdog, and when the flow
    was called and returned. A run that failed otherwise: one error line naming how to resume."""
    from rich.console import Console
    from rich.live import Live

    from flows.cancel import RunCancelled
    from flows.train import RunFailed, train_run
    from trainrun.errors import RunRefused
    from trainrun.layout import run_url

    from .beside import BesideWatchdog
    from .progress import Progress

    assert params.run_id is not None
    live = not o.verbose and Console().is_terminal
    progress = Progress(run_url(params.store, params.run_id), so, params)
    summary, failure, error, guard = None, None, None, None
    t_flow_call = t_flow_end = time.perf_counter()
    try:
        with api.use():
            if not o.no_watchdog:
                guard = BesideWatchdog(params, o.watchdog_timeout).start()
            t_flow_call = time.perf_counter()
            try:
                if live:
                    progress.start()
                    with Live(progress, console=Console(), refresh_per_second=2, transient=False):
                        summary = train_run(params)
                else:
                    summary = train_run(params)
            finally:
                if guard is not None:
                    guard.stop()
            t_flow_end = time.perf_counter()
    except (RunFailed, RunCancelled) as e:  # it ran; a step failed validation, or it was cancelled: the summary, the line
        summary, failure = e.summary, str(e)
        t_flow_end = time.perf_counter()
    except RunRefused as e:
        error = (str(e), 2)
    except KeyboardInterrupt:
        error = (f"interrupted; continue with: ckpt train --resume --run-id {params.run_id} --store {params.store}", 1)
    except Exception as e:  # noqa: BLE001 - the run failed: say why, and how to continue
        error = (f"the run failed: {type(e).__name__}: {e}. Continue it with: ckpt train --resume --run-id "
                 f"{params.run_id} --store {params.store}", 1)
    finally:
        api.stop()
        if live:
            progress.stop()
    if error is not None:
        fail(*error)
    assert summary is not None
    return summary, failure, guard, (t_flow_call, t_flow_end)


def _ending(s: dict) -> str:
    if s.get("cancelled"):
        return "[yellow]ended CANCELLED[/]"
    return "[red]ended FAILED[/]" if s.get("failure") else "done"


def _print_summary(console, s: dict, params) -> None:
    sec = s["seconds"]
    total = sec["cli_total"]
    flow = sec["flow"]
    ratio = s["full_copy_bytes"] / max(s["bytes_written"], 1)
    committed = s["committed"]
    lines = [
        f"[bold]run {s['run_id']}[/] {_ending(s)} in {total:.1f} s "
        f"(flow {flow:.1f} s)" + (f" — {s['note']}" if s["resumed"] else ""),
        f"  rounds done     {s['rounds_done']} this session (step {s['start_step']} -> {s['final_step']} of {s['rounds']})",
        f"  final loss      {loss_text(s['final_loss'])} (eval {loss_text(s['final_eval_loss'])})",
        f"  checkpoints     {len(committed)} committed" + (f" (steps {committed[0]}..{committed[-1]})" if committed else "")
        + f", {len(s['validated'])} validated" + (f", [red]{len(s['failed_validation'])} FAILED validation "
                                                  f"{s['failed_validation']}[/]" if s["failed_validation"] else ""),
        f"  bytes written   {size_text(s['bytes_written'])} against {size_text(s['full_copy_bytes'])} of full copies "
        f"({ratio:.2f}x smaller)",
        f"  time            training {sec['train'] + sec['build']:.1f} s, checkpoint save {sec['save']:.1f} s "
        f"({sec['save'] / total:.1%}), restore {sec['restore']:.1f} s ({sec['restore'] / total:.1%}), Prefect "
        f"overhead {sec['prefect']:.1f} s in the flow + {sec['prefect_start_stop']:.1f} s start/stop "
        f"({(sec['prefect'] + sec['prefect_start_stop']) / total:.1%}), validation tail {sec['validation_wait']:.1f} s"
        + (f", waiting for the watchdog {sec['watchdog_wait']:.1f} s (fence + rerun)" if sec.get("watchdog_wait") else ""),
        f"  checkpoints at  {s['run_url']}   (ckpt ls {s['run_url']})",
        f"  reports         {s['run_url']}/reports/<step>/  (final: {s['run_url']}/reports/{s['final_step']}/)",
    ]
    from trainrun.watchdog import Decision, describe
    from trainrun.watchdog.decisions import SUMMARY

    from .progress import summary_lines

    lines += summary_lines(s)
    for d in s.get("watchdog") or []:
        if d["kind"] in SUMMARY:
            lines.append(f"  watchdog        {describe(Decision.from_dict(d))}")
    if s.get("lineage"):
        lines.append(f"  lineage         branched from step {s['lineage'].get('step')} of {s['lineage'].get('run')}")
    if s.get("predecessor"):
        p = s["predecessor"]
        lines.append(f"  continues       flow run {p.get('name') or p.get('flow_run_id')} "
                     f"({'it died' if p.get('status') == 'running' else 'it ended ' + str(p.get('status'))})")
    if s.get("cancelled"):
        lines.append(f"  cancelled       {s['cancelled']}")
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
    # plain print: the one line scripts and tests parse
    print(f"digest: {s['final_digest']}", flush=True)
