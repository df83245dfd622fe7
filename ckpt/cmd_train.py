"""``ckpt train``: run the ``train-run`` flow here, with live progress and a summary.

With no arguments it trains ``tinylm`` (small) with 2 shards for 8 rounds on this machine, stores
checkpoints under ``./runs/<run-id>`` and uses Prefect's ephemeral API (or the server in
``PREFECT_API_URL``). Progress comes from the store itself (heartbeats, manifests, verdicts), so it
looks the same whichever task runner trains the shards. The last line is ``digest: <hex>``, the
logical digest of the final checkpoint.

Exit codes: 0 done (every committed checkpoint validated); 1 the run failed, or a checkpoint failed
validation; 2 refused before training (bad option, existing run without --resume, changed config).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from .cli import app
from .common import STORAGE_OPTIONS_HELP, WORKLOAD_EXTRA_EXAMPLE, fail, parse_json_object, storage_options_or_exit

if TYPE_CHECKING:
    from ckptlib.heartbeat import Beat
    from ckptlib.validate import Verdict


# --- live progress (polls the store; independent of where the shards run) --------------------------

class Progress:
    """Reads heartbeats, manifests and verdicts of one run every ``every_s`` seconds (own thread)."""

    def __init__(self, url: str, storage_options: dict | None, params: Any, every_s: float = 0.5):
        self.url, self.so, self.params, self.every_s = url, storage_options, params, every_s
        self.beats: dict[str, Beat] = {}
        self.manifests: dict[int, dict] = {}
        self.verdicts: dict[int, Verdict] = {}
        self.error: str | None = None
        self._store = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-train-progress", daemon=True)
        self.started = time.time()

    def start(self) -> Progress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.poll()  # the final state
        except Exception:  # noqa: BLE001 - the display must never break the run
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the display must never break the run
                self.error = f"{type(e).__name__}: {e}"

    def poll(self) -> None:
        from ckptlib import commit
        from ckptlib.heartbeat import read_heartbeats
        from ckptlib.store import Store
        from ckptlib.validate import read_verdict

        if self._store is None:
            self._store = Store.from_url(self.url, self.so)
        store = self._store
        self.beats = {p: b for p, b in read_heartbeats(store).items() if b.time >= self.started - 1}
        for step in commit.committed_steps(store):
            if step not in self.manifests:
                m = commit.read_manifest(store, step)
                self.manifests[step] = {"step": step, "bytes_written": m.bytes_written,
                                        "logical_bytes": m.logical_bytes, "kind": m.kind, "digest": m.digest,
                                        "loss": m.meta.get("loss"), "eval_loss": m.meta.get("eval_loss")}
        for step in self.manifests:
            if step not in self.verdicts:
                verdict = read_verdict(store, step)
                if verdict is not None:
                    self.verdicts[step] = verdict

    # rich renderable
    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        p = self.params
        done_rounds = max([b.round for b in self.beats.values() if b.status == "finished"] +
                          list(self.manifests), default=0)
        head = Text.assemble(("training ", "bold"), (f"{p.workload}", "cyan"),
                             f" · {p.shards} shards · {p.rounds} rounds × {p.steps_per_round} steps · ",
                             (self.url, "dim"), f"   {time.time() - self.started:5.0f} s")
        shards = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
        for col in ("shard", "round", "step", "loss", "status", "attempt", "gen"):
            shards.add_column(col, justify="right" if col not in ("shard", "status") else "left")
        for part in sorted(self.beats, key=lambda s: (len(s), s)):
            b = self.beats[part]
            bar = "-" if b.round_step is None else f"{b.round_step}/{b.steps_per_round or p.steps_per_round}"
            style = {"running": "yellow", "finished": "green", "failed": "red", "fenced": "magenta"}.get(b.status, "")
            shards.add_row(part, str(b.round), bar, _f(b.loss), Text(b.status, style=style),
                           str(b.attempt or "-"), str(b.generation))
        cks = Table(box=None, pad_edge=False, header_style="dim")
        for col in ("step", "loss", "eval", "written", "full copy", "ratio", "kind", "valid"):
            cks.add_column(col, justify="right")
        for step in sorted(self.manifests)[-12:]:
            m = self.manifests[step]
            v = self.verdicts.get(step)
            vt = Text("…", style="dim") if v is None else (Text("✓", style="green") if v.passed
                                                          else Text("✗ " + ",".join(v.failed), style="red"))
            cks.add_row(str(step), _f(m["loss"]), _f(m["eval_loss"]), _bytes(m["bytes_written"]),
                        _bytes(m["logical_bytes"]), f"{m['logical_bytes'] / max(m['bytes_written'], 1):.2f}x",
                        m["kind"], vt)
        from rich.progress_bar import ProgressBar
        from rich.table import Table as Grid

        bar = Grid.grid(padding=(0, 1))
        bar.add_row(Text(f"rounds {done_rounds}/{p.rounds}", style="bold"),
                    ProgressBar(total=p.rounds, completed=done_rounds, width=40))
        parts = [head, bar, shards, Text("checkpoints", style="bold"), cks]
        if self.error:
            parts.append(Text(f"(progress display: {self.error})", style="dim"))
        return Group(*parts)


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.4f}"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


# --- the watchdog beside the run -------------------------------------------------------------------

# A shard on a work pool is a flow run: a worker polls for it, then starts a fresh Python process that
# imports Prefect and torch (40 s measured on a loaded 2-core machine); a Dask worker process imports
# them with its first task (over 34 s measured in CI with two test workers on 2 cores: both shards of
# round 1 were fenced as never started). Until a shard's first beat the watchdog beside a run on
# processes allows this long; threads share the flow's imports and keep the default start timeout,
# max(2 x timeout, timeout + 30).
POOL_START_TIMEOUT_S = 120.0


class BesideWatchdog:
    """The ``watchdog`` flow for this one run, in a thread of this process (its own flow run in the
    UI): it fences a hung or silent shard and reruns it here, with this run's own spec (never one
    read from the store), so a local run recovers with nothing else started. Stopped when the
    training flow returns. Credentials: this process's environment (``CKPT_STORAGE_OPTIONS``)."""

    def __init__(self, params: Any, timeout_s: float, start_timeout_s: float | None = None):
        import contextvars
        import uuid

        from flows.watchdog import stop_event

        self.params, self.timeout_s = params, timeout_s
        if start_timeout_s is None and str(params.task_runner) != "threads":
            start_timeout_s = max(POOL_START_TIMEOUT_S, 2 * timeout_s)
        self.start_timeout_s = start_timeout_s
        self.key = f"train-{params.run_id}-{uuid.uuid4().hex[:6]}"
        self.stop_flag = stop_event(self.key)
        self.summary: dict | None = None
        self.error: BaseException | None = None
        self._ctx = contextvars.copy_context()  # the Prefect API settings of `api.use()`
        self._thread = threading.Thread(target=self._run, name="ckpt-watchdog", daemon=True)

    def _run(self) -> None:
        from flows.watchdog import watchdog

        p = self.params
        try:
            self.summary = self._ctx.run(
                watchdog, store=p.store, run_id=p.run_id, timeout_s=self.timeout_s, start_timeout_s=self.start_timeout_s,
                poll_s=min(2.0, max(0.2, self.timeout_s / 8)), duration_s=0, credentials_block=p.credentials_block,
                spec=p.spec(), stop_key=self.key)
        except BaseException as e:  # noqa: BLE001 - reported with the summary; the run goes on
            self.error = e

    def start(self) -> BesideWatchdog:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.stop_flag.set()
        self._thread.join(timeout=timeout_s)

    def decisions(self) -> list[dict]:
        if self.error is not None:
            typer.echo(f"warning: the watchdog beside the run failed: {type(self.error).__name__}: {self.error}", err=True)
        return list((self.summary or {}).get("decisions") or [])


