"""The `ckpt` command. Each group of commands lives in its own module and registers on ``app``.

Heavy imports (torch, prefect, great_expectations) happen inside the commands, so `ckpt --help`
and `ckpt ls` start fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ckpt",
    help="Incremental checkpoints and fault-tolerant training runs on Prefect.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Command modules register themselves on ``app`` when imported (one module per area).
from . import (  # noqa: E402 - after app exists
    cmd_bench,  # noqa: E402,F401  bench
    cmd_store,  # noqa: E402,F401  ls, show, verify, gc, export, demo
    cmd_train,  # noqa: E402,F401  train
    cmd_validate,  # noqa: E402,F401  validate, report
    cmd_watchdog,  # noqa: E402,F401  watchdog, status
)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
