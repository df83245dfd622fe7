"""What a watchdog remembers between two looks at its runs (``Memory``).

One look at the store sees every part's latest beat; some rules need more than one moment:

* ``stalled``: a shard that beats but does not advance. The memory keeps, per part, the first time
  its current (attempt, step) was seen (``progress_since``); an attempt is its own process's, told
  apart by its start time: a predecessor's beats never date a successor's progress.
* ``lost``: a fenced shard whose new generation never beats. The memory keeps, per part and
  generation, the last time that generation was seen beating (``saw``, ``last_seen``), so a rerun
  that beat once and then vanished is timed from its last beat, not from the fence.
* decisions made once: a ``cannot-rerun``, ``gave-up`` or ``run-dead`` is reported the first time
  its rule holds, not at every look (``first_time``).

It grows with parts and generations, never with rounds or looks (``tests/test_scale_out.py``
measures it on a run with a long history). A watchdog without a memory (``ckpt status``: one look)
judges silence only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ckptlib.heartbeat import Beat

from ..beats import start_phase


@dataclass(frozen=True)
class _Progress:
    """A part's attempt (generation, attempt, round, when it started) at ``step`` (or start phase),
    first seen at wall time ``since``."""

    attempt: tuple[int, int | None, int, float]
    step: int | str | None
    since: float


class Memory:
    """A watchdog's memory of its runs (see the module docstring); ``url`` names the run."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, int], float] = {}  # (run, part, generation) -> its latest beat's time
        self._progress: dict[tuple[str, str], _Progress] = {}  # (run, part) -> where it was first seen at
        self._reported: set[tuple[str, ...]] = set()  # (decision kind, run, ...) reported already

    def saw(self, url: str, part: str, beat: Beat) -> None:
        """``beat`` of ``part``'s live generation was seen at this look."""
        self._seen[(url, part, beat.generation)] = beat.time

    def last_seen(self, url: str, part: str, generation: int) -> float | None:
        """The time of the latest beat of ``part``'s ``generation`` any look saw (None: never seen)."""
        return self._seen.get((url, part, generation))

    def progress_since(self, url: str, part: str, beat: Beat) -> float:
        """Since when ``part`` has been at ``beat``'s step (in the same attempt: generation, attempt,
        round and start time, so a fresh process never inherits a predecessor's time, e.g. a resumed
        run's shard at the step where the dead run's stopped); ``beat.time`` when it moved since the
        previous look. A new start phase (``trainrun.beats``) is progress too."""
        where = beat.step if beat.round_step is not None or start_phase(beat) is None else start_phase(beat)
        now = _Progress((beat.generation, beat.attempt, beat.round, beat.started), where, beat.time)
        first = self._progress.get((url, part))
        if first is None or (first.attempt, first.step) != (now.attempt, now.step):
            self._progress[(url, part)] = first = now
        return first.since

    def first_time(self, kind: str, url: str, *key: object) -> bool:
        """True the first time it is asked about this decision (``kind``, ``url``, ``key``), then False."""
        entry = (kind, url, *map(str, key))
        if entry in self._reported:
            return False
        self._reported.add(entry)
        return True

    def __len__(self) -> int:
        return len(self._seen) + len(self._progress) + len(self._reported)

    def __iter__(self) -> Iterator[tuple[object, ...]]:
        """Every entry, named by its kind (for reports and tests)."""
        yield from (("seen", *k) for k in self._seen)
        yield from (("progress", *k) for k in self._progress)
        yield from self._reported
