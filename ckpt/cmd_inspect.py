"""Reading a run's checkpoints: ``ckpt ls | show | verify``. Nothing here writes checkpoints.

Each command opens one run's store (a path, ``file://``, ``memory://`` or ``s3://`` URL; s3fs
arguments from ``--storage-options``, ``CKPT_STORAGE_OPTIONS`` or the AWS_* variables, see
``ckpt/common.py``) through ``ckptlib.Checkpointer``. An expected failure prints one ``error:`` line
and exits 2; ``verify`` exits 1 when it finds damage (and prints one line per problem).

One damaged step stays one damaged step: ``ls`` lists the others and marks it (with its reason,
one line; exit 0: a listing is not a check), ``show`` of it is one ``error:`` line, ``verify``
reports it among the others (exit 1).

Only ``verify`` writes, and only its findings (``ckptlib.damage``: the note of a step it found
damaged, deleted when it finds the step intact): ``ls`` marks those steps DAMAGED, a restore of the
latest skips them, and no save trusts the objects they name because they exist.
"""

from __future__ import annotations

import bisect
import json
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from .app import app
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


def checkpoint_table(ck: Checkpointer, steps: list[int] | None = None, damaged: dict[int, str] | None = None):
    """The rich table of ``ckpt ls`` (also printed by ``ckpt demo``): one row per step of ``steps``
    (default: every committed step). Each row reads the step's manifest and verdict, eight steps at
    a time (a remote store answers each read in a round trip). A step whose manifest cannot be
    read, or that ``verify`` found damaged (``ckptlib.damage``), is a row marked DAMAGED in the kind
    column (UNREADABLE: of a format this ckptlib does not read); its reason goes into ``damaged``."""
    from concurrent.futures import ThreadPoolExecutor

    from rich.table import Table

    from ckptlib import CorruptCheckpoint, FormatVersionError, NoCheckpoint
    from ckptlib.damage import flagged_steps

    flagged = flagged_steps(ck.store)

    table = Table(title=f"checkpoints in {ck.url}", title_justify="left")
    for name, justify in (("step", "right"), ("kind", "left"), ("written", "right"), ("ratio", "right"),
                          ("stored", "right"), ("digest", "left"), ("validation", "left")):
        table.add_column(name, justify=justify, no_wrap=True)

    def row(step: int) -> tuple[str, ...] | None:
        from ckptlib import commit

        try:
            m = commit.read_manifest(ck.store, step)
        except NoCheckpoint:
            return None  # dropped (by a GC) since the listing
        except (CorruptCheckpoint, FormatVersionError) as e:
            if damaged is not None:
                damaged[step] = one_line(getattr(e, "reason", e))
            word = "UNREADABLE" if isinstance(e, FormatVersionError) else "DAMAGED"
            return (str(step), word, "-", "-", "-", "-", verdict_word(ck.verdict(step)), "-")
        note = flagged.get(step)
        if note is not None and damaged is not None:
            damaged[step] = one_line(note.summary())
        return (str(step), m.kind if note is None else "DAMAGED", fmt_bytes(m.bytes_written),
                fmt_ratio(m.logical_bytes, m.bytes_written),
                fmt_bytes(m.stored_bytes), m.digest[:12], verdict_word(ck.verdict(step)), short_lineage(m))

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckpt-ls") as pool:
        rows = [cells for cells in pool.map(row, ck.steps() if steps is None else steps) if cells is not None]
    branched = any(cells[-1] != "-" for cells in rows)
    if branched:  # a branch's steps say where it came from (a column only then: the table stays narrow)
        table.add_column("from", justify="left", no_wrap=True)
    for cells in rows:
        table.add_row(*(cells if branched else cells[:-1]))
    return table


