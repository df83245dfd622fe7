"""`ckpt validate` and `ckpt report`: judge checkpoints and list their verdicts and reports.

Both run ckptlib.validate directly, with a training run's checks (``trainrun.checks``; no Prefect
needed). Exit codes of `validate`: 0 passed, 1 failed, 2 the step is not committed or the arguments
are wrong, 3 the store cannot be reached.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from .app import app
from .common import STORAGE_OPTIONS_HELP, fail, storage_options_or_exit, url_or_exit


@app.command("validate")
def validate(
    url: str = typer.Argument(..., help="The run's store URL (path, file://, s3://bucket/prefix)."),
    step: Optional[int] = typer.Option(None, "--step", help="Checkpoint step; default the latest committed."),
    storage_options: Optional[str] = typer.Option(None, "--storage-options", metavar="@FILE|JSON",
                                                  help=STORAGE_OPTIONS_HELP),
    thresholds: Optional[str] = typer.Option(None, "--thresholds",
                                             help='Threshold overrides as JSON, e.g. \'{"max_rel_change": 20}\'.'),
    as_json: bool = typer.Option(False, "--json", help="Print the whole verdict as JSON."),
) -> None:
    """Validate a committed checkpoint: integrity, structure, numerics, optimizer, progress.

    Writes validations/<step>.json and reports/<step>/ beside it. Exit 0 when it passed, 1 when it
    failed (the failed expectations and where are printed)."""
    from ckptlib.errors import CheckpointError, StoreError
    from ckptlib.validate import format_verdict
    from trainrun.checks import validate_run_checkpoint

    url = url_or_exit(url)
    opts = storage_options_or_exit(storage_options)
    try:
        th = json.loads(thresholds) if thresholds else None
        verdict = validate_run_checkpoint(url, step, storage_options=opts, thresholds=th)
    except StoreError as e:  # (ObjectNotFound is a finding, inside the verdict)
        fail(str(e), code=3)
    except (CheckpointError, ValueError) as e:  # NoCheckpoint, or what no verdict can describe
        fail(str(e))
    typer.echo(json.dumps(verdict.to_dict(), indent=1) if as_json else format_verdict(verdict))
    raise typer.Exit(0 if verdict.passed else 1)


@app.command("report")
def report(
    url: str = typer.Argument(..., help="The run's store URL."),
    storage_options: Optional[str] = typer.Option(None, "--storage-options", metavar="@FILE|JSON",
                                                  help=STORAGE_OPTIONS_HELP),
) -> None:
    """List every checkpoint with its verdict and report; write/refresh reports/index.html."""
    from rich.console import Console
    from rich.table import Table

    from ckptlib.errors import CheckpointError, StoreError
    from ckptlib.store import Store
    from ckptlib.validate.report import damaged_note, index_rows, write_run_index

    try:
        store = Store.from_url(url_or_exit(url), storage_options_or_exit(storage_options))
        rows = index_rows(store)
        key = write_run_index(store, rows)
    except StoreError as e:
        fail(str(e), code=3)
    except CheckpointError as e:
        fail(str(e))
    table = Table(title=f"checkpoints of {store.url}")
    for col in ("step", "verdict", "failed expectations", "kind", "written MiB", "full MiB", "ratio", "loss",
                "report"):
        table.add_column(col, overflow="fold")
    for r in rows:
        style = "red" if r.get("damaged") else "green" if r["passed"] else "red" if r["passed"] is False else "dim"
        mib = lambda n: "" if n is None else f"{n / 2**20:.2f}"  # noqa: E731
        loss = r.get("loss")
        table.add_row(str(r["step"]), f"[{style}]{r['verdict']}[/{style}]", r.get("damaged") or ", ".join(r["failed"]),
                      str(r.get("kind") or ""), mib(r.get("bytes_written")), mib(r.get("logical_bytes")),
                      "" if r.get("ratio") is None else str(r["ratio"]),
                      "" if not isinstance(loss, (int, float)) else f"{loss:.4f}", r.get("report_url") or "")
    Console(width=200).print(table)
    for r in rows:
        if r.get("damaged"):
            typer.echo(f"damaged: step {r['step']}: {r['damaged']}")
    if damaged_note(rows):
        typer.echo(f"{damaged_note(rows).lstrip(', ')}; a resume skips a damaged step")
    typer.echo(f"index: {store.url}/{key}")
