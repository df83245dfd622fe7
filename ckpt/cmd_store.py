"""Store commands: ``ckpt ls | show | verify | gc | export | demo``.

Each command opens one run's store (a path, ``file://``, ``memory://`` or ``s3://`` URL) through
``ckptlib.Checkpointer`` and does one thing. Contract of every command here:

* ``--storage-options @FILE`` (or ``JSON``) gives s3fs arguments for ``s3://`` URLs; without it,
  ``CKPT_STORAGE_OPTIONS`` (the same two forms), then the standard AWS environment variables
  (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). Inline JSON shows in ``ps``: prefer a file
  (``trainrun.credentials``). A URL holding credentials (``s3://key:secret@...``) is refused.
* An expected failure (a ``ckptlib.CheckpointError``, a bad option, an unwritable output path)
  prints ONE line ``error: <cause and fix>`` to stderr and exits with code 2; no traceback.
  ``verify`` exits with code 1 when it finds damage (and prints one line per problem).
* Nothing here writes to a store except ``gc`` (deletes) and ``demo`` (saves).

Heavy imports (torch via ckptlib) happen inside the commands, so ``ckpt --help`` stays fast.
"""

from __future__ import annotations

import bisect
import json
import tempfile
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from .cli import app
from .common import (
    StepOpt,
    StorageOptionsOpt,
    UrlArg,
    command_errors,
    console,
    fail,
    fmt_bytes,
    fmt_ratio,
    open_checkpointer,
    parse_storage_options,
    verdict_word,
)

if TYPE_CHECKING:
    from ckptlib import Checkpointer
    from ckptlib.manifest import Manifest

def checkpoint_table(ck: Checkpointer, steps: list[int] | None = None):
    """The rich table of ``ckpt ls`` (also printed by ``ckpt demo``): one row per step of ``steps``
    (default: every committed step). Each row reads the step's manifest and verdict, eight steps at
    a time (a remote store answers each read in a round trip)."""
    from concurrent.futures import ThreadPoolExecutor

    from rich.table import Table

    table = Table(title=f"checkpoints in {ck.url}", title_justify="left")
    for name, justify in (("step", "right"), ("kind", "left"), ("written", "right"), ("ratio", "right"),
                          ("stored", "right"), ("digest", "left"), ("validation", "left")):
        table.add_column(name, justify=justify, no_wrap=True)

    def row(step: int) -> tuple[str, ...]:
        from ckptlib import commit

        m = commit.read_manifest(ck.store, step)
        return (str(step), m.kind, fmt_bytes(m.bytes_written), fmt_ratio(m.logical_bytes, m.bytes_written),
                fmt_bytes(m.stored_bytes), m.digest[:12], verdict_word(ck.verdict(step)))

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckpt-ls") as pool:
        for cells in pool.map(row, ck.steps() if steps is None else steps):
            table.add_row(*cells)
    return table


def page_of(steps: list[int], limit: int, before: int | None) -> list[int]:
    """The newest ``limit`` steps below ``before`` (None: of all; ``limit`` 0: no limit), ascending."""
    if before is not None:
        steps = steps[:bisect.bisect_left(steps, before)]
    return steps if limit == 0 else steps[-limit:]


def _runs_below(url: str) -> list[str]:
    """The runs under a local store root (``trainrun.layout.find_runs``), as paths relative to it."""
    from ckptlib.store import Store
    from trainrun.layout import find_runs

    try:
        return [p for p in find_runs(Store.from_url(url)) if p]
    except Exception:  # noqa: BLE001 - only a hint
        return []


# --- ls ------------------------------------------------------------------------------------------

LS_LIMIT = 20


