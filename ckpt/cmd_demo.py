"""``ckpt demo``: train a small real model (tinylm), checkpoint it sync and async into a store
(a new temporary directory by default), list, verify, and restore bit-exactly from a fresh reader
(``ckptlib.testing.compare``, exact types). An expected failure prints one ``error:`` line and exits 2.
"""

from __future__ import annotations

import tempfile
from typing import Annotated, Optional

import typer

from .app import app
from .cmd_inspect import checkpoint_table
from .common import (
    StorageOptionsOpt,
    command_errors,
    console,
    fmt_bytes,
    fmt_ratio,
    open_checkpointer,
    parse_storage_options,
)


@app.command("demo")
def demo(store: Annotated[Optional[str], typer.Option(
             "--store", help="Store path or URL (default: a new temporary directory).")] = None,
         saves: Annotated[int, typer.Option("--saves", min=2, help="Checkpoints to save.")] = 5,
         steps_between: Annotated[int, typer.Option("--steps-between", min=1, help="Training steps between saves.")] = 4,
         storage_options: StorageOptionsOpt = None) -> None:
    """Train a small real model (tinylm), checkpoint it sync and async, list, verify, restore bit-exactly."""
    with command_errors():
        import torch  # noqa: F401  (before workloads, so its import time is not counted as training)

        from ckptlib import Checkpointer, CheckpointError
        from ckptlib.testing.compare import first_difference
        from workloads.base import WorkloadConfig, build_workload

        url = store or tempfile.mkdtemp(prefix="ckpt-demo-")
        out = console()
        wl = build_workload(WorkloadConfig(name="tinylm", size="small"))
        with open_checkpointer(url, storage_options, must_exist=False) as ck:
            out.print(f"store: {ck.url}")
            latest = ck.latest_step()
            if latest is not None:
                wl.load_state_dict(ck.restore(latest))
                out.print(f"resumed from step {latest} (its state restored into the model)")
            written = logical = 0
            pending = None  # (mode, future) of an async save still persisting while we train

            def report(mode: str, info) -> None:
                nonlocal written, logical
                written += info.bytes_written
                logical += info.logical_bytes
                out.print(f"  step {info.step:>4}  {mode:<5}  {info.kind:<8}  wrote {fmt_bytes(info.bytes_written):>10} "
                          f"of {fmt_bytes(info.logical_bytes)} ({fmt_ratio(info.logical_bytes, info.bytes_written)} "
                          f"smaller)  blocked {info.blocked_s * 1e3:6.1f} ms  durable {info.durable_s * 1e3:6.1f} ms")

            out.print(f"training tinylm (small) {steps_between} steps between {saves} checkpoints:")
            for i in range(saves):
                for _ in range(steps_between):
                    loss = wl.train_step()  # an async save of the previous step persists meanwhile
                if pending is not None:
                    report(pending[0], pending[1].result())
                    pending = None
                step, meta = wl.data_position, {"loss": loss, "workload": "tinylm"}
                if i % 2 == 0:
                    report("sync", ck.save(step, wl.checkpoint_state(), meta=meta))
                else:
                    pending = ("async", ck.save_async(step, wl.checkpoint_state(), meta=meta))
            if pending is not None:
                report(pending[0], pending[1].result())
            out.print(f"wrote {fmt_bytes(written)} for {saves} checkpoints of {fmt_bytes(logical / saves)} each "
                      f"({fmt_ratio(logical, written)} less than {saves} full copies)")
            out.print(checkpoint_table(ck))
            problems = [p for s in ck.steps() for p in ck.verify(s)]
            if problems:
                for p in problems:
                    out.print(str(p), markup=False)
                raise CheckpointError(f"verify found {len(problems)} problem(s) in a store the demo just wrote")
            out.print(f"verify: all {len(ck.steps())} checkpoints intact")
            final = wl.data_position
        with Checkpointer(url, parse_storage_options(storage_options)) as fresh:  # a new reader, no cached base
            restored = fresh.restore()
            digest = fresh.manifest().digest
        diff = first_difference(wl.checkpoint_state(), restored)
        if diff is not None:
            raise CheckpointError(f"restored step {final} differs from the trained state: {diff}")
        out.print(f"restore: step {final} is bit-exact (digest {digest}); "
                  f"try `ckpt ls {url}` and `ckpt show {url}`")
