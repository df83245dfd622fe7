"""``ckpt bench``: ckptlib against torch.save, DCP (sync and async) and memcpy on real training states.

A thin command over ``bench.checkpoint`` (what is measured and how: its docstrings and
docs/benchmark.md): this module parses the options, prints the table and the targets, and writes
the records as JSON.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from .app import app
from .common import WORKLOAD_EXTRA_EXAMPLE, command_errors, parse_json_object


def _names(text: str, what: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ValueError(f"--{what} is empty: give a comma-separated list")
    return names


@app.command("bench")
def bench(
    workloads: Annotated[Optional[str], typer.Option(
        "--workloads", help="Comma-separated workloads: tinylm, recsys, finetune, finetune-bf16, dense-lm, or "
                            "module:factory (default: all five; --distributed: tinylm,finetune).")
    ] = None,
    saves: Annotated[Optional[int], typer.Option(
        "--saves", help="Checkpoints per series (means are over all but the first; default 17, --distributed 5).")
    ] = None,
    steps_between: Annotated[Optional[int], typer.Option(
        "--steps-between", help="Training steps between checkpoints (default: 10; finetune-bf16: 1, every step).")
    ] = None,
    size: Annotated[Optional[str], typer.Option(
        "--size", help="Workload size preset: bench or small (default: bench; --distributed: small).")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="FILE", help="Write the records as a JSON list.")] = None,
    store: Annotated[Optional[str], typer.Option(
        "--store", metavar="DIR", help="Directory for the per-system temporary stores (default: the system temp dir).")
    ] = None,
    systems: Annotated[str, typer.Option(
        "--systems", help="Comma-separated subset of: ckptlib, torch.save, dcp, dcp_async, memcpy.")
    ] = "ckptlib,torch.save,dcp,dcp_async,memcpy",
    device: Annotated[str, typer.Option("--device", help="Where the saved states live: cpu or cuda.")] = "cpu",
    workload_extra: Annotated[Optional[str], typer.Option(
        "--workload-extra", metavar="JSON", help="Workload knobs as a JSON object, e.g. '{\"d_model\": 1024}'.")
    ] = None,
    s3: Annotated[bool, typer.Option(
        "--s3", help="Instead: ckptlib's save and restore of a dense float32 state on S3 against a parallel s3fs "
                     "upload and download of the same bytes (bench/s3_ceiling.py). Starts SeaweedFS on loopback "
                     "unless --s3-endpoint env.")] = False,
    s3_size_mib: Annotated[int, typer.Option("--s3-size-mib", help="With --s3: the dense state's size.")] = 1024,
    s3_state: Annotated[str, typer.Option(
        "--s3-state", help="With --s3: dense, or resnet (a ResNet-50 state, ckptlib against torch.save + upload "
                           "/ download + torch.load: bench/checkpoint/s3.py).")] = "dense",
    s3_keyframe_every: Annotated[str, typer.Option(
        "--s3-keyframe-every", help="With --s3: ckptlib's keyframe_every values, a row each (default: the "
                                    "library's default; 1: keyframes only, the low-memory mode).")] = "default",
    s3_endpoint: Annotated[str, typer.Option(
        "--s3-endpoint", help="local (start SeaweedFS) or env (AWS_ENDPOINT_URL and credentials).")] = "local",
    distributed: Annotated[bool, typer.Option(
        "--distributed", help="Instead: FSDP2 jobs (gloo on CPU) checkpointed by ckptlib's collective Checkpointer "
                              "and by DCP, side by side (default workloads tinylm,finetune; --size small).")] = False,
    ranks: Annotated[str, typer.Option("--ranks", help="With --distributed: the world sizes, in order.")] = "2,4",
    recovery: Annotated[bool, typer.Option(
        "--recovery", help="Instead: what shard checkpoints cost at the default cadence, the round's fragment's "
                           "bytes, back-to-training time with and without the local tier (bench/recovery.py).")] = False,
    ranks_per_shard: Annotated[bool, typer.Option(
        "--ranks-per-shard", help="Instead: a shard's round trained by 2 rank processes (DDP and FSDP2, gloo) "
                                  "against one process, on the same batches; and the group's start "
                                  "(bench/ranks.py).")] = False,
    parallelism: Annotated[str, typer.Option(
        "--parallelism", help="With --ranks-per-shard: the groups' parallelisms, in order.")] = "ddp,fsdp",
) -> None:
    """Save a series of checkpoints of real training with every system, side by side; print ratios."""
    with command_errors():
        if s3:
            _bench_s3(s3_state, s3_size_mib, s3_endpoint, json_out, s3_keyframe_every)
            return
        if distributed:
            _bench_distributed(workloads, ranks, saves, steps_between, size, store, json_out)
            return
        if recovery:
            _bench_recovery(_names(workloads, "workloads"), json_out)
            return
        if ranks_per_shard:
            from bench.ranks import render, run

            pars = _names(parallelism, "parallelism")
            result = run(workloads=tuple(_names(workloads, "workloads")) if workloads else ("tinylm",),
                         layouts=((1, "ddp"), *((2, p) for p in pars)), progress=lambda m: typer.echo(m, err=True))
            _write_json(json_out, result)
            typer.echo(render(result))
            return
        import os

        if store is not None and not os.path.isdir(store):
            raise ValueError(f"--store {store!r} is not an existing directory: create it or drop the option")
        from bench.checkpoint.config import BenchConfig
        from bench.checkpoint.measure import run_benchmark

        extra = parse_json_object(workload_extra, "--workload-extra", WORKLOAD_EXTRA_EXAMPLE) or {}
        cfg = BenchConfig(workloads=_names(workloads or _DEFAULT_WORKLOADS, "workloads"), saves=saves or 17,
                          steps_between=steps_between, size=size or "bench", store=store, device=device,
                          systems=_names(systems, "systems"), extra=extra)
        from rich.console import Console

        err = Console(stderr=True, highlight=False)
        records = run_benchmark(cfg, progress=lambda msg: err.print(msg, markup=False))
        _write_json(json_out, records)
        _print_results(cfg, records, json_out)


def _bench_s3(state: str, size_mib: int, endpoint: str, json_out: str | None, keyframe_every: str = "default") -> None:
    if endpoint not in ("local", "env"):
        raise ValueError(f"--s3-endpoint must be local or env, got {endpoint!r}")
    def progress(message: str) -> None:
        typer.echo(message, err=True)

    if state == "resnet":
        from bench.checkpoint.s3 import render_s3, run_s3_benchmark

        result = run_s3_benchmark(endpoint, progress=progress)
        _write_json(json_out, result)
        typer.echo(render_s3(result))
        return
    if state != "dense":
        raise ValueError(f"--s3-state must be dense or resnet, got {state!r}")
    from bench.s3_ceiling import keyframe_values, render, run_s3_ceiling

    rows = run_s3_ceiling(size_mib, endpoint, progress=progress, keyframe_every=keyframe_values(keyframe_every))
    _write_json(json_out, rows)
    typer.echo(render(rows))


def _bench_distributed(workloads: str | None, ranks: str, saves: int | None, steps_between: int | None,
                       size: str | None, store: str | None, json_out: str | None) -> None:
    from bench.distributed.run import DistributedBenchConfig, render, run_distributed_benchmark

    default = DistributedBenchConfig()
    worlds = tuple(int(n) for n in _names(ranks, "ranks") if n.isdigit())
    if not worlds or len(worlds) != len(_names(ranks, "ranks")) or min(worlds) < 1:
        raise ValueError(f"--ranks must list world sizes (positive integers), got {ranks!r}")
    cfg = DistributedBenchConfig(workloads=_names(workloads, "workloads") if workloads else default.workloads,
                                 ranks=worlds, saves=saves or default.saves,
                                 steps_between=steps_between or default.steps_between, size=size or default.size,
                                 store=store)
    records = run_distributed_benchmark(cfg, progress=lambda m: typer.echo(m, err=True))
    _write_json(json_out, records)
    typer.echo(render(records))
    ours = [f"{r['workload']} on {r['world']} ranks" for r in records
            if r["system"] == "ckptlib" and not (r["exact_same"] and r.get("exact_other", True))]
    if ours:
        from ckptlib import CheckpointError

        raise CheckpointError(f"ckptlib did not restore {', '.join(ours)} bit-exactly: a ckptlib bug")


_DEFAULT_WORKLOADS = "tinylm,recsys,finetune,finetune-bf16,dense-lm"


def _bench_recovery(workloads: tuple[str, ...], json_out: str | None) -> None:
    from bench.recovery import render, run

    result = run(workloads, progress=lambda m: typer.echo(m, err=True))
    _write_json(json_out, result)
    typer.echo(render(result))


def _write_json(path: str | None, data: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def _print_results(cfg: Any, records: list[dict[str, Any]], json_out: str | None) -> None:
    """The table, the targets, a note per system that did not restore bit-exactly; a ckptlib
    restore that is not bit-exact is a ckptlib bug and fails the command (exit 2)."""
    from rich.console import Console

    from bench.checkpoint.report import check_targets, render_table
    from ckptlib import CheckpointError

    out = Console(highlight=False)
    if not out.is_terminal:
        out.width = max(out.width, 170)  # files and pipes get the whole table, not "…" cells
    apart = f"{cfg.steps_between} steps apart" if cfg.steps_between else "10 steps apart (finetune-bf16: 1)"
    out.print(render_table(records, title=f"checkpoint benchmark: size={cfg.size}, {cfg.saves} saves, {apart}, "
                                          f"device={cfg.device}, means over saves 2..{cfg.saves}"))
    for target in check_targets(records):
        out.print(str(target), markup=False)
    for r in records:
        if not r["restore_exact"]:
            out.print(f"note: {r['system']} did not restore {r['workload']} bit-exactly: "
                      f"{r.get('restore_difference')}", markup=False)
    if json_out:
        out.print(f"records written to {json_out}", markup=False)
    ours = [f"{r['workload']}" for r in records if r["system"] == "ckptlib" and not r["restore_exact"]]
    if ours:
        raise CheckpointError(f"ckptlib did not restore {', '.join(ours)} bit-exactly: a ckptlib bug")
