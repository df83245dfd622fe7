"""What every ``ckpt`` command shares: option types, the one-line error boundary, parsing of
``--storage-options`` and JSON options, opening a run's store, and formatting.

Contract of every command:

* ``--storage-options @FILE`` (or ``JSON``) gives s3fs arguments for ``s3://`` URLs; without it,
  ``CKPT_STORAGE_OPTIONS`` (the same two forms), then the standard AWS environment variables
  (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). Inline JSON shows in ``ps``: prefer a file
  (``trainrun.credentials``). A URL holding credentials (``s3://key:secret@...``) is refused.
* An expected failure (a ``ckptlib.CheckpointError``, a bad option, an unwritable output path)
  prints ONE line ``error: <cause and fix>`` to stderr and exits with code 2 (``fail``,
  ``command_errors``); no traceback.
* Heavy imports (torch via ckptlib) happen inside the functions, so ``ckpt --help`` stays fast.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

if TYPE_CHECKING:
    from ckptlib import Checkpointer

WORKLOAD_EXTRA_EXAMPLE = '\'{"d_model": 64}\''

UrlArg = Annotated[str, typer.Argument(
    metavar="URL", help="The run's store: a path, file:///abs/path, memory://name or s3://bucket/prefix.")]
STORAGE_OPTIONS_HELP = ("s3fs arguments for an s3:// store: @FILE of a JSON object (e.g. "
                        "'{\"endpoint_url\": \"http://127.0.0.1:8333\", \"key\": \"k\", \"secret\": \"s\"}'), or the JSON "
                        "itself (which `ps` shows to every user). Default: CKPT_STORAGE_OPTIONS, then AWS_* variables.")
StorageOptionsOpt = Annotated[Optional[str], typer.Option("--storage-options", metavar="@FILE|JSON",
                                                          help=STORAGE_OPTIONS_HELP)]
StepOpt = Annotated[Optional[int], typer.Option("--step", min=0, help="Checkpoint step (default: the latest).")]


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


def console():
    from rich.console import Console

    return Console(highlight=False, markup=False, soft_wrap=True)
