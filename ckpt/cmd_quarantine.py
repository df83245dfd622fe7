"""``ckpt quarantine``: move a damaged committed step aside (``ckptlib.quarantine``), or put it back.

A damaged step blocks nothing once it is aside: listings, restores, resumes and garbage collection
no longer see it, nothing is deleted, and GC keeps the objects it names until the quarantine is
undone (``--undo``) or its folder removed by hand. An intact step is refused unless ``--force``.
What the check found stays recorded (``ckptlib.damage``: ``damage/<step>.json``; with ``--force``,
every object the step names): no later save trusts those objects because they exist.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from .app import app
from .common import StorageOptionsOpt, UrlArg, command_errors, fail, open_checkpointer


@app.command("quarantine")
def quarantine(url: UrlArg,
               step: Annotated[Optional[int], typer.Option(
                   "--step", min=0, help="The committed step to move aside (without it: list the steps in quarantine).")]
               = None,
               undo: Annotated[bool, typer.Option("--undo", help="Put a quarantined step back (committed again).")] = False,
               force: Annotated[bool, typer.Option(
                   "--force", help="Move the step aside even if it verifies intact (it is not verified then).")] = False,
               reason: Annotated[Optional[str], typer.Option("--reason", help="Why, recorded with it.")] = None,
               storage_options: StorageOptionsOpt = None) -> None:
    """Move a damaged checkpoint aside to quarantine/<step>/ (nothing is deleted), or put it back with --undo.

    The step is checked first (its manifest, its fragments, every chunk, as `ckpt verify`): an
    intact step is refused unless --force. Prints how to undo it."""
    from ckptlib import quarantine as q

    with command_errors(), open_checkpointer(url, storage_options) as ck:
        if step is None:
            if undo or force:
                raise ValueError("--undo and --force need --step N")
            records = q.quarantined(ck.store)
            for s, r in sorted(records.items()):
                typer.echo(f"step {s}: in quarantine since {r.time} ({r.reason}); undo: ckpt quarantine {ck.url} "
                           f"--step {s} --undo")
            if not records:
                typer.echo(f"no step of {ck.url} is in quarantine")
            return
        if undo:
            q.release_step(ck.store, step)
            typer.echo(f"step {step} of {ck.url} is committed again (put back from {ck.url}/{q.quarantine_folder(step)}/)")
            return
        why = "moved aside by hand (--force), not verified" if force else _damage(ck, step)
        if why is None:
            fail(f"step {step} of {ck.url} verifies intact (every chunk decodes to its checksum): quarantine is "
                 "for damaged steps; pass --force to move it aside anyway")
        record = q.quarantine_step(ck.store, step, f"{reason}: {why}" if reason else str(why))
    typer.echo(f"step {step} of {ck.url} moved to {ck.url}/{q.quarantine_folder(step)}/ ({record.reason})")
    typer.echo("nothing was deleted, and garbage collection keeps the objects it names; undo: "
               f"ckpt quarantine {ck.url} --step {step} --undo")


def _damage(ck, step: int) -> str | None:
    """Why committed ``step`` is damaged (its first problem, one line), or None when it verifies intact."""
    from ckptlib import CorruptCheckpoint, FormatVersionError

    try:
        problems = ck.verify(step)
    except (CorruptCheckpoint, FormatVersionError) as e:
        return " ".join(str(getattr(e, "reason", e)).split())
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return f"{problems[0]}{more}"
