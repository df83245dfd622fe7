"""Garbage collection of a run's store: drop checkpoints a policy does not keep, sweep what no
checkpoint needs. It never deletes what a committed checkpoint, a save in flight or a reader needs.

Order (each step safe to crash after; the argument is in docs/format.md, "Garbage collection"):

0. Refuse unless the store is a ckptlib store (``commit.is_store``); take ``gc.lock`` (one GC at a
   time); read the live leases, THEN list the committed steps. Steps a lease names (a save's delta
   base, a step being read) and the newest committed step are kept whatever the policy says; so is
   a step a reader leases later, until step 3 drops it (see 3).
1. Plan without deleting anything: read every committed manifest (a damaged one aborts the GC
   before any delete, naming ``ckpt quarantine``) and mark every object any of them needs, delta
   chains included, every object a pending fragment (of a step after the newest commit) needs, and
   every object a quarantined step names (``ckptlib.quarantine``).
2. Sweep garbage: unmarked objects under ``chunks/`` and ``fragments/`` older than ``grace_s``,
   temp files of killed writes (only while no save holds a lease), expired leases. Only while every
   save lease names this GC's lock (``leases``: such a save checks, after this GC, that what it needs
   exists; one that began before the lock may publish without looking, and a save that re-uses an
   unreferenced object would lose it); the leases are read again before each batch of deletes. A
   save that does not name the lock is waited for, up to ``wait_s`` (then the sweeps are deferred):
   every save that begins later names it. The first time the deletes may go on, the steps committed
   and the fragments published since the listing are marked too (by saves in flight as the leases
   were read). A read lease of a step the
   marks do not cover (dropped by this GC, or never seen committed) also stops the deletes: that
   reader may hold a manifest read before it was dropped. Compaction shortcuts (``compact/``,
   ``ckptlib.compaction``): a table of a step up to the newest commit that this GC does not keep
   (the dropped steps count as not kept already), or that a newer table of the same part of a kept
   step supersedes, and an object no remaining table names, once older than ``grace_s`` (tables of
   later steps are a writer's; a table lost costs a restore time, never data). Keys that are not
   objects ckptlib writes are skipped and reported, never deleted.
3. Drop the steps the policy does not keep: the leases are read again before each batch, and a
   step a reader leased since the plan is kept (its objects marked); for each other, its report and
   verdict, then its manifest last (a crash leaves a committed step whose objects all exist). Also
   when a save deferred the sweeps: this deletes no object. A reader whose lease lands after that
   look either finds no manifest (NoCheckpoint) or holds one, and then its lease stops step 4.
4. Sweep, as in 2, the objects only the dropped manifests needed (not when 2 was deferred).

Memory stays bounded by the set of objects the kept checkpoints reference: listings are read page
by page and manifests a few dozen at a time (read by 16 threads).
"""

from __future__ import annotations

import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import compaction
from .commit import (
    committed_steps,
    fragment_needs,
    is_store,
    manifest_key,
    part_keys,
    read_fragment,
    read_manifest,
    validation_key,
)
from .concurrency import map_ahead
from .errors import CheckpointError, CorruptCheckpoint, ObjectNotFound, StoreError
from .leases import GcLock, expired_leases, live_leases
from .quarantine import quarantined_objects
from .retention import RetentionPolicy
from .store import Store
from .store.base import is_clean_key

log = logging.getLogger("ckptlib")

_CHUNK_KEY = re.compile(r"^chunks/([0-9a-f]{2})/\1[0-9a-f]{30}$")
# a cut's fragment; a rank's fragment of a group's part (``.r<rank>.<save id>``); a sub-step fragment
# (``.k<k>``: a shard checkpoint within a round, never committed; swept as any fragment no manifest
# names once its step is committed, protected while it is pending). docs/format.md names them all.
_FRAGMENT_KEY = re.compile(r"^fragments/(\d+)/[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\.g\d+(?:\.r\d+\.[0-9a-f]{16}|\.k\d+)?\.json$")
_BATCH = 256  # deletes between two looks at the leases and the lock
# A temp file lives for one put (seconds); some puts (the store marker, a lease's own document, a
# validation report) are not covered by a save lease, so a grace of 0 must still not reach them.
TEMP_MIN_AGE_S = 900.0
DEFAULT_GRACE_S = 600.0  # unreferenced objects younger than this are left alone (saves in flight)
# How long a GC waits for saves that began before it (they may publish without looking at it) before
# it defers its sweeps. Saves that begin meanwhile wait for the GC before they publish, so this
# bounds how long a GC can hold up a save too.
DEFAULT_SAVE_WAIT_S = 30.0