# --- the command ----------------------------------------------------------------------------------

# ``ckpt train``'s options are ``flows.params.TrainParams`` fields (the one schema: trajectory
# ``RunSpec``, ``RunSettings``, where the run lives). Their defaults are written here too, for
# ``--help``, so that starting ``ckpt`` does not import pydantic; a test checks every one against
# the schema (tests/test_train_units.py). Bounds are the schema's: TrainParams validates.
CLI_FIELDS = {"store": "store", "run_id": "run_id", "workload": "workload", "size": "workload_size",
              "workload_extra": "workload_extra", "batch_size": "batch_size", "lr": "lr", "seed": "seed",
              "shards": "shards", "steps_per_round": "steps_per_round", "outer_lr": "outer_lr",
              "outer_momentum": "outer_momentum", "torch_threads": "torch_threads", "rounds": "rounds",
              "checkpoint_every": "checkpoint_every", "keyframe_every": "keyframe_every", "resume": "resume",
              "task_runner": "task_runner", "chaos": "chaos", "heartbeat_every": "heartbeat_every_s",
              "storage_options": "storage_options", "credentials_block": "credentials_block"}


@app.command("train")
def train(
    store: Annotated[str, typer.Option("--store", metavar="URL", help="Where runs live: a directory, "
                                       "file:///abs/path or s3://bucket/prefix; checkpoints go to <store>/<run-id>.")] = "./runs",
    run_id: Annotated[Optional[str], typer.Option("--run-id", metavar="ID", help="Run id (default: date + short uuid).")] = None,
    workload: Annotated[str, typer.Option("--workload", metavar="NAME|module:factory",
                                          help="tinylm, recsys, finetune, finetune-bf16, or package.module:factory.")] = "tinylm",
    size: Annotated[str, typer.Option("--size", help="Workload size preset: small | bench.")] = "small",
    workload_extra: Annotated[Optional[str], typer.Option("--workload-extra", metavar="JSON",
                                                          help="Workload knobs as a JSON object, e.g. '{\"d_model\": 64}'.")] = None,
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", help="Per-shard batch size (default: the workload's).")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Inner learning rate (default: the workload's).")] = None,
    shards: Annotated[int, typer.Option("--shards", help="Data-parallel shards.")] = 2,
    rounds: Annotated[int, typer.Option("--rounds", help="Total rounds (a resume may extend the run).")] = 8,
    steps_per_round: Annotated[int, typer.Option("--steps-per-round", help="Inner steps H per shard and round.")] = 150,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Commit a checkpoint every C rounds (and after the last).")] = 1,
    keyframe_every: Annotated[int, typer.Option("--keyframe-every", help="At most K-1 deltas per chunk before a keyframe (chains also end once their deltas add up to twice a keyframe).")] = 32,
    seed: Annotated[int, typer.Option("--seed", help="Run seed.")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run --run-id from its last healthy checkpoint.")] = False,
    task_runner: Annotated[str, typer.Option("--task-runner", metavar="threads|dask|dask://HOST:PORT|pool:FLOW/DEPLOYMENT",
                                             help="Where shard tasks run (docs/scale.md).")] = "threads",
    storage_options: Annotated[Optional[str], typer.Option("--storage-options", metavar="@FILE|JSON",
                                                           help=STORAGE_OPTIONS_HELP)] = None,
    credentials_block: Annotated[Optional[str], typer.Option("--credentials-block", metavar="NAME",
                                                             help="A Prefect Secret block holding the s3fs options "
                                                                  "(instead of --storage-options).")] = None,
    chaos: Annotated[Optional[list[str]], typer.Option("--chaos", metavar="KIND:shard=I,round=R",
                                                       help="Inject a fault: crash, hang, zombie, stall, kill or stop:shard=I,round=R[,step=K][,attempt=A] "
                                                            "(repeatable; kill and stop need --task-runner dask; see docs/watchdog.md).")] = None,
    outer_lr: Annotated[float, typer.Option("--outer-lr", help="Outer learning rate (1 = averaging).")] = 1.0,
    outer_momentum: Annotated[float, typer.Option("--outer-momentum", help="Outer Nesterov momentum (0 = none).")] = 0.0,
    torch_threads: Annotated[int, typer.Option("--torch-threads", help="torch threads per process (part of the config).")] = 1,
    no_validate: Annotated[bool, typer.Option("--no-validate", help="Skip validation (then no checkpoint is healthy: resume restarts).")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="PATH", help="Also write the summary as JSON to PATH.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show Prefect's log lines instead of the live table.")] = False,
    heartbeat_every: Annotated[float, typer.Option("--heartbeat-every", metavar="S",
                                                   help="Seconds between a shard's heartbeats.")] = 2.0,
    no_watchdog: Annotated[bool, typer.Option("--no-watchdog", help="Run no watchdog beside the run (leave hung or "
                                              "dead shards to `ckpt watchdog` or the watchdog deployment).")] = False,
    watchdog_timeout: Annotated[float, typer.Option("--watchdog-timeout", metavar="S", min=0.1,
                                                    help="The watchdog declares a shard dead after S seconds "
                                                         "without a beat or progress.")] = 30.0,
) -> None:
    """Train a model as a Prefect flow with incremental, validated checkpoints (see docs/training.md)."""
    t_start = time.perf_counter()
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_FLOW_RUNS_LEVEL", "WARNING")
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_TASK_RUNS_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")

    from pydantic import ValidationError

    from flows.params import TrainParams
    from trainrun.credentials import StorageOptions, check_url, export_storage_options
    from trainrun.layout import check_run_id, new_run_id, run_url

    try:
        check_url(store)
        if run_id is not None:
            check_run_id(run_id)
        extra = parse_json_object(workload_extra, "--workload-extra", WORKLOAD_EXTRA_EXAMPLE) or {}
    except ValueError as e:
        fail(str(e))
    so = storage_options_or_exit(storage_options)
    export_storage_options(storage_options)  # for the watchdog beside the run (a flow: no secret in its parameters)
    if resume and not run_id:
        fail("--resume needs --run-id ID (and the same --store) of the run to continue")
    try:
        params = TrainParams(
            store=store, run_id=run_id or new_run_id(), storage_options=StorageOptions(so) if so else None,
            credentials_block=credentials_block, workload=workload, workload_size=size, workload_extra=extra,
            batch_size=batch_size, lr=lr, shards=shards, rounds=rounds, steps_per_round=steps_per_round,
            checkpoint_every=checkpoint_every, keyframe_every=keyframe_every, seed=seed, resume=resume,
            task_runner=task_runner, chaos=list(chaos or []), outer_lr=outer_lr, outer_momentum=outer_momentum,
            torch_threads=torch_threads, validate_checkpoints=not no_validate, heartbeat_every_s=heartbeat_every)
    except ValidationError as e:
        fail("; ".join(f"{'.'.join(map(str, err['loc'])) or 'params'}: {err['msg']}" for err in e.errors()))
    from trainrun.chaos import check_runner

    try:
        check_runner(params.chaos, params.task_runner)
    except ValueError as e:
        fail(str(e))
    if params.chaos and no_watchdog and any(c.split(":")[0] in ("hang", "zombie") for c in params.chaos):
        typer.echo("note: --chaos hang/zombie with --no-watchdog: the run waits until an external watchdog "
                   "(ckpt watchdog, the watchdog deployment) fences the shard", err=True)
    assert params.run_id is not None
    url = run_url(params.store, params.run_id)

    # The temporary Prefect server (when PREFECT_API_URL is unset) starts in the background while
    # this process checks that the run may start; the flow checks the same again.
    from flows.api import PrefectAPI

    api = PrefectAPI()
    from ckptlib import Checkpointer, CheckpointError
    from trainrun.errors import RunRefused
    from trainrun.resume import where_to_start

    try:
        from workloads import resolve_factory

        resolve_factory(params.workload)
        if credentials_block is None:  # a Secret block needs the Prefect API: the flow's plan-run checks then
            with Checkpointer(url, so) as ck:
                plan = where_to_start(ck, params.spec(), resume=params.resume, run_id=params.run_id)
            if params.resume:
                typer.echo(f"{params.run_id}: {plan.note}")
    except (RunRefused, CheckpointError, ValueError, ImportError) as e:
        api.stop()
        fail(str(e))

    from rich.console import Console
    from rich.live import Live

    console = Console()
    live = not verbose and console.is_terminal
    progress = Progress(url, so, params)
    summary, error = None, None
    from flows.train import train_run

    t_ready = t_flow_call = t_flow_end = time.perf_counter()
    guard = None
    try:
        with api.use():
            if not no_watchdog:
                guard = BesideWatchdog(params, watchdog_timeout).start()
            t_flow_call = time.perf_counter()
            try:
                if live:
                    progress.start()
                    with Live(progress, console=console, refresh_per_second=2, transient=False):
                        summary = train_run(params)
                else:
                    summary = train_run(params)
            finally:
                if guard is not None:
                    guard.stop()
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
    _print_summary(console, summary, params)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    # The interpreter's final garbage collection of everything Prefect, torch and the run left behind
    # takes seconds; nothing needs finalising any more (stores closed, Prefect drained): skip it.
    import gc

    gc.freeze()
    if summary["failed_validation"]:
        raise typer.Exit(1)


