"""Leases: how saves, readers and garbage collection stay out of each other's way.

Keys under a run's root::

    leases/<kind>-<id>.json   a save or a read in progress: {"kind", "id", "start", "expires", "step", "host", "pid"}
    gc.lock                   the garbage collection in progress: {"id", "start", "expires", "host", "pid"}

The protocol (the argument is in docs/format.md, "Garbage collection"):

* A save writes its lease before its first upload and keeps it until its manifest (or fragment)
  is published. ``step`` is the committed step its deltas build on: GC keeps that step. Nothing
  kept it between the writer's saves, so the save then looks that the step still commits what its
  base names (``PartWriter``), and writes keyframes if not.
* Right after writing its lease, the save looks at ``gc.lock``. A GC that takes the lock after
  that moment reads the leases after it, sees this one, and does not sweep. A GC that holds the
  lock at that moment may have read the leases before; then the save writes that lock's id into
  its lease (``gc``) and, before publishing, waits for that GC to end and checks that every object
  it needs still exists, writing again any re-used one (found already stored instead of writing
  it) that was swept, and encoding its part again as keyframes if one it cannot write back is gone.
* A GC holds ``gc.lock`` (put-if-absent: one GC at a time), keeps every step named by a live lease,
  and sweeps objects only while every live save lease names its lock (a save that did not see it
  may publish without checking); it looks again before each batch of deletes. It waits a while
  (``wait_s``) for the saves that did not see it to publish: saves that began after it took the
  lock all name it, so it does not starve however often saves come.
* Leases live as long as their holder does: a thread of the holder's process renews its lease every
  ``ttl_s / 3`` seconds (default time to live 30 s), so a killed saver's or reader's lease expires
  within 30 s and GC sweeps within a minute of the kill, however long a live save takes. A lease
  whose renewal came late (the process was frozen, or the store refused the writes) may have been
  seen expired: the save then checks what it needs before publishing, as beside a GC it saw (below).
  Expiry is judged on the writer's clock against the reader's: hosts' clocks must agree to well
  within the time to live (NTP keeps them within milliseconds). The GC lock expires too (a killed GC
  cannot block saves for more than two minutes); a running GC renews it.

Every restore takes a read lease of its step the same way, before it reads the manifest (best
effort: a reader without write access to the store reads unprotected). A reader never waits for a
GC. A GC that planned before the lease was written looks at the leases again before it drops each
batch of steps (a leased step is kept), and before each batch of deletes it stops while a read
lease names a step it dropped or never saw committed: that reader either found no manifest
(NoCheckpoint) or holds one whose objects are then not swept. Every later GC keeps the step while
the lease lives.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from .errors import ObjectNotFound, ObjectTooLarge, StoreError
from .store import ObjectInfo, Store

log = logging.getLogger("ckptlib")

LEASE_PREFIX = "leases/"
GC_LOCK = "gc.lock"
# Short, because it is renewed by the holder's own thread while it lives: what a killed holder
# leaves blocks GC for at most this long (it used to be an hour, so under one failure a minute GC
# never swept). Every renewal is one small put, every ttl/3 seconds, only while a save or read runs.
DEFAULT_LEASE_TTL_S = 30.0
# A running GC renews its lock at least every GC_LOCK_TTL_S / 4 seconds, so the lock of a GC that
# was killed expires within two minutes and nothing waits on it longer than that.
GC_LOCK_TTL_S = 120.0
GC_WAIT_S = 600.0
LEASE_MAX_BYTES = 64 << 10  # a lease or the lock is a few hundred bytes; a larger one is malformed
_LEASE_KEY = re.compile(r"^leases/(save|read)-[0-9a-f]{32}\.json$")  # how long a save waits for a GC that keeps renewing its lock before it gives up


@dataclass(frozen=True)
class LeaseDoc:
    kind: str  # "save" | "read"
    id: str
    start: float
    expires: float
    step: int | None  # the step it needs kept (a save's delta base, a reader's step)
    host: str = ""
    pid: int = 0
    # a save's only: the id of the GC lock it saw right after writing this lease. That GC may sweep
    # beside it, because the save waits for that GC to end and checks what it needs before it publishes.
    gc: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {"kind": self.kind, "id": self.id, "start": self.start, "expires": self.expires, "step": self.step,
               "host": self.host, "pid": self.pid}
        return doc if self.gc is None else {**doc, "gc": self.gc}

    def lets_sweep(self, lock_id: str | None) -> bool:
        """Whether the GC holding lock ``lock_id`` may delete objects while this lease lives: a read
        lease is judged by its step (``ckptlib.gc``); a save's only if it saw that very lock."""
        return self.kind != "save" or (lock_id is not None and self.gc == lock_id)

    @classmethod
    def from_json(cls, d: Any) -> LeaseDoc | None:
        """The lease, or None for a document that is not one (it then protects nothing)."""
        try:
            step, gc = d.get("step"), d.get("gc")
            return cls(str(d["kind"]), str(d["id"]), float(d["start"]), float(d["expires"]),
                       int(step) if step is not None else None, str(d.get("host", "")), int(d.get("pid", 0)),
                       str(gc) if gc is not None else None)
        except (AttributeError, KeyError, TypeError, ValueError):
            return None


