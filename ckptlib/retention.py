"""Retention policies: which committed steps to keep. Pure functions, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` steps, every step divisible by ``keep_every``, and ``keep_named``.

    The newest committed step is always kept: it is the base of the next delta and of any save
    in flight.
    """

    keep_last: int = 3
    keep_every: int | None = None
    keep_named: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1, got {self.keep_last}: the newest checkpoint is the base of the "
                "next save and of recovery"
            )
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 (or None), got {self.keep_every}")

    def select(self, steps: Iterable[int]) -> set[int]:
        ordered = sorted(set(steps))
        kept = set(ordered[-self.keep_last:])
        if self.keep_every:
            kept |= {s for s in ordered if s % self.keep_every == 0}
        kept |= self.keep_named & set(ordered)
        return kept
