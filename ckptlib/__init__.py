"""ckptlib: incremental, content-addressed, atomically committed checkpoints of training state.

    from ckptlib import Checkpointer
    ck = Checkpointer("s3://bucket/run-1")
    info = ck.save(step, state)           # CommitInfo(step, digest, bytes_written, logical_bytes, ...)
    fut = ck.save_async(step, state)      # returns once the state is snapshotted
    state = ck.restore()                  # latest committed, bit-exact
    ck.steps()                            # committed steps, ascending

Knows nothing of Prefect; usable from any training loop. See docs/format.md for the store layout.
"""

from .checkpointer import CommitInfo, Checkpointer
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
from .reader import Problem
from .retention import RetentionPolicy

__all__ = [
    "Checkpointer", "CommitInfo", "RetentionPolicy", "Problem",
    "CheckpointError", "CommitConflict", "CorruptCheckpoint", "FencedError", "FormatVersionError",
    "NoCheckpoint", "ObjectNotFound", "StoreError", "UnsupportedState",
]
