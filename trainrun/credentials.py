"""How a process reaches a run's store without a secret in any record.

Storage credentials (s3fs options: ``endpoint_url``, ``key``, ``secret``, ...) come, in this order, from

1. ``StoreAccess.options``: a ``StorageOptions`` (a pydantic ``Secret``) held by a process that was
   given them, e.g. ``ckpt train --storage-options @opts.json``. It travels to tasks in memory or
   pickled (Dask workers, the validation process); the repr and the dump of a ``StoreAccess`` (so
   every Prefect record of one) read ``'**********'``. Never pass a bare ``StorageOptions`` as a
   flow parameter: Prefect's encoder dumps a bare pydantic ``Secret``'s value (inside a model it
   is masked).
2. ``StoreAccess.block``: the name of a Prefect ``Secret`` block whose value is the options (a JSON
   object), or the slug ``checkpoint-store/NAME`` of a ``CheckpointStore`` block (``store_block``: the
   store's URL and its options in one block, ``tasks/store_block.py``), loaded where the store is
   opened (``tasks/access.py``; this package never imports Prefect).
3. The environment: ``CKPT_STORAGE_OPTIONS`` (a JSON object, or ``@path`` of a JSON file), else
   s3fs's own ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``.

Never: a plain dict of options as a flow or task parameter (Prefect stores parameters verbatim), a
URL with ``user:password@`` (refused by ``check_url``), options inline on a command line (``ps``
shows them: ``--storage-options '{...}'`` still works, and the docs say so).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pydantic

STORAGE_OPTIONS_ENV = "CKPT_STORAGE_OPTIONS"
HOW = ("the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL), --storage-options "
       f"@file.json, {STORAGE_OPTIONS_ENV}, a Prefect Secret block (credentials_block), or a Checkpoint Store "
       "block holding the URL and the options (store_block)")


class StorageOptions(pydantic.Secret[dict[str, Any]]):
    """s3fs options: masked in every repr, dump, log line and Prefect record of them."""


def parse_storage_options(text: str | None, what: str = "--storage-options") -> dict[str, Any] | None:
    """The options in ``text``: a JSON object, or ``@path`` of a file holding one; None when empty.

    ValueError names the fix, never the content (it may hold a secret)."""
    if text is None or not text.strip():
        return None
    text = text.strip()
    if text.startswith("@"):
        path = os.path.expanduser(text[1:])
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"{what}: cannot read {path} ({e.strerror}): give @path of a readable JSON file") from None
        what = f"{what} (file {path})"
    try:
        value = json.loads(text)
    except ValueError as e:
        msg = getattr(e, "msg", "not JSON")
        raise ValueError(f"{what} is not valid JSON ({msg}): give a JSON object of s3fs arguments, e.g. "
                         '{"endpoint_url": "http://127.0.0.1:8333"}, best in a file: --storage-options @opts.json') \
            from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object of s3fs arguments, got a JSON {type(value).__name__}: e.g. "
                         '{"endpoint_url": "http://127.0.0.1:8333"}')
    return value


def storage_options_from_env() -> dict[str, Any] | None:
    """``CKPT_STORAGE_OPTIONS`` (JSON or @file), or None."""
    return parse_storage_options(os.environ.get(STORAGE_OPTIONS_ENV), STORAGE_OPTIONS_ENV)


def export_storage_options(text: str | None) -> None:
    """Hand ``--storage-options`` to the flows this process runs (the watchdog's, whose parameters may
    hold no secret) through ``CKPT_STORAGE_OPTIONS``: a file by its absolute path, never its content;
    JSON as given. Nothing to hand (``text`` empty): the environment stays as it is."""
    if text is None or not text.strip():
        return
    text = text.strip()
    os.environ[STORAGE_OPTIONS_ENV] = f"@{os.path.abspath(os.path.expanduser(text[1:]))}" if text.startswith("@") else text


def check_url(url: str) -> str:
    """``url`` unless it holds credentials (``scheme://user:password@...``): ValueError, which shows
    the URL with them removed."""
    parts = urlsplit(url) if "://" in url else None
    if parts is not None and "@" in parts.netloc:
        shown = f"{parts.scheme}://***@{parts.netloc.rsplit('@', 1)[1]}{parts.path}"
        raise ValueError(f"the store URL {shown} holds credentials (user:password@): they would show in process "
                         f"lists, the Prefect UI and logs. Remove them from the URL and use {HOW}")
    return url


class StoreAccess(pydantic.BaseModel):
    """How a task reaches the store: ``options`` (masked) or a ``block`` name; neither: the environment."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    block: str | None = None
    options: StorageOptions | None = None

    def resolve(self, load_block: Callable[[str], Any] | None = None) -> dict[str, Any] | None:
        """The s3fs options (see the module docstring for the order). ``load_block(name)`` returns a
        Prefect Secret block's value; without it a block is an error."""
        if self.options is not None:
            return dict(self.options.get_secret_value())
        if self.block:
            if load_block is None:
                raise ValueError(f"credentials block {self.block!r} needs Prefect to be read (tasks/access.py)")
            value = load_block(self.block)
            if isinstance(value, str):
                return parse_storage_options(value, f"credentials block {self.block!r}")
            if not isinstance(value, dict):
                raise ValueError(f"credentials block {self.block!r} must hold a JSON object of s3fs arguments, got "
                                 f"a {type(value).__name__}")
            return dict(value)
        return storage_options_from_env()


def access(options: dict[str, Any] | StorageOptions | None = None, block: str | None = None) -> StoreAccess:
    """A StoreAccess from what a caller holds (options win over a block, as in ``resolve``)."""
    if isinstance(options, dict):
        options = StorageOptions(options)
    return StoreAccess(block=block or None, options=options)
