"""Where a task's time went: the ``seconds`` of what the runtime returns (``flows/summary.py`` adds
them up along the critical path)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Stopwatch:
    """Seconds spent in the named phases of one task body, from its creation on."""

    def __init__(self) -> None:
        self._start = self._mark = time.perf_counter()
        self._spent: dict[str, float] = {}

    def lap(self, name: str) -> None:
        """The time since the previous lap (or the start) was spent in ``name``."""
        now = time.perf_counter()
        self._spent[name] = self._spent.get(name, 0.0) + now - self._mark
        self._mark = now

    @contextmanager
    def timing(self, name: str) -> Iterator[None]:
        """Add the time spent in the block to ``name`` (a phase made of several pieces)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - t0

    def spent(self, name: str) -> float:
        """Seconds in ``name`` so far (rounded like every figure here: 0.1 ms)."""
        return round(self._spent.get(name, 0.0), 4)

    def total(self) -> float:
        return round(time.perf_counter() - self._start, 4)

    def seconds(self) -> dict[str, float]:
        """Every phase in the order first timed, then ``total``."""
        return {**{name: self.spent(name) for name in self._spent}, "total": self.total()}
