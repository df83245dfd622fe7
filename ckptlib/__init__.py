"""ckptlib: incremental, content-addressed, atomically committed checkpoints of training state.

    from ckptlib import Checkpointer
    ck = Checkpointer("s3://bucket/run-1")
    info = ck.save(step, state)           # CommitInfo(step, digest, bytes_written, logical_bytes, ...)
    fut = ck.save_async(step, state)      # returns once the state is copied
    state = ck.restore()                  # latest committed, bit-exact
    ck.restore(into=state)                # ... straight into the tensors you already have
    ck.steps()                            # committed steps, ascending

Knows nothing of Prefect; usable from any training loop. See docs/format.md for the store layout.
Importing it is light: names load on first use, and torch only when a state holds tensors.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Checkpointer": "checkpointer", "CommitInfo": "checkpointer", "SaveFuture": "checkpointer",
    "CollectiveCheckpointer": "distributed.collective_checkpointer", "PartWriter": "part_writer",
    "RetentionPolicy": "retention", "Problem": "restore", "Store": "store", "branch": "branch",
    "CheckpointError": "errors", "CommitConflict": "errors", "CorruptCheckpoint": "errors", "FencedError": "errors",
    "FormatVersionError": "errors", "NoCheckpoint": "errors", "ObjectNotFound": "errors", "StoreError": "errors",
    "UnsupportedState": "errors",
}
__all__ = [
    "CheckpointError", "Checkpointer", "CollectiveCheckpointer", "CommitConflict", "CommitInfo", "CorruptCheckpoint",
    "FencedError", "FormatVersionError", "NoCheckpoint", "ObjectNotFound", "PartWriter", "Problem", "RetentionPolicy",
    "SaveFuture", "Store", "StoreError", "UnsupportedState", "branch",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from .branch import branch
    from .checkpointer import Checkpointer, CommitInfo, SaveFuture
    from .distributed.collective_checkpointer import CollectiveCheckpointer
    from .errors import (
        CheckpointError,
        CommitConflict,
        CorruptCheckpoint,
        FencedError,
        FormatVersionError,
        NoCheckpoint,
        ObjectNotFound,
        StoreError,
        UnsupportedState,
    )
    from .part_writer import PartWriter
    from .restore import Problem
    from .retention import RetentionPolicy
    from .store import Store


def __getattr__(name: str) -> Any:  # PEP 562: import on first use
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptlib' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
