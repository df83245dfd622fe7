"""``ckpt soak``: a training run under a stream of failures against a clean run of the same work; goodput.

    ckpt soak --minutes 30 --fail-every 60                      # crash, hang, stall on threads
    ckpt soak --minutes 5 --fail-every 20 --kinds crash,kill,stop --task-runner dask
    ckpt soak --rounds 4 --failures 4                           # four failures in four rounds

1. A clean run of about ``--minutes`` of training (its rounds estimated from a few timed steps),
   with a watchdog beside it, as ``ckpt train`` runs.
2. A failure schedule over the clean run's rounds (``trainrun.chaos.soak_schedule``): exponential
   gaps of ``--fail-every`` seconds on average (seeded), each a random kind on a random shard, at the
   step the clean run had reached then; as chaos specs.
3. The same run with those failures, the watchdog beside it recovering the silent ones.

With ``--compare torchft,torchrun-dcp`` the same steps of the same model, data and seeds then run
through those peers, clean and struck by the same schedule (``bench.compare``; docs/recovery.md),
and the report gains ``systems``: each system's goodput, failures struck, recoveries and work lost.

It reports goodput (the clean run's round time over the drilled run's, for the same steps), the
failures that struck and the recoveries (``steps_recomputed``, ``detect_s``, ``back_to_training_s``:
median, p95, max), and whether both runs end on the same digest (exit 1 if not). The runs live under
``--store`` (default: a temporary folder, removed at the end unless ``--keep``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import tempfile
import time
from typing import Annotated, Any, Optional

import typer

from .app import app
from .common import WORKLOAD_EXTRA_EXAMPLE, command_errors, parse_json_object

DEFAULT_KINDS = "crash,hang,stall"


@app.command("soak")
def soak(
    minutes: Annotated[float, typer.Option("--minutes", metavar="MIN", min=0.1, help="Training time of each run (about).")] = 5.0,
    fail_every: Annotated[float, typer.Option("--fail-every", metavar="S", min=1.0,
                                              help="Seconds between failures, on average (exponential gaps).")] = 60.0,
    failures: Annotated[Optional[int], typer.Option("--failures", metavar="N", min=1, help="Instead of --fail-every: exactly "
                                                    "this many failures, at moments uniform over the run.")] = None,
    kinds: Annotated[str, typer.Option("--kinds", help="Comma-separated chaos kinds: crash, hang, stall, zombie "
                                       "(threads or dask), kill, stop (dask).")] = DEFAULT_KINDS,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the failure schedule.")] = 0,
    workload: Annotated[str, typer.Option("--workload", help="The workload (as ckpt train).")] = "tinylm",
    size: Annotated[str, typer.Option("--size", help="Workload size preset: small | bench.")] = "small",
    workload_extra: Annotated[Optional[str], typer.Option("--workload-extra", metavar="JSON", help="Workload knobs "
                                                          "over the preset (as ckpt train), e.g. "
                                                          f"{WORKLOAD_EXTRA_EXAMPLE}.")] = None,
    shards: Annotated[int, typer.Option("--shards", metavar="N", min=1)] = 2,
    steps_per_round: Annotated[int, typer.Option("--steps-per-round", metavar="H", min=2)] = 150,
    rounds: Annotated[Optional[int], typer.Option("--rounds", metavar="R", min=1, help="Rounds of each run (default: "
                                                  "from --minutes).")] = None,
    shard_checkpoint_every: Annotated[str, typer.Option("--shard-checkpoint-every", metavar="N|auto")] = "auto",
    watchdog_timeout: Annotated[float, typer.Option("--watchdog-timeout", metavar="S", min=0.5)] = 5.0,
    heartbeat_every: Annotated[float, typer.Option("--heartbeat-every", metavar="S", min=0.05)] = 0.5,
    task_runner: Annotated[str, typer.Option("--task-runner", help="threads | dask (kill and stop need dask)")
                           ] = "threads",
    no_local_tier: Annotated[bool, typer.Option("--no-local-tier", help="Shard checkpoints from the store only.")
                             ] = False,
    validate: Annotated[bool, typer.Option("--validate", help="Validate checkpoints too (off: the soak measures "
                                           "training and recovery).")] = False,
    store: Annotated[Optional[str], typer.Option("--store", metavar="DIR", help="Where both runs live (default: "
                                                 "a temporary folder).")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the runs' stores.")] = False,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="PATH", help="Also write the report as JSON.")
                        ] = None,
    compare: Annotated[Optional[str], typer.Option("--compare", metavar="PEERS", help="Also run the same steps and "
                                                   "failures through peers: torchft, torchrun-dcp (needs --shards 2).")
                       ] = None,
    dcp_every: Annotated[Optional[int], typer.Option("--dcp-every", metavar="N", min=1, help="torchrun-dcp's "
                                                     "checkpoint interval (default: the shards' step bound).")] = None,
) -> None:
    """Train with failures injected at random moments and without; report goodput and what each recovery cost."""
    with command_errors():
        from trainrun.chaos import check_runner, parse_chaos

        from .cmd_train import _quiet_prefect

        _quiet_prefect(False)

        names = [k.strip() for k in kinds.split(",") if k.strip()]
        for k in names:
            parse_chaos(f"{k}:shard=0,round=1")  # an unknown kind: one error line
        check_runner([f"{k}:shard=0,round=1" for k in names], task_runner)
        extra = parse_json_object(workload_extra, "--workload-extra", WORKLOAD_EXTRA_EXAMPLE) or {}
        peers = _peers(compare, shards, extra)
        root = store or tempfile.mkdtemp(prefix="ckpt-soak-")
        base = {"workload": workload, "workload_size": size, "workload_extra": extra, "shards": shards,
                "steps_per_round": steps_per_round,
                "seed": 0, "store": root, "heartbeat_every_s": heartbeat_every,
                "shard_checkpoint_every": shard_checkpoint_every, "local_tier": not no_local_tier,
                "task_runner": task_runner, "validate_checkpoints": validate, "shard_retries": 3}
        try:
            report = _soak(base, minutes, rounds, fail_every, names, seed, watchdog_timeout, failures)
            if peers:
                report.update(_compare(report, peers, base, dcp_every, watchdog_timeout, root))
        finally:
            if not keep and store is None:
                shutil.rmtree(root, ignore_errors=True)
        _print(report)
        if peers:
            _print_systems(report)
        if json_out:
            with open(json_out, "w") as f:
                json.dump(report, f, indent=1, default=str)
        if not report["same_digest"]:
            raise typer.Exit(1)


def _peers(compare: str | None, shards: int, workload_extra: dict[str, Any]) -> list[str]:
    """The peers of ``--compare``, checked before any run starts."""
    from bench.compare import PEERS

    peers = [p.strip() for p in (compare or "").split(",") if p.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"--compare: unknown peer {', '.join(unknown)}: choose from {', '.join(PEERS)}")
    if peers and workload_extra:
        raise ValueError("--compare: the peers train the workload's --size preset as it is, so --workload-extra "
                         "would compare different models: leave --workload-extra out")
    if peers and shards != 2:
        raise ValueError(f"--compare: the peers train two ranks, one shard's batches each, but --shards is "
                         f"{shards}: pass --shards 2")
    return peers


def _compare(report: dict[str, Any], peers: list[str], base: dict[str, Any], dcp_every: int | None,
             timeout_s: float, root: str) -> dict[str, Any]:
    """The peers through the soak's steps and schedule (``bench.compare.run``), beside this pipeline's figures."""
    from bench.compare.run import run_peers

    typer.echo(f"soak: the same {report['rounds']} rounds and failures through {', '.join(peers)}", err=True)
    out = run_peers(peers, report["schedule"], rounds=report["rounds"], steps_per_round=base["steps_per_round"],
                    size=base["workload_size"], dcp_every=dcp_every or report["steps_bound"], timeout_s=timeout_s,
                    root=os.path.join(root, "compare"))
    ours = {"goodput": report["goodput"], "clean_s": report["clean_rounds_s"], "drilled_s": report["drilled_rounds_s"],
            "failures_scheduled": report["failures_scheduled"], "failures_struck": report["failures_struck"],
            "detect_s": report["detect_s"], "back_to_training_s": report["back_to_training_s"],
            "steps_recomputed": sum(r["steps_recomputed"] for r in report["rows"]), "samples_dropped": 0,
            "same_digest": report["same_digest"]}
    return {"systems": {"ckptlib": ours, **out["systems"]},
            "compare": {k: out[k] for k in ("steps", "strikes", "unmapped")}}


def _print_systems(r: dict[str, Any]) -> None:
    """One line per system: goodput, failures, median detection and recovery, work lost, the end state."""
    def med(xs: list[float | None]) -> str:
        got = [x for x in xs if x is not None]
        return f"{statistics.median(got):.2f}" if got else "-"

    typer.echo(f"{'system':<14}{'goodput':>9}{'struck':>8}{'detect s':>10}{'back s':>9}{'recomputed':>12}"
               f"{'dropped':>9}  end state")
    for name, s in r["systems"].items():
        if "error" in s:
            typer.echo(f"{name:<14}  cannot run here: {s['error']}")
            continue
        if name == "ckptlib":
            detect, back = s["detect_s"]["median"], s["back_to_training_s"]["median"]
            d, b = ("-" if detect is None else f"{detect:.2f}"), ("-" if back is None else f"{back:.2f}")
        else:
            d = med([x["detect_s"] for x in s["recoveries"]])
            b = med([x["rejoin_s"] for x in s["recoveries"]])  # the struck rank trains again (as back_to_training)
        losses = [s.get("drilled_loss"), s.get("clean_loss")]
        end = "the clean digest" if s["same_digest"] else \
            "differs (loss " + " vs clean ".join("-" if x is None else f"{x:.4f}" for x in losses) + ")"
        good = "-" if s["goodput"] is None else f"{s['goodput']:.1%}"
        typer.echo(f"{name:<14}{good:>9}{s['failures_struck']:>8}{d:>10}{b:>9}{s['steps_recomputed']:>12}"
                   f"{s['samples_dropped']:>9}  {end}")


def _soak(base: dict[str, Any], minutes: float, rounds: int | None, fail_every: float, kinds: list[str], seed: int,
          timeout_s: float, failures: int | None) -> dict[str, Any]:
    from flows.api import PrefectAPI
    from trainrun.chaos import RoundSpan, soak_schedule

    n_rounds = rounds or _rounds_for(base, minutes)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    api = PrefectAPI()
    try:
        with api.use():
            typer.echo(f"soak: clean run of {n_rounds} rounds x {base['steps_per_round']} steps", err=True)
            clean = _train({**base, "rounds": n_rounds, "run_id": f"soak-{stamp}-clean"}, timeout_s)
            spans, t = [], 0.0
            for x in clean["rounds_log"]:
                spans.append(RoundSpan(x["round"], t, x["seconds"]["wall"], x["seconds"]["train"] + x["seconds"]["build"]))
                t += x["seconds"]["wall"]
            schedule = [str(c) for c in soak_schedule(spans, fail_every_s=fail_every, kinds=kinds, shards=base["shards"],
                                                      steps_per_round=base["steps_per_round"], seed=seed,
                                                      count=failures)]
            typer.echo(f"soak: the same run with {len(schedule)} failures", err=True)
            drilled = _train({**base, "rounds": n_rounds, "run_id": f"soak-{stamp}-drilled", "chaos": schedule},
                             timeout_s)
    finally:
        api.stop()
    return _report(base, clean, drilled, schedule, fail_every, kinds, seed, timeout_s)


def _rounds_for(base: dict[str, Any], minutes: float) -> int:
    """Rounds that train for about ``minutes``: from a few timed steps of one shard (shards beyond the
    cores train in turns)."""
    import torch

    from workloads import WorkloadConfig, build_workload

    torch.set_num_threads(1)
    config = WorkloadConfig(base["workload"], seed=0, size=base["workload_size"], extra=base["workload_extra"])
    wl = build_workload(config, 0, base["shards"])
    for _ in range(3):
        wl.train_step()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        wl.train_step()
    step_s = (time.perf_counter() - t0) / n
    waves = math.ceil(base["shards"] / max(1, os.cpu_count() or 1))
    round_s = base["steps_per_round"] * step_s * waves * 1.1 + 0.3  # + the cut and the task starts
    return max(2, round(minutes * 60.0 / round_s))


def _train(p: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One run with the watchdog beside it (as ``ckpt train``); its summary, with the watchdog's decisions."""
    from flows.params import TrainParams
    from flows.train import train_run

    from .beside import BesideWatchdog

    params = TrainParams(**p)
    guard = BesideWatchdog(params, timeout_s).start()
    try:
        summary = train_run(params)
    finally:
        guard.stop()
    summary["watchdog"] = guard.decisions()
    return summary


