"""Deprecated: ``ckptlib.writer`` is now ``ckptlib.save`` (the save of one part) and
``ckptlib.encoding`` (how one unit is encoded). This module re-exports the old names for one
release and warns on import."""

from __future__ import annotations

import warnings

from .bases import Base
from .encoding import DEFAULT_DELTA_BUDGET, DEFAULT_KEYFRAME_EVERY, RAW_KEYFRAME_ABOVE, blob_key
from .save import Snapshot, WriteOptions, encode_part, take_snapshot

warnings.warn("ckptlib.writer is deprecated: import from ckptlib.save (and ckptlib.encoding) instead",
              DeprecationWarning, stacklevel=2)

__all__ = ["DEFAULT_DELTA_BUDGET", "DEFAULT_KEYFRAME_EVERY", "RAW_KEYFRAME_ABOVE", "Base", "Snapshot",
           "WriteOptions", "blob_key", "encode_part", "take_snapshot"]
