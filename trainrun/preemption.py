"""Preemption: a SIGTERM (or a cancel) asks every training loop of this process to checkpoint and stop.

A preempted machine (a spot instance, a Kubernetes eviction, a Prefect worker shut down, a runner
cancelling its flow run) gets SIGTERM and a grace period before SIGKILL. Python runs signal handlers
on the main thread only, while shards train in threads of the flow's process, in Dask worker
processes, in a shard flow's own process or as rank processes. So the handler does one thing: it
sets a process-wide flag (``requested``) that every training loop looks at after each step. A loop
that sees it writes a shard checkpoint at the step it is at, waits for the write, and raises
``trainrun.errors.Preempted`` (``trainrun.shard_round``).

Once the last loop of the process has stopped (or ``grace_s`` after the signal, whichever comes
first), the signal goes on to the handler that was there before ours: Prefect's (the flow run then
ends: Crashed, or Cancelled where its runner asked for it) or the default one (the process ends). A
cancel seen through Prefect's API (``request("cancel", redeliver=False)``) stops the loops the same
way; the process lives on and the flow ends itself Cancelled.

``install`` needs the main thread (where Python allows ``signal.signal``); elsewhere it does nothing
and says so. Nothing here knows Prefect or torch.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("trainrun.preemption")

DEFAULT_GRACE_S = 30.0  # what Kubernetes gives a pod between SIGTERM and SIGKILL


class _State:
    """The process's one preemption: whether it was asked, why, how many loops still train."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason: str | None = None
        self.grace_s = DEFAULT_GRACE_S
        self.loops = 0
        self.cond = threading.Condition()
        self.previous: Any = None  # the SIGTERM handler before ours (None: ours is not installed)
        self.released = False  # the signal has gone on to ``previous``


_S = _State()


def requested() -> str | None:
    """Why this process was asked to stop (``SIGTERM``, ``cancel``), or None."""
    return _S.reason if _S.event.is_set() else None


def grace_s() -> float:
    return _S.grace_s


def training_now() -> bool:
    """Whether a training loop of this process runs (``training``) right now."""
    return _S.loops > 0


def reset() -> None:
    """Forget an earlier request (a new session in a process that outlived a cancelled one)."""
    with _S.cond:
        _S.event.clear()
        _S.reason, _S.released = None, False


def install(grace: float = DEFAULT_GRACE_S) -> bool:
    """Make SIGTERM a preemption in this process (keeping the handler that was there for after the
    loops stopped). False where it cannot: not the main thread."""
    _S.grace_s = float(grace)
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        _S.previous = current
        signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def uninstall() -> None:
    """Put the handler ``install`` replaced back (main thread; a no-op elsewhere or when not ours)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, _S.previous if _S.previous is not None else signal.SIG_DFL)
        _S.previous = None


def request(reason: str, *, redeliver: bool = False) -> None:
    """Ask every loop of this process to checkpoint and stop. ``redeliver``: then (the last loop
    stopped, or the grace passed) send SIGTERM on to the handler ours replaced."""
    with _S.cond:
        if _S.event.is_set():
            return
        _S.reason = reason
        _S.event.set()
        loops = _S.loops
    log.warning("%s: %d training loop(s) of process %d checkpoint and stop (grace %.0f s)", reason, loops, os.getpid(),
                _S.grace_s)
    if redeliver:
        threading.Thread(target=_release_when_stopped, name="ckpt-preemption", daemon=True).start()


def wait_stopped(timeout: float) -> bool:
    """Wait until no loop of this process trains (True), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with _S.cond:
        while _S.loops > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _S.cond.wait(left)
    return True


@contextmanager
def training() -> Iterator[None]:
    """A training loop runs: a SIGTERM waits for it (within the grace) before it goes on."""
    with _S.cond:
        _S.loops += 1
    try:
        yield
    finally:
        with _S.cond:
            _S.loops -= 1
            _S.cond.notify_all()


def _on_sigterm(signum: int, frame: Any) -> None:
    if _S.released:  # the loops have stopped: the signal goes on to the handler ours replaced
        _deliver(signum, frame)
        return
    request("SIGTERM", redeliver=True)


def _release_when_stopped() -> None:
    if not wait_stopped(_S.grace_s):
        log.warning("preemption: training loops still running after the %.0f s grace: ending anyway", _S.grace_s)
    _S.released = True
    os.kill(os.getpid(), signal.SIGTERM)  # handled on the main thread, where ``previous`` may raise


def _deliver(signum: int, frame: Any) -> None:
    previous = _S.previous
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default: the process ends, as SIGTERM ends it
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