def _stats(values: list[float]) -> dict[str, float | None]:
    """Median, p95 (nearest rank) and max; None without values."""
    if not values:
        return {"median": None, "p95": None, "max": None}
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 3),
            "p95": round(ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)], 3),
            "max": round(ordered[-1], 3)}


def _report(base: dict[str, Any], clean: dict[str, Any], drilled: dict[str, Any], schedule: list[str],
            fail_every: float, kinds: list[str], seed: int, timeout_s: float) -> dict[str, Any]:
    def rounds_s(s: dict[str, Any]) -> float:
        return sum(x["seconds"]["wall"] for x in s["rounds_log"])

    rows = drilled["recoveries"]
    struck = sum(1 for d in os.scandir(os.path.join(drilled["run_url"], "chaos"))) \
        if os.path.isdir(os.path.join(drilled["run_url"], "chaos")) else None
    from trainrun.shard_checkpoint import step_bound

    c, d = rounds_s(clean), rounds_s(drilled)
    bound = step_bound(base["shard_checkpoint_every"], base["steps_per_round"])
    return {
        "workload": base["workload"], "size": base["workload_size"], "workload_extra": base["workload_extra"],
        "shards": base["shards"], "rounds": len(clean["rounds_log"]), "steps_per_round": base["steps_per_round"],
        "task_runner": base["task_runner"], "shard_checkpoint_every": base["shard_checkpoint_every"],
        "local_tier": base["local_tier"], "watchdog_timeout_s": timeout_s, "heartbeat_every_s": base["heartbeat_every_s"],
        "fail_every_s": fail_every, "kinds": kinds, "seed": seed,
        "clean_rounds_s": round(c, 3), "drilled_rounds_s": round(d, 3), "goodput": round(c / d, 4) if d else None,
        "clean_flow_s": clean["seconds"]["flow"], "drilled_flow_s": drilled["seconds"]["flow"],
        "failures_scheduled": len(schedule), "failures_struck": struck, "recoveries": len(rows),
        "failures_per_drilled_minute": round(len(schedule) / (d / 60.0), 3) if d else None,
        "steps_recomputed": _stats([r["steps_recomputed"] for r in rows]),
        # at most N (auto: its step ceiling) after each failure; the rows' failed_at_step is the last beat's
        "steps_bound": bound, "beyond_bound": sum(1 for r in rows if r["steps_recomputed"] > bound),
        "detect_s": _stats([r["detect_s"] for r in rows if r["detect_s"] is not None]),
        "back_to_training_s": _stats([r["back_to_training_s"] for r in rows if r["back_to_training_s"] is not None]),
        "kinds_recovered": {k: sum(1 for r in rows if r["kind"] == k) for k in sorted({r["kind"] for r in rows})},
        "shard_checkpoints": {"clean": clean["shard_checkpoints"], "drilled": drilled["shard_checkpoints"]},
        "clean_digest": clean["final_digest"], "drilled_digest": drilled["final_digest"],
        "same_digest": clean["final_digest"] == drilled["final_digest"],
        "schedule": schedule, "rows": rows,
        # each round's wall time in both runs: a struck round's loss, and the load's drift in the others
        "clean_round_wall_s": [x["seconds"]["wall"] for x in clean["rounds_log"]],
        "drilled_round_wall_s": [x["seconds"]["wall"] for x in drilled["rounds_log"]],
    }


