"""Deprecated: ``ckptlib.reader`` is now ``ckptlib.restore``. This module re-exports the old names
for one release and warns on import."""

from __future__ import annotations

import warnings

from .errors import Damaged
from .restore import Problem, check_fits, decode_leaves, inspect_part, physical_memory, restore_part

warnings.warn("ckptlib.reader is deprecated: import from ckptlib.restore instead", DeprecationWarning, stacklevel=2)

__all__ = ["Damaged", "Problem", "check_fits", "decode_leaves", "inspect_part", "physical_memory", "restore_part"]