@app.command("ls")
def ls(url: UrlArg,
       limit: Annotated[int, typer.Option("--limit", "-n", min=0, help="Show the newest N steps (0: all of them).")]
       = LS_LIMIT,
       before: Annotated[Optional[int], typer.Option("--before", min=0, metavar="STEP",
                                                     help="Show steps older than STEP (the next page).")] = None,
       storage_options: StorageOptionsOpt = None) -> None:
    """List the committed checkpoints of a run, newest page first: step, kind, bytes written, ratio, digest, validation.

    One listing of the manifests, then only the shown steps' manifests and verdicts are read, so a
    run with 10,000 checkpoints lists in about the time of its listing; ``--before`` pages back."""
    with command_errors(), open_checkpointer(url, storage_options) as ck:
        steps = ck.steps()
        if not steps:
            runs = _runs_below(url) if "://" not in url or url.startswith("file://") else []
            hint = f" It holds runs: {', '.join(runs)} (e.g. `ckpt ls {url.rstrip('/')}/{runs[0]}`)." if runs else ""
            typer.echo(f"no committed checkpoints in {ck.url}.{hint}")
            return
        shown = page_of(steps, limit, before)
        if not shown:
            typer.echo(f"no committed checkpoint before step {before} in {ck.url} (steps {steps[0]}..{steps[-1]})")
            return
        console().print(checkpoint_table(ck, shown))
        older = bisect.bisect_left(steps, shown[0])
        if len(shown) < len(steps):
            more = f"; older: ckpt ls {url} --before {shown[0]}" if older else ""
            typer.echo(f"{len(shown)} of {len(steps)} committed steps ({shown[0]}..{shown[-1]}){more}")


# --- show ----------------------------------------------------------------------------------------

def describe_lineage(lineage: dict | None) -> str:
    return "-" if not lineage else f"branched from step {lineage.get('step')} of {lineage.get('run')}"


def describe_manifest(m: Manifest, frags: dict, verdict: dict | None) -> list[str]:
    """The lines of ``ckpt show`` (plain text; the ``digest: <hex>`` line is exact); ``frags``: the
    fragment of every part."""
    stats = m.stats
    blobs = {b.key: b for f in frags.values() for b in f.blobs.values()}
    depth = max((b.depth for b in blobs.values()), default=0)
    tensors = sum(len(f.leaves) for f in frags.values())
    lines = [
        f"step: {m.step}",
        f"digest: {m.digest}",
        f"parent: {'-' if m.parent is None else m.parent}",
        f"created: {m.created}",
        f"lineage: {describe_lineage(m.lineage)}",
        f"kind: {m.kind}",
        f"layout: {'single writer' if m.single else f'multi-part ({len(m.parts)} parts)'}",
        f"tensors: {tensors}",
        f"logical bytes: {m.logical_bytes} ({fmt_bytes(m.logical_bytes)})",
        f"bytes written: {m.bytes_written} ({fmt_bytes(m.bytes_written)}, "
        f"{fmt_ratio(m.logical_bytes, m.bytes_written)} smaller than the state)",
        f"stored bytes: {m.stored_bytes} ({fmt_bytes(m.stored_bytes)}, every object this checkpoint needs)",
        f"chunks: {stats.get('keyframe', 0)} keyframe, {stats.get('delta', 0)} delta, "
        f"{stats.get('unchanged', 0)} unchanged; {len(blobs)} stored objects needed, longest delta chain {depth}",
        "parts:",
    ]
    for name, f in frags.items():
        lines.append(
            f"  {name}: generation {f.generation}, {len(f.leaves)} leaves, {fmt_bytes(f.bytes_written)} written, "
            f"{fmt_bytes(f.logical_bytes)} logical, digest {f.digest}"
            + (f", config {f.config_hash}" if f.config_hash else ""))
    lines.append(f"meta: {json.dumps(m.meta, sort_keys=True, default=str)}")
    if not m.single:
        for name, f in frags.items():
            if f.meta:
                lines.append(f"  {name} meta: {json.dumps(f.meta, sort_keys=True, default=str)}")
    lines.append(f"validation: {verdict_word(verdict)}"
                 + (f" ({', '.join(map(str, verdict.get('failed', [])))})" if verdict and verdict.get("failed") else ""))
    return lines


@app.command("show")
def show(url: UrlArg, step: StepOpt = None, storage_options: StorageOptionsOpt = None) -> None:
    """Details of one checkpoint (default: the latest): digest, parent, parts, sizes, chunk stats, meta."""
    with command_errors(), open_checkpointer(url, storage_options) as ck:
        m = ck.manifest(step)
        frags = {name: ck.fragment(m.step, name) for name in m.parts}
        for line in describe_manifest(m, frags, ck.verdict(m.step)):
            typer.echo(line)


# --- verify --------------------------------------------------------------------------------------

