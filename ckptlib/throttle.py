"""An upload bandwidth limit, so checkpoint traffic does not starve training traffic."""

from __future__ import annotations

import threading
import time


class RateLimiter:
    """Token bucket shared by all upload threads: ``acquire(n)`` blocks until n bytes may be sent.

    Keeps the long-run rate at ``bytes_per_s`` with bursts of at most one second's worth (or one
    object, if larger). ``None`` or 0 means unlimited.
    """

    def __init__(self, bytes_per_s: float | None):
        if bytes_per_s is not None and bytes_per_s < 0:
            raise ValueError(f"max_upload_bytes_per_s must be positive (or None for no limit), got {bytes_per_s}")
        self.rate = bytes_per_s or None
        self._lock = threading.Lock()
        self._next_free = time.monotonic()  # when the bucket is empty again at the current debt

    def acquire(self, nbytes: int) -> float:
        """Wait until ``nbytes`` may be sent; returns the seconds waited."""
        if not self.rate or nbytes <= 0:
            return 0.0
        with self._lock:
            now = time.monotonic()
            start = max(self._next_free, now - 1.0)  # unused capacity accrues for at most 1 s
            self._next_free = start + nbytes / self.rate
            wait = max(0.0, start - now)
        if wait:
            time.sleep(wait)
        return wait
