"""Reading a run's checkpoints: ``ckpt ls | show | verify``. Nothing here writes to a store.

Each command opens one run's store (a path, ``file://``, ``memory://`` or ``s3://`` URL; s3fs
arguments from ``--storage-options``, ``CKPT_STORAGE_OPTIONS`` or the AWS_* variables, see
``ckpt/common.py``) through ``ckptlib.Checkpointer``. An expected failure prints one ``error:`` line
and exits 2; ``verify`` exits 1 when it finds damage (and prints one line per problem).
"""

from __future__ import annotations

import bisect
import json
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
                fmt_bytes(m.stored_bytes), m.digest[:12], verdict_word(ck.verdict(step)), short_lineage(m))

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckpt-ls") as pool:
        rows = list(pool.map(row, ck.steps() if steps is None else steps))
    branched = any(cells[-1] != "-" for cells in rows)
    if branched:  # a branch's steps say where it came from (a column only then: the table stays narrow)
        table.add_column("from", justify="left", no_wrap=True)
    for cells in rows:
        table.add_row(*(cells if branched else cells[:-1]))
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


def lineage_of(m: Manifest) -> dict | None:
    """Where a step's run came from: the branch point's own ``lineage``, a later step's ``meta.lineage``."""
    lineage = m.lineage or m.meta.get("lineage")
    return lineage if isinstance(lineage, dict) else None


def short_lineage(m: Manifest) -> str:
    """``ckpt ls``'s column: ``<source run>@<step>`` of a branch, ``-`` otherwise."""
    lineage = lineage_of(m)
    return "-" if lineage is None else f"{str(lineage.get('run', '')).rstrip('/').rsplit('/', 1)[-1]}@{lineage.get('step')}"


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
        f"lineage: {describe_lineage(lineage_of(m))}",
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