def one_line(text: object, limit: int = 300) -> str:
    """``text`` on one line, at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def damage_lines(url: str, damaged: dict[int, str]) -> list[str]:
    """What ``ls`` prints under its table about damaged steps: one line each, then the fix."""
    if not damaged:
        return []
    lines = [f"damaged: step {step}: {reason}" for step, reason in sorted(damaged.items())]
    first = min(damaged)
    return lines + [f"{len(damaged)} damaged step(s): a resume skips them (it takes the newest healthy step); "
                    f"`ckpt quarantine {url} --step {first}` moves one aside (nothing is deleted)"]


def quarantine_lines(ck: Checkpointer) -> list[str]:
    """One line per step in quarantine (moved aside by ``ckpt quarantine``)."""
    from ckptlib.quarantine import quarantined

    return [f"in quarantine: step {step} (since {r.time}: {one_line(r.reason, 200)}); "
            f"`ckpt quarantine {ck.url} --step {step} --undo` puts it back"
            for step, r in sorted(quarantined(ck.store).items())]


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
    run with 10,000 checkpoints lists in about the time of its listing; ``--before`` pages back. A
    step whose manifest cannot be read is listed as DAMAGED, with its reason under the table (exit 0:
    `ckpt verify` is the check); steps moved aside by `ckpt quarantine` are named too."""
    with command_errors(), open_checkpointer(url, storage_options) as ck:
        steps = ck.steps()
        if not steps:
            runs = _runs_below(url) if "://" not in url or url.startswith("file://") else []
            hint = f" It holds runs: {', '.join(runs)} (e.g. `ckpt ls {url.rstrip('/')}/{runs[0]}`)." if runs else ""
            typer.echo(f"no committed checkpoints in {ck.url}.{hint}")
            for line in quarantine_lines(ck):
                typer.echo(line)
            return
        shown = page_of(steps, limit, before)
        if not shown:
            typer.echo(f"no committed checkpoint before step {before} in {ck.url} (steps {steps[0]}..{steps[-1]})")
            return
        damaged: dict[int, str] = {}
        console().print(checkpoint_table(ck, shown, damaged))
        for line in damage_lines(ck.url, damaged) + quarantine_lines(ck):
            typer.echo(line)
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


