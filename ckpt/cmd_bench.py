"""``ckpt bench``: ckptlib against torch.save, DCP (sync and async) and memcpy on real training states.

The logic lives in ``ckpt/bench.py`` (importable); this module parses options, prints and writes JSON.
What is measured and how: ``ckpt/bench.py``'s docstring and ``docs/benchmark.md``.
"""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from .cli import app
from .common import WORKLOAD_EXTRA_EXAMPLE, command_errors, parse_json_object


def _names(text: str, what: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ValueError(f"--{what} is empty: give a comma-separated list")
    return names


@app.command("bench")
def bench(
    workloads: Annotated[str, typer.Option(
        "--workloads", help="Comma-separated workloads: tinylm, recsys, finetune, finetune-bf16, or module:factory.")
    ] = "tinylm,recsys,finetune,finetune-bf16",
    saves: Annotated[int, typer.Option("--saves", help="Checkpoints per series (means are over all but the first).")] = 17,
    steps_between: Annotated[Optional[int], typer.Option(
        "--steps-between", help="Training steps between checkpoints (default: 10; finetune-bf16: 1, every step).")
    ] = None,
    size: Annotated[str, typer.Option("--size", help="Workload size preset: bench or small.")] = "bench",
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
        "--s3", help="Instead: ckptlib on S3 against torch.save + upload / download + torch.load, on a ResNet-50 "
                     "state (481 tensors). Starts SeaweedFS on loopback unless --s3-endpoint env.")] = False,
    s3_endpoint: Annotated[str, typer.Option(
        "--s3-endpoint", help="local (start SeaweedFS) or env (AWS_ENDPOINT_URL and credentials).")] = "local",
) -> None:
    """Save a series of checkpoints of real training with every system, side by side; print ratios."""
    with command_errors():
        import os

        if s3:
            from .bench_s3 import render_s3, run_s3_benchmark

            if s3_endpoint not in ("local", "env"):
                raise ValueError(f"--s3-endpoint must be local or env, got {s3_endpoint!r}")
            result = run_s3_benchmark(s3_endpoint, progress=lambda m: typer.echo(m, err=True))
            if json_out:
                with open(json_out, "w") as f:
                    json.dump(result, f, indent=1)
            typer.echo(render_s3(result))
            return

        if store is not None and not os.path.isdir(store):
            raise ValueError(f"--store {store!r} is not an existing directory: create it or drop the option")
        from rich.console import Console

        from workloads.base import BUILTIN_WORKLOADS

        from .bench import BenchConfig, check_targets, render_table, run_benchmark

        names = _names(workloads, "workloads")
        bad = [n for n in names if n not in BUILTIN_WORKLOADS and ":" not in n]
        if bad:
            raise ValueError(f"unknown workload(s) {bad}: choose from {', '.join(BUILTIN_WORKLOADS)} "
                             "or give 'package.module:factory'")
        extra = parse_json_object(workload_extra, "--workload-extra", WORKLOAD_EXTRA_EXAMPLE) or {}
        cfg = BenchConfig(workloads=names, saves=saves, steps_between=steps_between, size=size, store=store,
                          device=device, systems=_names(systems, "systems"), extra=extra)
        out = Console(highlight=False)
        if not out.is_terminal:
            out.width = max(out.width, 170)  # files and pipes get the whole table, not "…" cells
        err = Console(stderr=True, highlight=False)
        records = run_benchmark(cfg, progress=lambda msg: err.print(msg, markup=False))
        if json_out:
            with open(json_out, "w") as f:
                json.dump(records, f, indent=1)
        apart = f"{steps_between} steps apart" if steps_between else "10 steps apart (finetune-bf16: 1)"
        out.print(render_table(records, title=f"checkpoint benchmark: size={size}, {saves} saves, {apart}, "
                                              f"device={device}, means over saves 2..{saves}"))
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
            from ckptlib import CheckpointError

            raise CheckpointError(f"ckptlib did not restore {', '.join(ours)} bit-exactly: a ckptlib bug")
