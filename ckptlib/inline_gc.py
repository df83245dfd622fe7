"""GC run from inside a training loop (the framework integrations): best effort, never in training's way.

A framework that rotates checkpoints (Lightning's top-k, Hugging Face's ``save_total_limit``) calls
GC between training steps, in the training process. So a kill of that process often lands inside
a GC, leaving ``gc.lock`` behind: every save waits for a held lock (``ckptlib.leases``), up to the
two minutes it takes to expire. ``clear_dead_lock`` lets the resumed run go on at once when the
holder was a process of this host that is gone; ``collect`` never waits for a save and turns a GC
that cannot run now into a warning (the next one catches up).
"""

from __future__ import annotations

import logging
import os
import socket

from .checkpointer import Checkpointer
from .errors import CheckpointError
from .leases import GC_LOCK, read_gc_lock
from .retention import RetentionPolicy

log = logging.getLogger("ckptlib")


def clear_dead_lock(ck: Checkpointer) -> bool:
    """Delete ``gc.lock`` if a process of this host that no longer exists holds it; True if it did.
    A lock of another host, or of a live pid (maybe a reused one), is left to expire."""
    lock = read_gc_lock(ck.store)
    if lock is None or lock.get("host") != socket.gethostname() or type(pid := lock.get("pid")) is not int:
        return False
    if pid == os.getpid() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return False  # alive
    except ProcessLookupError:
        pass
    except PermissionError:
        return False  # alive, another user's
    log.warning("ckptlib: %s/%s was left by pid %d of this host, which is gone (killed in a GC): removing it",
                ck.url, GC_LOCK, pid)
    ck.store.delete(GC_LOCK)
    return True


def collect(ck: Checkpointer, keep: set[int], grace_s: float) -> None:
    """Drop every step but ``keep`` (and the newest); sweep objects older than ``grace_s``.
    Waits for no save (a killed run's save lease defers the sweeps until it expires; steps are
    dropped anyway); a GC that cannot run now is logged and skipped."""
    try:
        ck.gc(RetentionPolicy(keep_last=1, keep_named=frozenset(keep)), grace_s=grace_s, wait_s=0.0)
    except CheckpointError as e:
        log.warning("ckptlib: GC of %s skipped this time (the next save or removal runs it again): %s", ck.url, e)