@dataclass
class GcReport:
    kept_steps: list[int]
    dropped_steps: list[int]
    deleted_objects: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    dry_run: bool = False
    deferred: str | None = None  # why the sweep did not run (a save in flight)
    skipped: list[str] = field(default_factory=list)  # keys that are not objects ckptlib writes


_DELETE_THREADS = 16  # deletes in flight at once (each is one request; local unlinks release the GIL)
_MARK_THREADS = 16  # manifests read at once (each is parsed whole: memory is this x a manifest's size)
_MARK_WINDOW = 256  # manifests read while marking between two renewals of the GC lock


class _Stop(Exception):
    """A save started, or the lock was lost: stop deleting objects."""


def collect_garbage(store: Store, policy: RetentionPolicy, *, grace_s: float = DEFAULT_GRACE_S,
                    dry_run: bool = False, wait_s: float = DEFAULT_SAVE_WAIT_S) -> GcReport:
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    if wait_s < 0:
        raise ValueError(f"wait_s must be >= 0, got {wait_s}")
    if not is_store(store):
        raise CheckpointError(
            f"{store.url} is not a ckptlib store (no ckptlib.json, no manifests/): garbage collection deletes only "
            "inside a store. Point it at a run's URL (one that `ckpt ls` lists)."
        )
    lock = None if dry_run else GcLock(store).acquire()
    try:
        return _collect(store, policy, grace_s, dry_run, lock, wait_s)
    finally:
        if lock is not None:
            lock.release()


def _collect(store: Store, policy: RetentionPolicy, grace_s: float, dry_run: bool, lock: GcLock | None,
             wait_s: float) -> GcReport:
    # The leases are read BEFORE the steps are listed: a save seen here is still live (its base step
    # is kept, and the sweep waits while it lives), and one not seen here had already published its
    # manifest (a save publishes, then releases its lease), so the listing below has it.
    leases = live_leases(store)
    steps = committed_steps(store)
    protected = {lease.step for lease in leases if lease.step is not None} & set(steps)
    kept = policy.select(steps) | protected | set(steps[-1:])
    dropped = [s for s in steps if s not in kept]
    report = GcReport(sorted(kept), dropped, dry_run=dry_run)
    marks = _Marks.read(store, steps, kept, lock)
    sweeper = _Sweeper(store, report, marks, lock, dry_run, time.time() - grace_s, wait_s)
    try:
        sweeper.run(dropped)
    except _Stop:
        log.warning("garbage collection of %s stopped early: %s", store.url, report.deferred)
    finally:
        sweeper.close()
    if report.skipped:
        log.warning("garbage collection of %s skipped %d keys that ckptlib does not write (e.g. %s)", store.url,
                    len(report.skipped), report.skipped[0])
    return report


