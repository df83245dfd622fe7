"""The bounds of the numeric and progress checks of a validation (``Thresholds``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Thresholds:
    """Bounds of the numeric and progress checks. Defaults suit fp32/bf16 training of usual models.

    ``Thresholds.from_dict({"max_rel_change": 5})`` overrides some; unknown names are an error.
    """

    max_abs_value: float = 1e4  # largest |value| of a model tensor (parameters and buffers)
    max_norm: float = 1e6  # largest L2 norm of one model tensor
    # relative change of a model tensor against the previous healthy checkpoint:
    # ||x - x_prev|| / max(||x_prev||, rel_change_floor * sqrt(numel)); the floor keeps tensors that
    # start at zero (biases) from dividing by ~0. An exploding update fails this.
    max_rel_change: float = 10.0
    rel_change_floor: float = 0.05
    # batches each worker must have consumed since the previous healthy checkpoint (checks that know
    # a data position use it, e.g. a training run's: trainrun.checks)
    min_data_advance: int = 1
    max_step_spread: int = 0  # max - min of an optimizer's per-parameter step counters

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"threshold {f.name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | Thresholds | None) -> Thresholds:
        if d is None:
            return cls()
        if isinstance(d, Thresholds):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"thresholds must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown validation thresholds {unknown}; known: {sorted(known)}")
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