def describe_manifest(m: Manifest, frags: dict, verdict: dict | None, tensors: int | None = None) -> list[str]:
    """The lines of ``ckpt show`` (plain text; the ``digest: <hex>`` line is exact); ``frags``: the
    fragment of every part; ``tensors``: how many (``count_tensors``; ``-`` when not given)."""
    stats = m.stats
    blobs = {b.key: b for f in frags.values() for b in f.blobs.values()}
    depth = max((b.depth for b in blobs.values()), default=0)
    worlds = [f.world for f in frags.values() if hasattr(f, "world")]  # a group's part: saved by its ranks
    if m.single:
        layout = f"group of {worlds[0]} ranks (one collective save)" if worlds else "single writer"
    else:
        layout = f"multi-part ({len(m.parts)} parts" + (f", {len(worlds)} of them groups of ranks)" if worlds else ")")
    lines = [
        f"step: {m.step}",
        f"digest: {m.digest}",
        f"parent: {'-' if m.parent is None else m.parent}",
        f"created: {m.created}",
        f"lineage: {describe_lineage(lineage_of(m))}",
        f"kind: {m.kind}",
        f"layout: {layout}",
        f"tensors: {'-' if tensors is None else tensors}",
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
            f"  {name}: generation {f.generation}, "
            + (f"{f.world} ranks" if hasattr(f, "world") else f"{len(f.leaves)} leaves")
            + f", {fmt_bytes(f.bytes_written)} written, "
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
        for f in frags.values():
            check_fragment(ck, f)
        for line in describe_manifest(m, frags, ck.verdict(m.step), count_tensors(ck, frags)):
            typer.echo(line)


def count_tensors(ck: Checkpointer, frags: dict) -> int:
    """The tensors (leaves) of every part: a plain fragment's leaves; for a group's part, the
    distinct leaf paths of its rank fragments (read and checked together: a damaged one raises)."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptlib.distributed.restoring import load_group

    count = 0
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckpt-show") as pool:
        for f in frags.values():
            if not hasattr(f, "world"):
                count += len(f.leaves)
                continue
            group = load_group(ck.store, pool, f)
            count += len({leaf.spec.path for r in range(group.world) for leaf in group.layout(r).leaves})
    return count


def check_fragment(ck: Checkpointer, frag) -> None:
    """Raise the step's DamagedStep when what ``show`` can check without reading a chunk is not
    what save writes: the skeleton's grammar, every object's codec list (``verify`` checks the data)."""
    from ckptlib import CorruptCheckpoint, codecs, commit
    from ckptlib.tree import MISSING, unflatten

    try:
        if hasattr(frag, "skeleton"):  # a group's part has its skeletons in its rank fragments (verify reads them)
            unflatten(frag.skeleton, [MISSING] * len(frag.leaves), [leaf.spec for leaf in frag.leaves])
        for blob in frag.blobs.values():
            chain = codecs.from_configs(list(blob.codecs))
            if chain[0].uses_base != (blob.base is not None) or any(c.uses_base for c in chain[1:]):
                raise CorruptCheckpoint(f"object {blob.key}: its codecs {list(blob.codecs)} and its base disagree")
    except CorruptCheckpoint as e:
        raise commit.damaged_step(ck.store, frag.step, f"part '{frag.part}': {e}") from None


# --- verify --------------------------------------------------------------------------------------

@app.command("verify")
def verify(url: UrlArg,
           step: Annotated[Optional[int], typer.Option("--step", min=0, help="Verify only this step.")] = None,
           all_steps: Annotated[bool, typer.Option("--all", help="Verify every committed step (the default; kept "
                                                   "for scripts that pass it).")] = False,
           storage_options: StorageOptionsOpt = None) -> None:
    """Decode every chunk of every committed step (--step N: that one) and check every checksum and digest.

    One line per problem, then a line per step (intact, or damaged with its count). Exit 0: every
    step verified intact; 1: some step is damaged (or cannot be read); 2: the arguments or the
    store are wrong."""
    with command_errors():
        if all_steps and step is not None:
            raise ValueError("give either --step N (one step) or --all (every step, the default), not both")
        with open_checkpointer(url, storage_options) as ck:
            from ckptlib import NoCheckpoint, commit

            steps = ck.steps()
            if step is not None and step not in steps:
                commit.read_manifest(ck.store, step)  # NoCheckpoint naming the step and what to do
            steps = [step] if step is not None else steps
            if not steps:
                raise NoCheckpoint(f"no committed checkpoint in {ck.url}")
            damaged: dict[int, int] = {}
            verified = 0
            for s in steps:
                problems = _problems(ck, s)
                if problems is None:
                    continue
                verified += 1
                for p in problems:
                    typer.echo(p)
                if problems:
                    damaged[s] = len(problems)
                typer.echo(f"step {s}: damaged ({len(problems)} problem(s))" if problems else f"step {s}: intact")
    if damaged:
        total = sum(damaged.values())
        fail(f"{total} problem(s) in step(s) {', '.join(map(str, damaged))} of {url} ({verified - len(damaged)} of "
             f"{verified} intact): restore an intact step (`ckpt ls` lists them) and check the store; `ckpt "
             f"quarantine {url} --step {min(damaged)}` moves a damaged step aside", code=1)
    typer.echo(f"intact: {verified} checkpoint(s) verified")


def _problems(ck: Checkpointer, step: int) -> list[str] | None:
    """The problems of ``step`` as lines ([]: intact; None: no longer committed). A step whose
    manifest cannot be read, or that cannot be checked on this machine, is one problem."""
    from ckptlib import CheckpointError, NoCheckpoint

    try:
        return [str(p) for p in ck.verify(step)]
    except NoCheckpoint:
        if step in ck.steps():
            raise
        typer.echo(f"step {step}: no longer committed (dropped since the listing)")
        return None
    except CheckpointError as e:
        return [one_line(e, 2000)]