class _Marks:
    """What the committed checkpoints need: ``kept`` (objects of the kept steps and of pending
    cuts), ``dropped_only`` (objects only the dropped steps need), as of the steps in ``seen``."""

    def __init__(self, kept: set[str], dropped_only: set[str], seen: set[int]):
        self.kept, self.dropped_only, self.seen = kept, dropped_only, seen

    @property
    def newest(self) -> int:
        return max(self.seen, default=-1)

    @classmethod
    def read(cls, store: Store, steps: list[int], kept_steps: set[int], lock: GcLock | None) -> _Marks:
        """Read every committed manifest (any damage aborts here, before a single delete). Each step's
        keys are folded into the kept or the dropped union as they come: memory is the run's
        distinct objects, not one set per step (10,000 steps sharing most of their objects), and no
        more than 2 x _MARK_THREADS manifests are read ahead of the fold."""
        kept: set[str] = set()
        dropped: set[str] = set()
        with ThreadPoolExecutor(max_workers=_MARK_THREADS, thread_name_prefix="ckpt-gc") as pool:
            for start in range(0, len(steps), _MARK_WINDOW):
                window = steps[start:start + _MARK_WINDOW]
                for step, keys in zip(window, map_ahead(pool, lambda s: _needed(store, s), window, 2 * _MARK_THREADS)):
                    (kept if step in kept_steps else dropped).update(keys)
                if lock is not None and start + _MARK_WINDOW < len(steps) and not lock.renew():
                    raise CheckpointError(f"garbage collection of {store.url} lost its lock while reading manifests; "
                                          "nothing was deleted: run it again")
        marks = cls(kept, dropped - kept, set(steps))
        marks.kept |= _pending_fragment_marks(store, marks.newest) | quarantined_objects(store)
        return marks

    def catch_up(self, store: Store) -> list[int]:
        """Mark the steps committed and the fragments published since the listing (by saves that were
        in flight when this GC read the leases and have finished since): their objects are kept.
        Returns the new steps."""
        new = [s for s in committed_steps(store) if s not in self.seen]
        for step in new:
            keys = _needed(store, step)
            self.kept |= keys
            self.dropped_only -= keys
            self.seen.add(step)
        self.kept |= _pending_fragment_marks(store, self.newest)  # a fragment needs no commit to be published
        return new


