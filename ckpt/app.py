"""The `ckpt` Typer application, on which each command module registers its commands (``ckpt.cli``
imports them all, in the order `ckpt --help` lists them)."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ckpt",
    help="Incremental checkpoints and fault-tolerant training runs on Prefect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
