"""Metrics as the run's documents hold them: finite floats or null, never NaN or infinity.

A diverging run (``ckpt train --lr 1e30``) has NaN or infinite losses. JSON has no such numbers
(ckptlib writes its documents with ``allow_nan=False``), so a fragment's or a manifest's ``meta``
gets ``None`` for a metric that is not finite, and ``non_finite`` names those metrics: the
document is written, the checkpoint is committed, and validation fails the step (its NaN/Inf
checks see the tensors themselves; docs/decisions.md 19). The state's own ``loss`` leaf keeps the
exact value (ckptlib stores every float exactly).
"""

from __future__ import annotations

import math
from typing import Any


def finite_or_none(x: float | None) -> float | None:
    """``x`` when it is a finite number, else None."""
    return x if x is not None and math.isfinite(x) else None


def finite_metrics(**metrics: float | None) -> dict[str, Any]:
    """``metrics`` with every non-finite value None, plus ``non_finite`` (their names) when any was."""
    out: dict[str, Any] = {k: finite_or_none(v) for k, v in metrics.items()}
    bad = [k for k, v in metrics.items() if v is not None and not math.isfinite(v)]
    if bad:
        out["non_finite"] = bad
    return out