class _Sweeper:
    """Deletes, in batches, only while every save in flight will check after this GC (it named the
    lock) and the lock is this GC's."""

    def __init__(self, store: Store, report: GcReport, marks: _Marks, lock: GcLock | None, dry_run: bool,
                 cutoff: float, wait_s: float = 0.0):
        self.store, self.report, self.marks, self.lock, self.dry_run, self.cutoff = \
            store, report, marks, lock, dry_run, cutoff
        self.wait_s = 0.0 if dry_run else wait_s  # a dry run deletes nothing: it has nothing to wait for
        self.waited_until: float | None = None  # the deadline of the wait for saves, once one began
        self.saving = False  # a save lease was live at the last look (temp files are left alone)
        self.caught_up = False
        self.uncommitted: set[int] = set()  # dropped steps whose manifests this GC deletes (or deleted)
        self.deleter = ThreadPoolExecutor(max_workers=_DELETE_THREADS, thread_name_prefix="ckpt-gc-delete")

    def close(self) -> None:
        self.deleter.shutdown(wait=True)

    def run(self, dropped: list[int]) -> None:
        # 2. garbage: what no committed manifest needs. Temp files only while no save is in flight:
        # a write's temp file is as old as the write began, and a slow write can outlive the grace.
        # A save in flight defers the sweeps (2 and 4), not the uncommits (3): those delete only
        # manifests, reports and verdicts of steps no lease names, never an object.
        swept = True
        try:
            if not self.dry_run and self.clear_to_delete() is None and not self.saving:
                for name in self.store.remove_stale_temp(min(self.cutoff, time.time() - TEMP_MIN_AGE_S)):
                    self.report.deleted_objects.append(name)
                self.delete([(key, 0) for key in expired_leases(self.store, self.cutoff)])
            self.sweep(only=None)
        except _Stop:
            if self.lock is not None and not self.lock.still_held():
                raise
            swept = False
        # 3. uncommit the dropped steps: for each, report and verdict first, the manifest last (steps
        # in parallel: no order between two dropped steps matters)
        for start in range(0, len(dropped), _BATCH):
            if self.lock is not None and not self.lock.renew():
                self.report.deferred = "the GC lock was taken over (this GC ran past its lock's expiry): stopped"
                raise _Stop
            # a reader that took its lease since the plan keeps its step (its lease is read here, before the
            # manifest goes; one written later either finds no manifest, or is seen by every sweep below)
            reading = {lease.step for lease in live_leases(self.store) if lease.kind == "read"}
            batch = []
            for step in dropped[start:start + _BATCH]:
                if step in reading:
                    self.keep(step)
                else:
                    batch.append(step)
            self.uncommitted.update(batch)
            for done, skipped, freed in self.deleter.map(lambda s: _uncommit(self.store, s, self.dry_run), batch):
                self.report.deleted_objects.extend(done)
                self.report.skipped.extend(skipped)
                self.report.freed_bytes += freed
        # 4. what only the dropped steps needed (a later GC sweeps it when this one could not)
        if swept and self.marks.dropped_only:
            self.sweep(only=self.marks.dropped_only)
        if not swept:
            raise _Stop

    def keep(self, step: int) -> None:
        """Keep dropped ``step`` after all (a reader leased it since the plan): its objects are marked kept."""
        keys = _needed(self.store, step)
        self.marks.kept |= keys
        self.marks.dropped_only -= keys
        self.report.dropped_steps.remove(step)
        self.report.kept_steps = sorted({*self.report.kept_steps, step})
        log.info("garbage collection of %s keeps step %d: a restore of it is in flight", self.store.url, step)

    def clear_to_delete(self) -> str | None:
        """Why nothing may be deleted now (None: go on), after waiting up to ``wait_s`` in all for
        saves that did not see this GC's lock. The first time it is clear, the steps committed and
        fragments published since the listing are marked: after that no save can publish before
        this GC ends (a save that began after it took the lock names the lock in its lease and waits
        for it). A read lease of a step the marks do not cover (one this GC dropped, or one it never
        saw committed) stops the deletes: that reader may hold a manifest whose objects are no
        longer marked."""
        lock_id = self.lock.id if self.lock is not None else None
        pause = 0.02
        while True:
            leases = live_leases(self.store)
            self.saving = any(lease.kind == "save" for lease in leases)
            busy = [lease for lease in leases if not lease.lets_sweep(lock_id)]
            if self.lock is not None and not self.lock.renew():
                return "the GC lock was taken over or expired (this GC ran past its lock's expiry): stopped"
            if not busy:
                break
            now = time.monotonic()
            if self.waited_until is None:
                self.waited_until = now + self.wait_s
            if now >= self.waited_until:
                return (f"a save is in flight (lease {busy[0].id} from {busy[0].host} pid {busy[0].pid}, waited "
                        f"{self.wait_s:g} s for it): objects were not swept; run GC again later")
            time.sleep(min(pause, self.waited_until - now))
            pause = min(0.5, pause * 2)  # most saves publish within a second
        if not self.caught_up:
            self.caught_up = True
            new = self.marks.catch_up(self.store)
            if new:
                log.info("garbage collection of %s: steps %s were committed while it planned; kept", self.store.url, new)
        reads = [lease for lease in leases if lease.kind == "read" and lease.step is not None
                 and (lease.step in self.uncommitted or lease.step not in self.marks.seen)]
        if reads:
            return (f"a restore of step {reads[0].step}, which is not committed now, is in flight (lease {reads[0].id} "
                    f"from {reads[0].host} pid {reads[0].pid}): objects were not swept; run GC again later")
        return None

    def delete(self, keys: list[tuple[str, int]]) -> None:
        for start in range(0, len(keys), _BATCH):
            why = self.clear_to_delete()
            if why:
                self.report.deferred = why
                raise _Stop
            batch = [(k, n) for k, n in keys[start:start + _BATCH] if k not in self.marks.kept]
            for key, size in batch:
                self.report.deleted_objects.append(key)
                self.report.freed_bytes += size
            if not self.dry_run:  # in parallel: one request each (a 10,000-step run deletes ~30,000 objects)
                list(self.deleter.map(self.store.delete, [key for key, _ in batch]))

    def sweep(self, only: set[str] | None) -> None:
        """Delete unmarked chunks and fragments older than the cutoff (``only``: of these keys)."""
        protect = self.marks.kept if only is not None else self.marks.kept | self.marks.dropped_only
        garbage = []
        for info in self.store.scan("chunks"):
            if not _CHUNK_KEY.match(info.key):
                self.report.skipped.append(info.key)
            elif info.key not in protect and (only is None or info.key in only) and info.modified < self.cutoff:
                garbage.append((info.key, info.size))
        for info in self.store.scan("fragments"):
            m = _FRAGMENT_KEY.match(info.key)
            if not m:
                self.report.skipped.append(info.key)
            elif (info.key not in protect and (only is None or info.key in only)
                  and int(m.group(1)) <= self.marks.newest and info.modified < self.cutoff):
                garbage.append((info.key, info.size))
        if only is None:
            garbage += self._compaction_garbage()
        self.delete(garbage)

    def _compaction_garbage(self) -> list[tuple[str, int]]:
        """Stale compaction tables (first: none is left naming a deleted object), then objects no
        remaining table names; all older than the cutoff."""
        kept = self.marks.seen - set(self.report.dropped_steps)
        tables: dict[str, tuple[int, str, int, bool]] = {}  # key -> step, part, size, old enough
        objects = []
        for info in self.store.scan(compaction.PREFIX):
            m = compaction.TABLE_KEY.match(info.key)
            if m:
                tables[info.key] = (int(m.group(1)), m.group(2), info.size, info.modified < self.cutoff)
            elif compaction.OBJECT_KEY.match(info.key):
                objects.append(info)
            else:
                self.report.skipped.append(info.key)
        newest_kept: dict[str, int] = {}
        for step, part, _, _ in tables.values():
            if step in kept:
                newest_kept[part] = max(step, newest_kept.get(part, step))
        stale = [(key, size) for key, (step, part, size, old) in tables.items()
                 if old and step <= self.marks.newest and (step not in kept or step < newest_kept[part])]
        gone = {key for key, _ in stale}
        named = set().union(*(compaction.objects_named(self.store, key) for key in tables if key not in gone))
        return stale + [(i.key, i.size) for i in objects if i.key not in named and i.modified < self.cutoff]