@app.command("verify")
def verify(url: UrlArg, step: StepOpt = None,
           all_steps: Annotated[bool, typer.Option("--all", help="Verify every committed checkpoint.")] = False,
           storage_options: StorageOptionsOpt = None) -> None:
    """Decode every chunk and check every checksum and digest. Exit 0: intact; 1: damaged (one line per problem)."""
    with command_errors():
        if all_steps and step is not None:
            raise ValueError("give either --step N or --all, not both")
        with open_checkpointer(url, storage_options) as ck:
            if all_steps:
                steps = ck.steps()
                if not steps:
                    from ckptlib import NoCheckpoint

                    raise NoCheckpoint(f"no committed checkpoint in {ck.url}")
            else:
                steps = [ck.manifest(step).step]
            damaged: dict[int, int] = {}
            for s in steps:
                problems = ck.verify(s)
                for p in problems:
                    typer.echo(str(p))
                if problems:
                    damaged[s] = len(problems)
                else:
                    typer.echo(f"step {s}: intact")
    if damaged:
        total = sum(damaged.values())
        fail(f"{total} problem(s) in step(s) {', '.join(map(str, damaged))} of {url}: restore an intact step "
             "(`ckpt ls` lists them) and check the store", code=1)
    typer.echo(f"intact: {len(steps)} checkpoint(s) verified")


# --- gc ------------------------------------------------------------------------------------------

@app.command("gc")
def gc(url: UrlArg,
       keep_last: Annotated[int, typer.Option("--keep-last", help="Keep the newest N committed steps (N >= 1).")],
       keep_every: Annotated[Optional[int], typer.Option("--keep-every", help="Also keep every step divisible by K.")] = None,
       keep: Annotated[Optional[list[int]], typer.Option("--keep", help="Also keep this step (repeatable).")] = None,
       grace_seconds: Annotated[Optional[float], typer.Option(
           "--grace-seconds", min=0.0, show_default=False,
           help="Only delete unreferenced objects older than this (protects saves in flight; default: "
                "ckptlib.gc.DEFAULT_GRACE_S, 10 minutes).")] = None,
       dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be deleted; delete nothing.")] = False,
       storage_options: StorageOptionsOpt = None) -> None:
    """Drop checkpoints a retention policy does not keep and sweep objects no kept checkpoint needs."""
    with command_errors():
        from ckptlib import RetentionPolicy
        from ckptlib.gc import DEFAULT_GRACE_S

        policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every, keep_named=frozenset(keep or ()))
        with open_checkpointer(url, storage_options) as ck:
            report = ck.gc(policy, grace_s=DEFAULT_GRACE_S if grace_seconds is None else grace_seconds,
                           dry_run=dry_run)
        would = "would " if dry_run else ""
        chunks = [k for k in report.deleted_objects if k.startswith("chunks/")]
        typer.echo(f"kept {len(report.kept_steps)} step(s): {_steps_text(report.kept_steps)}")
        typer.echo(f"{would}drop {len(report.dropped_steps)} step(s): {_steps_text(report.dropped_steps)}")
        typer.echo(f"{would}delete {len(report.deleted_objects)} object(s) ({len(chunks)} chunks); "
                   f"{would}free {report.freed_bytes} bytes ({fmt_bytes(report.freed_bytes)}) of chunks")
        if dry_run:
            typer.echo("dry run: nothing was deleted")


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "-"


# --- export --------------------------------------------------------------------------------------

@app.command("export")
def export(url: UrlArg,
           out: Annotated[str, typer.Option("--out", metavar="FILE", help="Output file: *.pt or *.safetensors.")],
           step: StepOpt = None, storage_options: StorageOptionsOpt = None,
           force: Annotated[bool, typer.Option("--force", help="Replace FILE if it exists.")] = False) -> None:
    """Write one checkpoint (default: the latest) as a .pt (torch.load(weights_only=True)) or .safetensors file.

    The file is written atomically (a temp file beside it, renamed); an existing FILE is replaced
    only with --force. A state the format cannot hold is refused with the value that does not fit."""
    with command_errors():
        from ckptlib.export import format_of

        format_of(out)
        with open_checkpointer(url, storage_options) as ck:
            m = ck.manifest(step)
            size = ck.export(m.step, out, force=force)
        typer.echo(f"exported step {m.step} (digest {m.digest}) of {ck.url} to {out} ({fmt_bytes(size)})")


# --- demo ----------------------------------------------------------------------------------------

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
