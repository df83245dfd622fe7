"""What ``StorageWriter`` and ``StorageReader`` share: the Checkpointer they go through, and DCP's
``checkpoint_id`` read as a step number."""

from __future__ import annotations

import os
from typing import Any

from ..checkpointer import Checkpointer


def step_of(checkpoint_id: Any) -> int:
    """A DCP ``checkpoint_id`` as a step: an int, or a str of its digits."""
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id
    if isinstance(text, str) and text.isdigit():
        return int(text)
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    raise ValueError(f"a ckptlib.dcp checkpoint_id is the step to save or load (an int, or its digits), "
                     f"got {checkpoint_id!r}: the store is the URL given to StorageWriter/StorageReader")


class Backend:
    """The Checkpointer a StorageWriter or StorageReader uses: the one given, else one it opens on
    first use (so constructing either is cheap) and closes in ``close()``."""

    def __init__(self, url: str | Checkpointer, storage_options: dict | None, options: dict[str, Any]):
        self._given = url if isinstance(url, Checkpointer) else None
        self._url, self._storage_options, self._options = url, storage_options, options
        self._opened: Checkpointer | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        if self._given is not None:
            return self._given
        if self._opened is None:
            assert isinstance(self._url, str)
            self._opened = Checkpointer(self._url, self._storage_options, **self._options)
        return self._opened

    def close(self) -> None:
        """Close the Checkpointer this opened (not one it was given); the next use opens another."""
        if self._opened is not None:
            self._opened.close()
            self._opened = None