def _print_summary(console, s: dict, params) -> None:
    sec = s["seconds"]
    total = sec["cli_total"]
    flow = sec["flow"]
    ratio = s["full_copy_bytes"] / max(s["bytes_written"], 1)
    committed = s["committed"]
    lines = [
        f"[bold]run {s['run_id']}[/] done in {total:.1f} s (flow {flow:.1f} s)" + (f" — {s['note']}" if s["resumed"] else ""),
        f"  rounds done     {s['rounds_done']} this session (step {s['start_step']} -> {s['final_step']} of {s['rounds']})",
        f"  final loss      {_f(s['final_loss'])} (eval {_f(s['final_eval_loss'])})",
        f"  checkpoints     {len(committed)} committed" + (f" (steps {committed[0]}..{committed[-1]})" if committed else "")
        + f", {len(s['validated'])} validated" + (f", [red]{len(s['failed_validation'])} FAILED validation "
                                                  f"{s['failed_validation']}[/]" if s["failed_validation"] else ""),
        f"  bytes written   {_bytes(s['bytes_written'])} against {_bytes(s['full_copy_bytes'])} of full copies "
        f"({ratio:.2f}x smaller)",
        f"  time            training {sec['train'] + sec['build']:.1f} s, checkpoint save {sec['save']:.1f} s "
        f"({sec['save'] / total:.1%}), restore {sec['restore']:.1f} s ({sec['restore'] / total:.1%}), Prefect "
        f"overhead {sec['prefect']:.1f} s in the flow + {sec['prefect_start_stop']:.1f} s start/stop "
        f"({(sec['prefect'] + sec['prefect_start_stop']) / total:.1%}), validation tail {sec['validation_wait']:.1f} s",
        f"  checkpoints at  {s['run_url']}   (ckpt ls {s['run_url']})",
        f"  reports         {s['run_url']}/reports/<step>/  (final: {s['run_url']}/reports/{s['final_step']}/)",
    ]
    from trainrun.watchdog import Decision, describe
    from trainrun.watchdog.decisions import SUMMARY

    for d in s.get("watchdog") or []:
        if d["kind"] in SUMMARY:
            lines.append(f"  watchdog        {describe(Decision.from_dict(d))}")
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
    # plain print: the one line scripts and tests parse
    print(f"digest: {s['final_digest']}", flush=True)