def _uncommit(store: Store, step: int, dry_run: bool) -> tuple[list[str], list[str], int]:
    """Delete dropped ``step``'s report and verdict, then its manifest: (deleted, skipped, bytes)."""
    done: list[str] = []
    skipped: list[str] = []
    freed = 0
    for info in list(store.scan(f"reports/{step}")):
        if is_clean_key(info.key):
            done.append(info.key)
            freed += info.size
        else:
            skipped.append(info.key)
    if store.exists(validation_key(step)):
        done.append(validation_key(step))
    done.append(manifest_key(step))  # last
    if not dry_run:
        for key in done:
            store.delete(key)
    return done, skipped, freed


def _needed(store: Store, step: int) -> set[str]:
    """Every object committed ``step`` needs: its parts' blobs (delta chains included) and fragments.
    A damaged manifest raises: GC must not guess what a committed checkpoint needs."""
    try:
        m = read_manifest(store, step)
        keys: set[str] = set()
        for name in m.parts:
            keys |= part_keys(store, m, name)
        return keys
    except CorruptCheckpoint as e:
        raise CheckpointError(
            f"garbage collection stopped before deleting anything (it must know what every committed step needs): "
            f"{e}; then run GC again (a quarantine deletes nothing, and GC keeps what a quarantined step names)"
        ) from None


def _pending_fragment_marks(store: Store, newest: int) -> set[str]:
    """Objects that fragments of steps after the newest commit need (a cut being gathered)."""
    keys: set[str] = set()
    for step_dir in store.list_dirs("fragments"):
        if not step_dir.isdigit() or int(step_dir) <= newest:
            continue
        for info in store.scan(f"fragments/{step_dir}"):
            if not _FRAGMENT_KEY.match(info.key):
                continue  # not a fragment (the sweep reports it)
            keys.add(info.key)
            try:
                frag, _ = read_fragment(store, info.key)
            except (ObjectNotFound, CorruptCheckpoint, StoreError, json.JSONDecodeError):
                continue  # unreadable: it can never be committed; its chunks are not protected by it
            keys |= fragment_needs(frag)
    return keys
