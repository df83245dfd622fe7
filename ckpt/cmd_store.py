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

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from .cli import app

if TYPE_CHECKING:
    from ckptlib import Checkpointer
    from ckptlib.manifest import Manifest

WORKLOAD_EXTRA_EXAMPLE = '\'{"d_model": 64}\''

UrlArg = Annotated[str, typer.Argument(
    metavar="URL", help="The run's store: a path, file:///abs/path, memory://name or s3://bucket/prefix.")]
STORAGE_OPTIONS_HELP = ("s3fs arguments for an s3:// store: @FILE of a JSON object (e.g. "
                        "'{\"endpoint_url\": \"http://127.0.0.1:8333\", \"key\": \"k\", \"secret\": \"s\"}'), or the JSON "
                        "itself (which `ps` shows to every user). Default: CKPT_STORAGE_OPTIONS, then AWS_* variables.")
StorageOptionsOpt = Annotated[Optional[str], typer.Option("--storage-options", metavar="@FILE|JSON",
                                                          help=STORAGE_OPTIONS_HELP)]
StepOpt = Annotated[Optional[int], typer.Option("--step", min=0, help="Checkpoint step (default: the latest).")]


# --- shared helpers ------------------------------------------------------------------------------

def fail(message: str, code: int = 2) -> None:
    """Print one ``error:`` line to stderr and exit with ``code``."""
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    raise typer.Exit(code)


@contextmanager
def command_errors() -> Iterator[None]:
    """The command boundary: expected errors become one stderr line and exit code 2."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:  # noqa: BLE001 - re-raised below unless it is an expected error
        from ckptlib import CheckpointError

        if isinstance(e, (CheckpointError, ValueError, OSError, TimeoutError)):
            fail(str(e) or type(e).__name__)
        raise


def parse_json_object(text: str | None, option: str, example: str, what: str = "") -> dict[str, Any] | None:
    """The JSON object given to ``option``, or None when not given. ValueError names the fix."""
    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{option} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): give a JSON "
            f"object{what}, e.g. {option} {example}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{option} must be a JSON object, got a JSON {type(value).__name__}: e.g. {option} {example}")
    return value


def parse_storage_options(text: str | None) -> dict[str, Any] | None:
    """The s3fs options of ``--storage-options`` (@FILE or JSON), else of ``CKPT_STORAGE_OPTIONS``,
    else None (s3fs then reads the AWS_* variables). ValueError names the fix, never the content."""
    from trainrun.credentials import parse_storage_options as parse
    from trainrun.credentials import storage_options_from_env

    return parse(text) if text is not None and text.strip() else storage_options_from_env()


def storage_options_or_exit(text: str | None) -> dict[str, Any] | None:
    """``parse_storage_options`` for a command: a bad value prints one error line and exits 2."""
    try:
        return parse_storage_options(text)
    except ValueError as e:
        fail(str(e))


def url_or_exit(url: str) -> str:
    """``url``, unless it holds credentials (``s3://key:secret@...``): one error line (not showing
    them) and exit 2."""
    from trainrun.credentials import check_url

    try:
        return check_url(url)
    except ValueError as e:
        fail(str(e))
    raise AssertionError("unreachable")


def open_checkpointer(url: str, storage_options: str | None, *, must_exist: bool = True) -> Checkpointer:
    """A Checkpointer on ``url``. With ``must_exist``, a local path that does not exist is an error
    (a typo would otherwise look like an empty store)."""
    from ckptlib import Checkpointer, NoCheckpoint
    from ckptlib.store import LocalStore, Store

    store = Store.from_url(url_or_exit(url), parse_storage_options(storage_options))
    if must_exist and isinstance(store, LocalStore) and not os.path.isdir(store.root):
        raise NoCheckpoint(f"no store at {store.root}: the directory does not exist. Check the path "
                           "(`ckpt demo --store PATH` creates a store with a few checkpoints)")
    return Checkpointer(store)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_ratio(logical: int, written: int) -> str:
    return "inf" if written == 0 else f"{logical / written:.1f}x"


def verdict_word(verdict: dict | None) -> str:
    if verdict is None:
        return "-"
    return "passed" if verdict.get("passed") is True else "failed"


def checkpoint_table(ck: Checkpointer, steps: list[int] | None = None):
    """The rich table of ``ckpt ls`` (also printed by ``ckpt demo``)."""
    from rich.table import Table

    table = Table(title=f"checkpoints in {ck.url}", title_justify="left")
    for name, justify in (("step", "right"), ("kind", "left"), ("written", "right"), ("ratio", "right"),
                          ("stored", "right"), ("digest", "left"), ("validation", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    for step in ck.steps() if steps is None else steps:
        m = ck.manifest(step)
        table.add_row(str(step), m.kind, fmt_bytes(m.bytes_written), fmt_ratio(m.logical_bytes, m.bytes_written),
                      fmt_bytes(m.stored_bytes), m.digest[:12], verdict_word(ck.verdict(step)))
    return table


def console():
    from rich.console import Console

    return Console(highlight=False, markup=False, soft_wrap=True)


def _runs_below(url: str) -> list[str]:
    """The runs under a local store root (``trainrun.layout.find_runs``), as paths relative to it."""
    from ckptlib.store import Store
    from trainrun.layout import find_runs

    try:
        return [p for p in find_runs(Store.from_url(url)) if p]
    except Exception:  # noqa: BLE001 - only a hint
        return []


# --- ls ------------------------------------------------------------------------------------------

@app.command("ls")
def ls(url: UrlArg, storage_options: StorageOptionsOpt = None) -> None:
    """List the committed checkpoints of a run: step, kind, bytes written, ratio, digest, validation."""
    with command_errors(), open_checkpointer(url, storage_options) as ck:
        if not ck.steps():
            runs = _runs_below(url) if "://" not in url or url.startswith("file://") else []
            hint = f" It holds runs: {', '.join(runs)} (e.g. `ckpt ls {url.rstrip('/')}/{runs[0]}`)." if runs else ""
            typer.echo(f"no committed checkpoints in {ck.url}.{hint}")
            return
        console().print(checkpoint_table(ck))


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
        from workloads.base import WorkloadConfig, build_workload

        from .bench import first_difference

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