def _print(r: dict[str, Any]) -> None:
    def dist(name: str, unit: str = "") -> str:
        s = r[name]
        if s["median"] is None:
            return "-"
        return f"median {s['median']:g}{unit}, p95 {s['p95']:g}{unit}, max {s['max']:g}{unit}"

    sc = r["shard_checkpoints"]["clean"]
    lines = [
        f"soak: {r['workload']} {r['size']}, {r['shards']} shards, {r['rounds']} rounds x {r['steps_per_round']} steps, "
        f"{r['task_runner']}; a failure every {r['fail_every_s']:g} s on average ({', '.join(r['kinds'])}, seed "
        f"{r['seed']}); watchdog timeout {r['watchdog_timeout_s']:g} s, beats every {r['heartbeat_every_s']:g} s",
        f"  clean             {r['clean_rounds_s']:.1f} s of rounds ({sc['count']} shard checkpoints, every "
        f"{sc['every']}, loops waited {sc['blocked_share_of_train']:.2%} of training)",
        f"  with failures     {r['drilled_rounds_s']:.1f} s of rounds: {r['failures_struck']} failures struck of "
        f"{r['failures_scheduled']} scheduled, {r['recoveries']} recoveries {r['kinds_recovered']}",
        f"  goodput           {r['goodput']:.1%}" if r["goodput"] is not None else "  goodput           -",
        f"  steps recomputed  {dist('steps_recomputed')} (bound {r['steps_bound']}: {r['beyond_bound']} beyond)",
        f"  detect            {dist('detect_s', ' s')}",
        f"  back to training  {dist('back_to_training_s', ' s')}",
        f"  digest            {'the same' if r['same_digest'] else 'DIFFERENT'}: {r['drilled_digest']}"
        + ("" if r["same_digest"] else f" (clean {r['clean_digest']})"),
    ]
    for line in lines:
        typer.echo(line)
