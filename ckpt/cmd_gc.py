"""``ckpt gc``: drop the checkpoints a retention policy does not keep and sweep what no kept
checkpoint needs (``ckptlib.gc``: the protocol with leases and a lock, docs/format.md "Garbage
collection"). The only command that deletes from a store; ``--dry-run`` deletes nothing.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .app import app
from .common import StorageOptionsOpt, UrlArg, command_errors, fmt_bytes, open_checkpointer


@app.command("gc")
def gc(url: UrlArg,
       keep_last: Annotated[int, typer.Option("--keep-last", help="Keep the newest N committed steps (N >= 1).")],
       keep_every: Annotated[Optional[int], typer.Option("--keep-every", help="Also keep every step divisible by K.")] = None,
       keep: Annotated[Optional[list[int]], typer.Option("--keep", help="Also keep this step (repeatable).")] = None,
       grace_seconds: Annotated[Optional[float], typer.Option(
           "--grace-seconds", metavar="S", min=0.0, show_default=False,
           help="Only delete unreferenced objects older than this (protects saves in flight; default: "
                "10 minutes).")] = None,
       wait_seconds: Annotated[Optional[float], typer.Option(
           "--wait-seconds", metavar="S", min=0.0, show_default=False,
           help="Wait this long for saves that began before this GC to publish before deferring the "
                "sweeps (default: 30 s).")] = None,
       dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be deleted; delete nothing.")] = False,
       storage_options: StorageOptionsOpt = None) -> None:
    """Drop checkpoints a retention policy does not keep and sweep objects no kept checkpoint needs."""
    with command_errors():
        from ckptlib import RetentionPolicy
        from ckptlib.gc import DEFAULT_GRACE_S, DEFAULT_SAVE_WAIT_S

        policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every, keep_named=frozenset(keep or ()))
        with open_checkpointer(url, storage_options) as ck:
            report = ck.gc(policy, grace_s=DEFAULT_GRACE_S if grace_seconds is None else grace_seconds,
                           dry_run=dry_run, wait_s=DEFAULT_SAVE_WAIT_S if wait_seconds is None else wait_seconds)
        would = "would " if dry_run else ""
        chunks = [k for k in report.deleted_objects if k.startswith("chunks/")]
        typer.echo(f"kept {len(report.kept_steps)} step(s): {_steps_text(report.kept_steps)}")
        typer.echo(f"{would}drop {len(report.dropped_steps)} step(s): {_steps_text(report.dropped_steps)}")
        typer.echo(f"{would}delete {len(report.deleted_objects)} object(s) ({len(chunks)} chunks); "
                   f"{would}free {report.freed_bytes} bytes ({fmt_bytes(report.freed_bytes)}) of chunks")
        if report.deferred:
            typer.echo(f"stopped early: {report.deferred}")
        if dry_run:
            typer.echo("dry run: nothing was deleted")


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "-"
