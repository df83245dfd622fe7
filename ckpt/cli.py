"""The `ckpt` command. Each group of commands lives in its own module and registers on ``app``.

Heavy imports (torch, prefect, great_expectations) happen inside the commands, so `ckpt --help`
and `ckpt ls` start fast.
"""

from __future__ import annotations

from .app import app  # noqa: F401  (the entry point and the tests take it from here)

# Command modules register themselves on ``app`` when imported (one module per area), in the order
# `ckpt --help` lists their commands.
# isort: off
from . import cmd_bench  # noqa: E402,F401  bench
from . import cmd_inspect  # noqa: E402,F401  ls, show, verify
from . import cmd_gc  # noqa: E402,F401  gc
from . import cmd_quarantine  # noqa: E402,F401  quarantine
from . import cmd_export  # noqa: E402,F401  export
from . import cmd_demo  # noqa: E402,F401  demo
from . import cmd_train  # noqa: E402,F401  train
from . import cmd_soak  # noqa: E402,F401  soak
from . import cmd_validate  # noqa: E402,F401  validate, report
from . import cmd_watchdog  # noqa: E402,F401  watchdog, status
# isort: on


def main() -> None:
    app()


if __name__ == "__main__":
    main()
