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

A flag reaches only its own process. So the coordinator also writes the run's stop document
(``control/stop.json``, a ``StopDocument``: ``on_request`` names the writer; a new session clears
it) and every shard attempt, wherever it runs (a Dask worker, a shard flow run, a group's
supervisor), reads it once per written beat (``StopWatch``, an ``on_beat`` callback: one small GET)
and, finding it, raises the same flag in its own process. A flag raised so is forgotten once the
attempt stopped (``forget_stop_document``): the process (a Dask worker) may train other runs later.

``install`` needs the main thread (where Python allows ``signal.signal``); elsewhere it does nothing
and says so. Nothing here knows Prefect or torch; nothing read from the store is executed (the
document is a few typed fields, its size capped before it is parsed).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ckptlib.documents import Document, DocumentError
from ckptlib.errors import ObjectNotFound, StoreError
from ckptlib.store import Store

log = logging.getLogger("trainrun.preemption")

DEFAULT_GRACE_S = 30.0  # what Kubernetes gives a pod between SIGTERM and SIGKILL
STOP_KEY = "control/stop.json"


@dataclass(frozen=True)
class StopDocument(Document):
    """``control/stop.json``: the coordinator was asked to stop (``reason``: ``cancel`` or
    ``SIGTERM``) at wall time ``time`` in round ``round``, by ``by`` (its flow run, or run id)."""

    KIND = "stop request"
    FORMAT = 1
    MAX_BYTES = 16 << 10

    reason: str
    time: float
    by: str
    round: int | None = None


def write_stop(store: Store, reason: str, *, by: str, round_no: int | None) -> None:
    """Tell every shard attempt of the run to checkpoint and stop (they read it at their next beat)."""
    store.put(STOP_KEY, StopDocument(reason=reason[:200], time=time.time(), by=by[:200], round=round_no).to_json())


def clear_stop(store: Store) -> None:
    """A new session of the run starts unstopped: an earlier session's stop document goes."""
    store.delete(STOP_KEY)


def read_stop(store: Store) -> StopDocument | None:
    """The run's stop document, or None (none; unreadable ones are logged and read as none)."""
    try:
        return StopDocument.read(store, STOP_KEY)
    except ObjectNotFound:
        return None
    except (DocumentError, StoreError) as e:
        log.warning("stop document of %s ignored: %s", store.url, e)
        return None


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
        self.origin: str | None = None  # "signal", "store" (a StopWatch) or "call"
        self.announce: Callable[[str], None] | None = None  # the coordinator's writer of the stop document


_S = _State()


def requested() -> str | None:
    """Why this process was asked to stop (``SIGTERM``, ``cancel``), or None."""
    return _S.reason if _S.event.is_set() else None


def grace_s() -> float:
    return _S.grace_s


def training_now() -> bool:
    """Whether a training loop of this process runs (``training``) right now."""
    return _S.loops > 0


def ending() -> bool:
    """Whether this process got a SIGTERM of its own: it ends once its loops stopped."""
    return _S.event.is_set() and _S.origin == "signal"


def reset() -> None:
    """Forget an earlier request (a new session in a process that outlived a cancelled one)."""
    with _S.cond:
        _S.event.clear()
        _S.reason, _S.released, _S.origin = None, False, None


def forget_stop_document() -> None:
    """Forget a request raised by the run's stop document (``StopWatch``), once its attempt stopped:
    the process outlives the run. Another loop of the run still training here reads the document
    again at its next beat; a request of any other origin stays."""
    with _S.cond:
        if _S.origin == "store":
            _S.event.clear()
            _S.reason, _S.origin = None, None


def on_request(announce: Callable[[str], None] | None) -> None:
    """``announce(reason)`` is called once when this process is asked to stop (the coordinator
    writes the run's stop document with it; off the signal handler: it waits on the store)."""
    _S.announce = announce


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


def request(reason: str, *, redeliver: bool = False, origin: str = "call") -> None:
    """Ask every loop of this process to checkpoint and stop, and announce it (``on_request``).
    ``redeliver``: then (the last loop stopped, or the grace passed) send SIGTERM on to the handler
    ours replaced."""
    with _S.cond:
        if _S.event.is_set():
            return
        _S.reason, _S.origin = reason, origin
        _S.event.set()
        loops = _S.loops
    log.warning("%s: %d training loop(s) of process %d checkpoint and stop (grace %.0f s)", reason, loops, os.getpid(),
                _S.grace_s)
    if redeliver:
        threading.Thread(target=_release_when_stopped, name="ckpt-preemption", daemon=True).start()
    else:
        _announce(reason)


class StopWatch:
    """An ``on_beat`` callback of a shard attempt: at each written beat (about every
    ``heartbeat_every_s``) it reads the run's stop document (one GET); once there, this process's
    loops are asked to stop as by a local request, with its reason."""

    def __init__(self, store: Store):
        self.store = store

    def __call__(self, beat: Any) -> None:
        if _S.event.is_set() or getattr(beat, "status", "running") != "running":
            return
        if (doc := read_stop(self.store)) is not None:
            request(doc.reason if doc.reason in ("cancel", "SIGTERM") else "cancel", origin="store")


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
    request("SIGTERM", redeliver=True, origin="signal")


def _announce(reason: str) -> None:
    if (announce := _S.announce) is not None:
        try:
            announce(reason)
        except Exception as e:  # noqa: BLE001 - the local loops stop anyway
            log.warning("%s: the run's stop document was not written (%s): remote shards finish their round", reason,
                        e)


def _release_when_stopped() -> None:
    _announce(_S.reason or "SIGTERM")  # here, not in the signal handler: the main thread may hold the store
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