def _now() -> float:
    return time.time()


class Lease:
    """A save's or a reader's lease (a context manager), renewed by a thread of its own while held.
    ``reused``: keys of objects the save found stored already; ``before_publish`` checks them before
    publishing when a GC ran beside the save, or when the lease may have lapsed."""

    def __init__(self, store: Store, kind: str, step: int | None, ttl_s: float | None = None):
        ttl_s = DEFAULT_LEASE_TTL_S if ttl_s is None else ttl_s  # read at call time: a test may shorten it
        if not ttl_s > 0:
            raise ValueError(f"a lease's ttl_s must be > 0, got {ttl_s}")
        self.store, self.ttl_s = store, ttl_s
        self.doc = LeaseDoc(kind, uuid.uuid4().hex, _now(), _now() + ttl_s, step, socket.gethostname(), os.getpid())
        self.key = f"{LEASE_PREFIX}{kind}-{self.doc.id}.json"
        self.gc_seen = False
        self.held = False
        # Set once a renewal landed after the expiry it was meant to push (or could not be written):
        # a GC may have judged this lease expired meanwhile, so the save checks before publishing.
        self.lapsed = False
        self._renewed = self.doc.start
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _write(self) -> None:
        self.store.put(self.key, json.dumps(self.doc.to_json()).encode())

    def acquire(self) -> Lease:
        self._write()
        self.held = True
        self._name_gc_lock()
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_while_held, name=f"ckptlib-lease-{self.doc.id[:8]}",
                                         daemon=True)
        self._renewer.start()
        return self

    def _name_gc_lock(self) -> None:
        """Look at ``gc.lock`` right after this lease was written; a save names the GC it finds."""
        with self._write_lock:
            lock = read_gc_lock(self.store)
            self.gc_seen = lock is not None
            named = lock.get("id") if lock is not None and self.doc.kind == "save" else None
            if isinstance(named, str) or self.doc.gc is not None:
                # Say so in the lease: that GC then sweeps beside this save instead of stopping for it
                # (until this put lands, it sees a save that did not see it, and waits).
                self.doc = replace(self.doc, gc=named if isinstance(named, str) else None)
                self._write()

    def try_acquire(self) -> Lease:
        """``acquire``, or nothing when the store cannot be written (a read-only reader)."""
        try:
            return self.acquire()
        except StoreError as e:
            log.debug("no read lease in %s (%s): reading unprotected", self.store.url, e)
            return self

    def _renew_while_held(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except StoreError as e:  # the next try may land; a late one marks the lease lapsed
                log.debug("could not renew lease %s/%s: %s", self.store.url, self.key, e)

    def renew(self) -> None:
        """Push the expiry forward; cheap to call often (writes at most every ttl/4)."""
        with self._write_lock:
            if not self.held or self._stop.is_set() or _now() - self._renewed <= self.ttl_s / 4:
                return
            now = _now()
            renewed = replace(self.doc, expires=now + self.ttl_s)
            self.store.put(self.key, json.dumps(renewed.to_json()).encode())  # on failure nothing changes
            if now >= self.doc.expires:  # the expiry last written had passed: a GC may have seen it
                self.lapsed = True
                log.warning("lease %s/%s was renewed %.1f s after it expired (the process stalled, or the store "
                            "refused its renewals): what it protects is checked before the save publishes",
                            self.store.url, self.key, now - self.doc.expires)
            self.doc, self._renewed = renewed, now

    def before_publish(self, needed: Iterable[str], reused: dict[str, bytes]) -> list[str]:
        """If a GC held the lock when this lease was written, or the lease may have lapsed, wait for
        that GC (any GC, after a lapse) to end, then make sure every object the save needs (``needed``:
        the keys its fragment names, delta chains included) still exists: a re-used one it swept is
        written back from ``reused`` (key -> its encoded bytes). Returns the keys still missing (a new
        object of this save, or an older link of a delta chain, swept by that GC): the caller encodes
        the part again without them. [] when no GC ran and the lease held."""
        if self.held and _now() >= self.doc.expires:
            self.renew()  # late: lapsed. Renewed now, so every GC that looks from here on sees it
        if self.lapsed:
            # A GC that saw this lease expired may have swept what it needs, and may still hold the
            # lock: name whichever GC holds it now (as on acquiring), wait for it, then check.
            self._name_gc_lock()
            self.gc_seen, self.lapsed = True, False
        if not self.gc_seen:
            return []
        self._wait_for_gc()
        missing = []
        for key in dict.fromkeys(needed):
            if self.store.exists(key):
                continue
            if key in reused:
                log.warning("%s/%s was garbage-collected while this save re-used it: writing it again",
                            self.store.url, key)
                self.store.put_if_absent(key, reused[key])
            else:
                missing.append(key)
        return missing

    def _wait_for_gc(self) -> None:
        deadline, pause = time.monotonic() + GC_WAIT_S, 0.02
        # Only the GC this lease names may have swept beside it; a later one sees the lease as a save
        # that did not see it and sweeps nothing while it lives (an unnamed one: wait for any).
        while (lock := read_gc_lock(self.store)) is not None and lock.get("expires", 0) > _now() and \
                (self.doc.gc is None or lock.get("id") == self.doc.gc):
            if time.monotonic() > deadline:
                raise StoreError(f"a garbage collection has held {self.store.url}/{GC_LOCK} for over {GC_WAIT_S:.0f} s; "
                                 "this save waited for it and gives up. Save again once it has finished.")
            time.sleep(pause)
            pause = min(0.5, pause * 2)  # a GC often lasts a fraction of a second

    def release(self) -> None:
        self._stop.set()
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()  # no renewal may land after the delete below
        if self.held:
            self.held = False
            try:
                self.store.delete(self.key)
            except StoreError as e:  # it expires by itself
                log.warning("could not remove lease %s/%s: %s", self.store.url, self.key, e)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def read_gc_lock(store: Store) -> dict[str, Any] | None:
    try:
        doc = json.loads(store.get(GC_LOCK, max_bytes=LEASE_MAX_BYTES))
    except ObjectNotFound:
        return None
    except (ValueError, RecursionError, ObjectTooLarge):
        return {"expires": 0.0}  # unreadable: an expired lock
    return doc if isinstance(doc, dict) else {"expires": 0.0}


def _lease_keys(store: Store) -> list[ObjectInfo]:
    """Lease objects; other keys under leases/ (not written by ckptlib) are not leases."""
    return [info for info in store.scan(LEASE_PREFIX.rstrip("/")) if _LEASE_KEY.match(info.key)]


def live_leases(store: Store) -> list[LeaseDoc]:
    """Unexpired leases. A malformed lease document is ignored (it protects nothing)."""
    now, out = _now(), []
    for info in _lease_keys(store):
        try:
            doc = LeaseDoc.from_json(json.loads(store.get(info.key, max_bytes=LEASE_MAX_BYTES)))
        except (ObjectNotFound, ValueError, RecursionError, ObjectTooLarge):
            continue
        if doc is not None and doc.expires > now:
            out.append(doc)
    return out


def expired_leases(store: Store, older_than: float) -> list[str]:
    """Keys of lease documents that expired (or are malformed) and were last written before ``older_than``."""
    now, out = _now(), []
    for info in _lease_keys(store):
        if info.modified >= older_than:
            continue
        try:
            doc = LeaseDoc.from_json(json.loads(store.get(info.key, max_bytes=LEASE_MAX_BYTES)))
        except ObjectNotFound:
            continue
        except (ValueError, RecursionError, ObjectTooLarge):
            doc = None
        if doc is None or doc.expires <= now:
            out.append(info.key)
    return out


class GcLock:
    """The GC's lock (a context manager): one GC per store at a time; a lock left by a killed GC
    is taken over once it has expired."""

    def __init__(self, store: Store, ttl_s: float = GC_LOCK_TTL_S):
        self.store, self.ttl_s = store, ttl_s
        self.id = uuid.uuid4().hex
        self._doc: dict[str, Any] = {"id": self.id, "start": _now(), "expires": _now() + ttl_s,
                                     "host": socket.gethostname(), "pid": os.getpid()}

    def acquire(self) -> GcLock:
        data = json.dumps(self._doc).encode()
        if self.store.put_if_absent(GC_LOCK, data):
            return self
        held = read_gc_lock(self.store)
        if held is not None and held.get("expires", 0) > _now():
            raise StoreError(
                f"another garbage collection holds {self.store.url}/{GC_LOCK} (host {held.get('host')}, pid "
                f"{held.get('pid')}, until {time.strftime('%H:%M:%S', time.localtime(held['expires']))}); run GC "
                "again after it ends, or delete the lock if that process is gone"
            )
        self.store.delete(GC_LOCK)  # expired: its GC was killed
        if not self.store.put_if_absent(GC_LOCK, data):
            raise StoreError(f"another garbage collection took {self.store.url}/{GC_LOCK} just now; run GC again later")
        return self

    def still_held(self) -> bool:
        held = read_gc_lock(self.store)
        return held is not None and held.get("id") == self.id

    def renew(self) -> bool:
        """Push the expiry forward if due (cheap to call often); False if the lock is no longer ours,
        or expired before this renewal (a save waiting for it may have gone ahead meanwhile)."""
        now = time.time()
        if now >= self._doc["expires"]:
            return False
        if now < self._doc["expires"] - 3 * self.ttl_s / 4:
            return True
        if not self.still_held():
            return False
        self._doc = {**self._doc, "expires": _now() + self.ttl_s}
        self.store.put(GC_LOCK, json.dumps(self._doc).encode())
        return True

    def release(self) -> None:
        if self.still_held():
            self.store.delete(GC_LOCK)

    def __enter__(self) -> GcLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
