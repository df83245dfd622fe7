"""Thread-pool helpers shared by the library and the runtime."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_ahead(pool: Executor, fn: Callable[[T], R], items: Iterable[T], ahead: int) -> Iterator[R]:
    """``fn(item)`` for each item, in order, with at most ``ahead`` calls submitted and not yet
    consumed. ``pool.map`` submits every item at once and keeps each result until it is consumed:
    when the consumer lags (it competes for the GIL with the callers), every result is held at once
    (a whole window of manifests, every shard's model)."""
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    pending: deque[Future[R]] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()
