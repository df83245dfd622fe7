"""``Checkpointer``: the public face of the library. Save, restore, list, verify, fragments, commit.

One writer's checkpoints, composed around one ``PartWriter`` (``ckptlib.part_writer``: what a save
writes) with what reads them back. ``Checkpointer(url, process_group=pg)`` makes the collective one
instead (``ckptlib.distributed.collective_checkpointer``, registered with ``register_collective``).

Thread-safety: one Checkpointer serves one writer (a training loop, or one shard task). Its
methods may be called from one thread at a time; ``save_async`` runs the persisting half in a
background thread of its own. Several processes may read one store at any time, and several
writers may race on the same step: exactly one commit wins (see ``commit.publish``).

Errors are reported once, where they happen, and leave the Checkpointer usable: a failed
``save`` raises from that call; a failed ``save_async`` raises from its future's ``result()``,
or, if nobody asked the future, from the next call. A retry of the same step then works.

Memory: a Checkpointer holds one delta base per part, at most one copy of the state: after a
save, the bytes of what it saved (a background save's snapshot becomes the base, a synchronous
save copies into the previous base's buffers); after ``restore(keep_base=True)``, a copy of what
it restored. A part that also writes sub-step fragments (``write_fragment_async(substep=)``) holds
one more: the newest sub-step's bytes, beside its own base. Restores allocate only the state they
return (or nothing, with ``into=``) plus a few chunks per thread.
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from . import commit, compaction, damage, stateful
from .bases import Base, base_of, substep_chain
from .compaction import Compactor
from .distributed.documents import AnyFragment, GroupFragment
from .encoding import DEFAULT_DELTA_BUDGET, DEFAULT_KEYFRAME_EVERY
from .errors import CheckpointError, CorruptCheckpoint, FormatVersionError, NoCheckpoint, ObjectNotFound, StoreError
from .export import Exported
from .gc import DEFAULT_GRACE_S, DEFAULT_SAVE_WAIT_S, GcReport, collect_garbage
from .leases import Lease
from .manifest import Fragment, Manifest
from .part_writer import PartWriter
from .part_writer import default_threads as default_threads  # where bench/ and older callers find it
from .restore import Problem, inspect_part, restore_part
from .retention import RetentionPolicy
from .save import Snapshot, WriteOptions
from .store import Store

if TYPE_CHECKING:
    from .distributed.restoring import RankState

log = logging.getLogger("ckptlib")
T = TypeVar("T")

SINGLE_PART = "state"
_FRAGMENTS_KEPT = 16  # fragments of recent multi-part manifests kept by a Checkpointer


@dataclass(frozen=True)
class CommitInfo:
    """What one save did. ``committed`` is False when the same state was already committed."""

    step: int
    digest: str
    bytes_written: int  # new object bytes this save stored
    logical_bytes: int  # raw size of the state
    stored_bytes: int  # size of every object the checkpoint needs
    kind: str  # "keyframe" | "delta"
    chunks: dict[str, int]  # {"keyframe": n, "delta": n, "unchanged": n}
    committed: bool
    blocked_s: float  # time the caller was blocked (the snapshot; the whole save for save())
    durable_s: float  # from the call until the manifest was published

    @property
    def ratio(self) -> float:
        """Logical size over bytes written: how many times smaller than a full copy."""
        return self.logical_bytes / max(self.bytes_written, 1)

    @classmethod
    def of(cls, m: Manifest, created: bool, blocked: float, durable: float) -> CommitInfo:
        """What a save that published (``created``) or found (not ``created``) manifest ``m`` did."""
        return cls(m.step, m.digest, m.bytes_written, m.logical_bytes, m.stored_bytes, m.kind, m.stats, created,
                   blocked, durable)


class _HeldStep:
    """A step ``Checkpointer.reading`` holds: its read lease and, once read, its manifest. Handed to
    a restore as its lease: the restore's ``release`` leaves it held."""

    def __init__(self, lease: Lease):
        self.lease = lease
        self.manifest: Manifest | None = None

    def release(self) -> None:
        pass


class SaveFuture(Future, Generic[T]):
    """What ``save_async`` (and ``write_fragment_async``) returns: ``result()`` gives the ``CommitInfo``
    (the ``Fragment``) or raises the save's error. An error taken from here is not raised again by
    the Checkpointer's next call."""

    def __init__(self, step: int, what: str = "save"):
        super().__init__()
        self.step = step
        self.what = what
        self.observed = False

    def result(self, timeout: float | None = None) -> T:
        try:
            value = super().result(timeout)
        except FutureTimeout:
            raise
        except BaseException:
            self.observed = True
            raise
        self.observed = True
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        e = super().exception(timeout)
        self.observed = True
        return e


# What ``Checkpointer(process_group=...)`` makes: a subclass that ``ckptlib.distributed`` registers
# (``register_collective``) when its module is imported. That package sits above this module, which
# never imports it: the first such construction loads it by name, as ``ckptlib`` loads its exports.
_COLLECTIVE_MODULE = "ckptlib.distributed.collective_checkpointer"
_collective: list[type[Checkpointer]] = []


def register_collective(cls: type[Checkpointer]) -> None:
    """Make ``Checkpointer(..., process_group=pg)`` construct ``cls`` (a subclass taking the same
    arguments)."""
    _collective[:] = [cls]


def _collective_class() -> type[Checkpointer]:
    if not _collective:
        importlib.import_module(_COLLECTIVE_MODULE)  # registers it
    return _collective[0]


class Checkpointer:
    """Incremental, content-addressed checkpoints of nested tensor states under one URL.

    ``url``: a plain path, ``file:///abs/path``, ``memory://name`` or ``s3://bucket/prefix``;
    ``storage_options`` go to fsspec/s3fs (endpoint_url, key, secret, ...).
    Options: ``chunk_bytes`` (default: what the part was saved with before, else about 1/32 of the
    state between 256 KiB and 4 MiB, 4 MiB from 64 MiB up; smaller tensors are packed together up to it),
    ``keyframe_every`` K (restore reads at most K objects per chunk; 1 = keyframes only; default
    32), ``delta_budget`` B (a chunk gets a new keyframe once its chain's deltas add up to B times
    its keyframe's size, so a restore reads at most 1 + B keyframes' worth of bytes per chunk;
    default 2; None = only K bounds chains), ``zstd_level``, ``threads`` (encode/IO pool size),
    ``max_upload_bytes_per_s`` (upload bandwidth limit; None = unlimited), ``reuse_buffers``
    (keep a background save's staging buffers for the next one: faster snapshots, one more copy of
    the state in memory; default: only for GPU states, whose pinned buffers are slow to allocate).

    ``process_group``: makes a ``CollectiveCheckpointer`` instead (docs/distributed.md), a subclass.
    Every rank of the group constructs one (it creates a gloo group of its own over the same ranks);
    ``save``, ``save_async``, ``restore`` and ``write_fragment`` are then collective: every rank calls
    them with its own state (DTensors, DDP replicas, per-rank values), one checkpoint holds all ranks
    or none. ``group_timeout_s``: how long a rank waits for the others (a hung rank fails the call then).

    ``compact=True`` (single writer): once a save has committed, a raw copy of each of its
    delta-coded chunks is written beside the stream, off the training path, from the bytes this
    writer holds anyway, so the latest step restores one object per chunk instead of its chains
    (``ckptlib.compaction``; more bytes written per save, counted in ``compaction_bytes``). The
    next save, restore or GC stops a compaction in flight; ``wait()`` and ``close()`` let it end.

    ``writer``: the ``PartWriter`` every save goes through (its pool and delta bases also serve restores).
    """

    rank = 0  # this process's rank in the group that saves (a single writer: 0)

    def __new__(cls, *args: Any, process_group: Any = None, **kwargs: Any) -> Checkpointer:
        """The constructor's dispatch: with a ``process_group``, the registered collective subclass."""
        if process_group is not None and cls is Checkpointer:
            cls = _collective_class()
        return super().__new__(cls)

    def __init__(self, url: str | Store, storage_options: dict | None = None, *,
                 chunk_bytes: int | None = None, keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
                 delta_budget: float | None = DEFAULT_DELTA_BUDGET, zstd_level: int = 3,
                 threads: int | None = None, max_upload_bytes_per_s: float | None = None,
                 reuse_buffers: bool | None = None, process_group: Any = None, group_timeout_s: float = 600.0,
                 compact: bool = False):
        if process_group is not None:  # a subclass of this one reached here: it has no collective save
            raise TypeError(f"{type(self).__name__} is a single writer: construct Checkpointer(..., process_group=) "
                            "for a collective one")
        self.options = WriteOptions.checked(chunk_bytes, keyframe_every, delta_budget, zstd_level,
                                            max_upload_bytes_per_s)
        self.store = url if isinstance(url, Store) else Store.from_url(url, storage_options)
        self.writer = PartWriter(self.store, self.options, load_base=self._committed_base, threads=threads,
                                 reuse_buffers=reuse_buffers)
        self._pool, self._bases = self.writer.pool, self.writer.bases  # short names, for reads too
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-persist")
        # Manifests are read afresh by every call: GC (maybe another process's) drops steps, and a
        # step dropped may be committed again with another state. Fragments a manifest names are
        # immutable by their checksum, so the last few are kept.
        self._fragments: OrderedDict[tuple, AnyFragment] = OrderedDict()
        # steps held by ``reading``: their read lease, and their manifest once read (a held step
        # cannot be dropped, so it cannot be committed again with another state meanwhile)
        self._held: dict[int, _HeldStep] = {}
        self._inflight: SaveFuture[Any] | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._compactor = Compactor(self.store, self._pool, self.options.limiter) if compact else None
        self._compaction: Future[Any] | None = None

    @property
    def url(self) -> str:
        return self.store.url

    # --- saving ----------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, meta: dict | None = None) -> CommitInfo:
        """Encode, upload and commit ``state`` as ``step``; returns when it is durable.

        CPU tensors are encoded in place from their own memory (no copy of the state), so the state
        must not change until this returns; use ``save_async`` to go on training meanwhile.

        A Stateful object (anything with ``state_dict()``) at any position of ``state`` is saved as
        its ``state_dict()``; a value in it the format refuses is refused with its path."""
        commit.check_step(step)
        self._check_open()
        t0 = time.perf_counter()
        self._drain()
        state, _ = stateful.expand(state)
        snap = self.writer.snapshot(state, SINGLE_PART, copy=False)
        return self._persist(step, snap, meta, t0, blocked=None)

    def save_async(self, step: int, state: Any, *, meta: dict | None = None) -> SaveFuture[CommitInfo]:
        """Return once ``state`` is copied; the caller may then change it. At most one save is in
        flight: this first waits for the previous one (and raises its error if nobody took it
        from its future)."""
        commit.check_step(step)
        self._check_open()
        t0 = time.perf_counter()
        self._drain()
        state, _ = stateful.expand(state)
        # no copy of the caller's memory kept: each unit read in place is patched into the base or copied
        snap = self.writer.secure_snapshot(state, SINGLE_PART)
        fut: SaveFuture[CommitInfo] = SaveFuture(step)
        self._in_background(fut, lambda: self._persist(step, snap, meta, t0, blocked=snap.seconds))
        return fut

    def _in_background(self, fut: SaveFuture[Any], work: Callable[[], Any]) -> None:
        """Run ``work`` in the persisting thread, its result or error into ``fut`` (the one in flight)."""
        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(work())
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                fut.set_exception(e)

        with self._lock:
            self._inflight = fut
        self._background.submit(run)

    @property
    def compaction_bytes(self) -> int:
        """Bytes this writer's compactions wrote (``compact=True``; 0 otherwise)."""
        return self._compactor.bytes_written if self._compactor is not None else 0

    @property
    def compaction_seconds(self) -> float:
        """Seconds this writer's compactions ran (in its persisting thread, off the training path)."""
        return self._compactor.seconds if self._compactor is not None else 0.0

    def wait(self) -> None:
        """Block until no save (and no compaction) is in flight; raise the error of a failed
        background save that nobody took from its future."""
        self._drain(finish=True)

    def _drain(self, finish: bool = False) -> None:
        """Wait for the save in flight; then stop the compaction in flight (``finish``: let it end)
        before the caller touches the base it reads."""
        try:
            self._drain_save()
        finally:
            with self._lock:
                compaction, self._compaction = self._compaction, None
            if compaction is not None:
                assert self._compactor is not None
                if not finish:
                    self._compactor.stop.set()
                compaction.result()  # never raises: _compact logs its errors
                self._compactor.stop.clear()

    def _drain_save(self) -> None:
        with self._lock:
            fut, self._inflight = self._inflight, None
        if fut is None:
            return
        try:
            super(SaveFuture, fut).result()  # wait without marking it observed
        except BaseException as e:  # noqa: BLE001
            if not fut.observed:
                fut.observed = True
                raise CheckpointError(f"the background {fut.what} of step {fut.step} failed: {e}") from e

    def _committed_base(self, key: str) -> Base | None:
        """The delta base of a part this writer has neither saved nor restored yet: the blob table of
        the latest committed checkpoint, so its unchanged chunks are referenced instead of re-encoded
        (deltas need the base bytes, which only a save or a restore brings). ``key``: a part, or a
        rank's part (``part#r<rank>``: that rank's fragment of a group's part)."""
        part, _, rank = key.partition("#r")
        latest = self.latest_step()
        if latest is None:
            return None
        m = self._read_manifest(latest)
        if part not in m.parts:
            return None
        frag = self._fragment(m, part)
        if rank or isinstance(frag, GroupFragment):
            from .distributed.restoring import rank_base

            return rank_base(frag, self.store, self._pool, int(rank or 0), self.options.chunk_bytes)
        return base_of(frag, self.options.chunk_bytes)

    def _persist(self, step: int, snap: Snapshot, meta: dict | None, t0: float, blocked: float | None) -> CommitInfo:
        with self.writer.writing(snap, SINGLE_PART, step) as enc:
            base = self._bases.held(SINGLE_PART)
            manifest, created = commit.commit_step(self.store, step, {SINGLE_PART: (enc.fragment, None)},
                                                   parent=base.step if base else None, single=True, meta=meta)
        if not created:
            log.info("step %d was already committed with the same digest: nothing new published", step)
        elif self._compactor is not None:
            self._start_compaction(enc.fragment)
        durable = time.perf_counter() - t0
        return CommitInfo.of(manifest, created, durable if blocked is None else blocked, durable)

    def _start_compaction(self, fragment: Fragment) -> None:
        """Queue the compaction of committed ``fragment`` behind whatever the persisting thread runs
        now (a save's future is settled first: its durable time never includes it)."""
        base = self._bases.held(SINGLE_PART)
        raw = dict(base.raw) if base is not None and base.step == fragment.step else {}
        if raw:
            with self._lock:
                self._compaction = self._background.submit(self._compact, fragment, raw)

    def _compact(self, fragment: Fragment, raw: dict[str, np.ndarray]) -> None:
        assert self._compactor is not None
        try:
            self._compactor.run(fragment, raw)
        except Exception as e:  # noqa: BLE001 - a compaction costs time, never a save
            log.warning("the compaction of step %d failed (%s: %s): its restore reads the delta chains", fragment.step,
                        type(e).__name__, e)

    # --- reading ---------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return commit.committed_steps(self.store)

    def latest_step(self, *, healthy: bool = False) -> int | None:
        """The newest committed step (``healthy``: the newest whose validation passed, that
        ``verify`` did not find damaged, and whose manifest reads: what a resume restores), or None.
        One listing of the manifests; ``healthy`` then lists the damage record, reads verdicts from
        the newest step back until one passed (not every step's, as ``healthy_steps`` does), and that
        step's manifest: a damaged one is skipped with a warning."""
        steps = self.steps()
        if not healthy:
            return steps[-1] if steps else None
        flagged = damage.flagged_steps(self.store)
        return next((step for step in reversed(steps)
                     if step not in flagged and self._healthy(step) and self._readable(step)), None)

    def manifest(self, step: int | None = None) -> Manifest:
        return self._read_manifest(self._resolve(step, healthy=False, skip_flagged=False))

    def fragment(self, step: int, part: str) -> AnyFragment:
        """The fragment of one part of committed ``step`` (checked against its manifest): a
        ``Fragment``, or a ``GroupFragment`` for a part saved by a group of ranks."""
        return self._fragment(self._read_manifest(commit.check_step(step)), part)

    def restore(self, step: int | None = None, *, healthy: bool = False, part: str | None = None,
                device: Any = "cpu", into: Any = None, select: list[str] | None = None,
                keep_base: bool = False, rank: int | None = None, fallback: bool = False) -> Any:
        """The state of ``step`` (None = the latest committed; ``healthy=True``: the latest that
        passed validation), bit-exact and checked against the manifest's digests. Tensors land on
        ``device`` (CPU by default).

        ``into``: a state of the same structure (e.g. ``{"model": model.state_dict(),
        "optimizer": opt.state_dict()}``) whose tensors and arrays are filled in place, CPU or GPU;
        names, shapes and dtypes are checked first and every mismatch is listed in one ValueError
        before anything changes. The returned state holds those same tensors, with every other
        value (step counters, hyperparameters) from the checkpoint: pass it to
        ``optimizer.load_state_dict``. Values the destination lacks (a fresh optimizer's moments)
        are allocated. ``select``: restore only these top-level keys or '/'-paths (e.g.
        ``["model"]`` for evaluation): only their objects are read.

        A single-writer checkpoint returns its state; a multi-part one returns ``{part: state}``,
        or one part's state when ``part`` is given. ``keep_base=True`` also keeps a copy of what was
        restored as the delta base of this Checkpointer's next save (one more copy of the state in
        memory; without it, the next save writes changed chunks as keyframes). Chunks this
        Checkpointer holds already (its base) are copied, not fetched: a follower that restores
        every new step with ``keep_base=True`` decodes one link per changed chunk.

        A part saved by a group of ranks (docs/distributed.md) comes back as saved rank ``rank``
        (default 0) had it, its DTensors as full tensors, or filled into ``into``'s tensors. In a
        collective Checkpointer the call is collective: every rank restores the same step into its
        own state, DTensor shards filled in place from the saved pieces whatever the layout at save
        time, and ``rank`` defaults to the caller's own (rank 0's values for a rank the checkpoint
        has no counterpart for, unless they differ per rank: then it is refused).

        Stateful objects (anything with ``state_dict()``: a model, an optimizer, a scheduler; docs/
        integrations.md) in ``into``, at any position, are filled through their ``state_dict()`` and,
        once every restored value is checked, given it through ``load_state_dict()`` (an object
        without one: TypeError, before anything is read). Without ``into`` the state comes back as
        plain state dicts, as their ``state_dict()`` gave them.

        ``fallback=True`` (the latest step only; off by default): a latest step that turns out
        damaged (``CorruptCheckpoint``, a missing object) is quarantined, with the error as its
        reason in the quarantine's one log line, and the step before it is restored instead, and so
        on; ``NoCheckpoint`` when none restores. A single writer's restore only.
        """
        into, found = stateful.expand(into, loading=True) if into is not None else (None, [])
        found = stateful.check_selected(found, select)
        out = self._restore_plain(step, healthy, part, device, into, select, keep_base, rank, fallback)
        stateful.load(found, out)
        return out

    def _restore_plain(self, step: int | None, healthy: bool, part: str | None, device: Any, into: Any,
                       select: list[str] | None, keep_base: bool, rank: int | None, fallback: bool) -> Any:
        """``restore`` of a plain state (no Stateful objects in ``into``): what a subclass restores
        differently (``CollectiveCheckpointer``)."""
        if fallback:
            return self._restore_falling_back(step, healthy, part, device, into, select, keep_base, rank)
        return self._restore(step, healthy, part, device, into, select, keep_base, rank)

    def _restore_falling_back(self, step: int | None, healthy: bool, part: str | None, device: Any, into: Any,
                              select: list[str] | None, keep_base: bool, rank: int | None) -> Any:
        """``restore(fallback=True)``: the newest step that restores, quarantining the damaged
        ones newer than it (a step that cannot be quarantined, on a read-only store, is skipped)."""
        from .quarantine import quarantine_step

        if step is not None:
            raise ValueError("restore(fallback=True) restores the latest step of a single writer's checkpoint: "
                             "give no step, and no process_group")
        skipped: set[int] = set()
        while True:
            flagged = damage.flagged_steps(self.store)
            latest = next((s for s in reversed(self.steps()) if s not in skipped and s not in flagged
                           and (not healthy or (self._healthy(s) and self._readable(s)))), None)
            if latest is None:
                raise NoCheckpoint(f"no {'healthy ' if healthy else ''}committed step of {self.url} restores"
                                   + (f" (damaged: {sorted(skipped)})" if skipped else ""))
            try:
                return self._restore(latest, False, part, device, into, select, keep_base, rank)
            except (CorruptCheckpoint, ObjectNotFound) as e:
                skipped.add(latest)
                reason = f"restore(fallback=True) found it damaged: {' '.join(str(e).split())}"[:1000]
                try:
                    quarantine_step(self.store, latest, reason)
                except (StoreError, CheckpointError) as q:
                    log.warning("step %d of %s is damaged (%s) and could not be quarantined (%s): restoring the "
                                "step before it", latest, self.url, e, q)

    def _restore(self, step: int | None, healthy: bool, part: str | None, device: Any, into: Any,
                 select: list[str] | None, keep_base: bool, rank: int | None) -> Any:
        """``restore`` of one step (see ``_restore_plain``)."""
        self._check_open()
        self._drain()
        m, lease = self._leased_manifest(step, healthy)
        try:
            names = [part] if part is not None else list(m.parts)
            if into is not None and part is None and not m.single:
                into_parts = into
            else:
                into_parts = {names[0]: into} if into is not None else {}
            out = {}
            for name in names:
                frag = self._fragment(m, name)
                if isinstance(frag, GroupFragment):
                    out[name] = self._restore_group_part(frag, into_parts.get(name), select, device, rank)
                    continue
                held = self._bases.held(name)
                # a writer or follower holding a base decodes one link per changed chunk: no shortcut pays
                shortcuts = compaction.read_table(self.store, frag) if held is None or not held.raw else None
                state, raw = restore_part(frag, self.store, self._pool, device=device, into=into_parts.get(name),
                                          select=select, keep=keep_base,
                                          known=held.raw if held is not None else None, shortcuts=shortcuts)
                if raw is not None:
                    self._bases.set(name, base_of(frag, self.options.chunk_bytes, raw))
                out[name] = state
        finally:
            lease.release()
        if part is not None:
            return out[part]
        return out[SINGLE_PART] if m.single else out

    def verify(self, step: int | None = None) -> list[Problem]:
        """Decode every chunk of ``step`` and check every checksum, digest, the skeleton and the
        parts the manifest commits; [] when it is intact. What it found is recorded
        (``damage.record_verify``): a damaged step is flagged and its damaged objects distrusted by
        saves; an intact one's flag is cleared."""
        checked, problems = self._inspect(step)
        try:
            damage.record_verify(self.store, checked, problems)
        except StoreError as e:  # a read-only store still verifies; it just cannot remember
            log.warning("verify of step %d could not record what it found in %s: %s", checked, self.url, e)
        return problems

    def _inspect(self, step: int | None) -> tuple[int, list[Problem]]:
        self._check_open()
        m = self._read_manifest(self._resolve(step, healthy=False, skip_flagged=False))
        problems = []
        for name in m.parts:
            try:
                frag = self._fragment(m, name)
            except CorruptCheckpoint as e:
                problems.append(Problem(m.step, name, "/", None, None, str(e)))
                continue
            if isinstance(frag, GroupFragment):  # every rank's fragment, and the ranks' fragments together
                from .distributed.restoring import verify_group

                problems += verify_group(frag, self.store, self._pool)
                continue
            problems += inspect_part(frag, self.store, self._pool)[1]
        return m.step, problems

    def export(self, step: int | None, path: str, *, part: str | None = None, force: bool = False,
               convert: bool = False, select: list[str] | None = None) -> Exported:
        """Write ``step`` (None = the latest) as a ``.pt`` or ``.safetensors`` file (ckptlib.export):
        its size and the conversions made. A value the format cannot hold exactly is refused, or
        with ``convert`` written as the nearest one it holds. Refuses to overwrite ``path`` without
        ``force``.

        ``select``: only these '/'-paths (as ``restore(select=)`` takes them; in a multi-part
        checkpoint each starts with its part's name, e.g. ``coordinator/model``). With one path the
        file holds that value itself, its names relative to it: ``["coordinator/model"]`` gives a
        model's own ``state_dict`` names (``fc.weight``), what ``load_state_dict`` takes. With several,
        names keep their whole path (``coordinator.model.fc.weight``). KeyError names a missing path."""
        from .export import format_of, write_export

        format_of(path)
        m = self.manifest(step)
        state = self.restore(m.step, part=part) if not select else self._selected(m, part, list(select))
        info = {"url": self.url, "step": m.step, "digest": m.digest, **({"select": list(select)} if select else {})}
        return write_export(state, path, info=info, force=force, convert=convert)

    def _selected(self, m: Manifest, part: str | None, select: list[str]) -> Any:
        """The values at ``select`` of step ``m`` (see ``export``)."""
        if part is not None or m.single:
            state = self.restore(m.step, part=part, select=select)
        else:
            by_part: dict[str, list[str]] = {}
            for path in select:
                name, _, rest = path.strip("/").partition("/")
                if name not in m.parts:
                    raise KeyError(f"'{path}' names no part of step {m.step}: its parts are {sorted(m.parts)}, and a "
                                   "path of a multi-part checkpoint starts with its part (e.g. 'coordinator/model')")
                by_part.setdefault(name, []).append(rest)
            state = {name: self.restore(m.step, part=name, select=None if "" in rest else rest)
                     for name, rest in by_part.items()}
        return _value_at(state, select[0]) if len(select) == 1 else state

    def _read_manifest(self, step: int) -> Manifest:
        """The committed manifest of ``step``, as the store has it now (read once while ``reading``
        holds the step)."""
        held = self._held.get(step)
        if held is None:
            return commit.read_manifest(self.store, step)
        if held.manifest is None:
            held.manifest = commit.read_manifest(self.store, step)
        return held.manifest

    def _read_lease(self, step: int) -> Lease | _HeldStep:
        """A read lease of ``step`` for one restore (release it when done): the one ``reading`` holds,
        if it holds the step (its ``release`` leaves it held), else a new one."""
        return self._held.get(step) or Lease(self.store, "read", step).try_acquire()

    @contextmanager
    def reading(self, step: int | None = None) -> Iterator[int]:
        """Hold committed ``step`` (None: the latest) for the restores of it inside the block, and
        give its number: one read lease and one read of its manifest for them all, where each
        restore takes its own otherwise. For a reader that restores one step in several calls
        (``ckptlib.dcp.StorageReader``: its metadata, then each rank's parts). Nested or concurrent
        holds of one step share the first (it is released when that one ends)."""
        resolved = self._resolve(step, healthy=False)  # the latest as restore() takes it
        if resolved in self._held:
            yield resolved
            return
        lease = Lease(self.store, "read", resolved).try_acquire()
        self._held[resolved] = held = _HeldStep(lease)
        try:
            self._read_manifest(resolved)  # after the lease: a GC either sees it or dropped the step
            yield resolved
        finally:
            del self._held[resolved]
            held.lease.release()

    def _fragment(self, m: Manifest, part: str) -> AnyFragment:
        ref = m.parts.get(part)
        if ref is None or ref.fragment is not None:
            return commit.load_any_part(self.store, m, part)  # embedded (or a clear error)
        key = (m.step, part, ref.key, ref.checksum)
        if key in self._fragments:
            self._fragments.move_to_end(key)
        else:
            self._fragments[key] = commit.load_any_part(self.store, m, part)
            while len(self._fragments) > _FRAGMENTS_KEPT:
                self._fragments.popitem(last=False)
        return self._fragments[key]

    def _leased_manifest(self, step: int | None, healthy: bool) -> tuple[Manifest, Lease | _HeldStep]:
        """The manifest of the step to restore, read under a read lease of it (release it when done).
        Every restore takes one, the newest step's too: a newer commit can make it droppable while it
        is read. A lease is written before the manifest is read, so a GC either sees it or has
        dropped the step already (NoCheckpoint; for the latest step, the newer latest is read)."""
        if step is not None and (note := damage.flagged_steps(self.store).get(step)) is not None:
            log.warning("restoring step %d of %s, which is marked damaged (%s): every object read is checked, "
                        "and a damaged one fails the restore", step, self.url, note.summary())
        for attempt in range(3):
            resolved = self._resolve(step, healthy=healthy)
            lease = self._read_lease(resolved)
            try:
                return self._read_manifest(resolved), lease
            except NoCheckpoint:
                lease.release()
                if step is not None or attempt == 2:
                    raise
            except BaseException:
                lease.release()
                raise
        raise AssertionError("unreachable")

    def _resolve(self, step: int | None, *, healthy: bool, skip_flagged: bool = True) -> int:
        """``step``, or the latest committed (``healthy``: validated) one. With ``skip_flagged``, the
        latest skips the steps ``verify`` found damaged (``damage.flagged_steps``), in one log line."""
        if step is not None:
            return commit.check_step(step)
        flagged = damage.flagged_steps(self.store) if skip_flagged else {}
        if not flagged:
            latest = self.latest_step(healthy=healthy)
        else:
            committed = self.steps()
            steps = [s for s in committed if s not in flagged]
            latest = next((s for s in reversed(steps) if not healthy or (self._healthy(s) and self._readable(s))), None)
            skipped = [s for s in committed if s in flagged and (latest is None or s > latest)]
            if skipped:
                log.warning("not restoring step(s) %s of %s: marked damaged (step %d: %s); taking "
                            "step %s", ", ".join(map(str, skipped)), self.url, skipped[-1],
                            flagged[skipped[-1]].summary(), latest)
        if latest is None:
            what = "healthy (committed and validated) checkpoint" if healthy else "committed checkpoint"
            also = f" that `ckpt verify` did not find damaged ({sorted(flagged)})" if flagged else ""
            raise NoCheckpoint(f"no {what}{also} in {self.url}")
        return latest

    # --- health (validation verdicts) ------------------------------------------------------------

    def verdict(self, step: int) -> dict | None:
        """The validation verdict of ``step``; None if there is none or it is not a valid verdict
        document (then the step counts as not validated, and a warning names the object)."""
        try:
            doc = json.loads(self.store.get(commit.validation_key(step), max_bytes=commit.VERDICT_MAX_BYTES))
        except ObjectNotFound:
            return None
        except (ValueError, RecursionError, CorruptCheckpoint):  # not JSON, or larger than any verdict
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("passed"), bool):
            log.warning("%s/%s is not a valid verdict: step %d counts as not validated", self.url,
                        commit.validation_key(step), step)
            return None
        return doc

    def healthy_steps(self) -> list[int]:
        """Committed steps whose validation passed, ascending. Failed ones are skipped (logged)."""
        return [step for step in self.steps() if self._healthy(step)]

    def _readable(self, step: int) -> bool:
        """Whether ``step``'s manifest reads; a damaged one is logged: it is being skipped."""
        try:
            self._read_manifest(step)
        except NoCheckpoint:
            return False  # dropped since the listing
        except (CorruptCheckpoint, FormatVersionError) as e:
            log.warning("skipping checkpoint step %d: %s", step, e)
            return False
        return True

    def _healthy(self, step: int) -> bool:
        """Whether ``step``'s validation passed. A failed one is logged: it is being skipped."""
        v = self.verdict(step)
        if v is not None and v["passed"] is True:
            return True
        if v is not None:
            failed = v.get("failed")
            failed = failed if isinstance(failed, list) else []
            log.warning("skipping checkpoint step %d of %s: its validation failed (%s)", step, self.url,
                        ", ".join(map(str, failed)) or f"see validations/{step}.json")
        return False

    # --- multi-writer: fragments and the coordinator's commit ------------------------------------

    def write_fragment(self, step: int, part: str, state: Any, *, generation: int = 0,
                       config_hash: str | None = None, meta: dict | None = None) -> AnyFragment:
        """Save ``state`` as ``part`` of the cut at ``step`` (chunks, then the fragment), as
        generation ``generation``. Raises FencedError if that generation is no longer live.

        In a collective Checkpointer every rank of the group calls it with its own state: each writes
        its rank fragment, the leader the part's group fragment; every rank returns that
        ``GroupFragment`` (or raises the same error)."""
        commit.check_step(step)
        commit.check_part_name(part)
        self._check_open()
        self._drain()
        commit.check_live(self.store, part, generation)
        snap = self.writer.snapshot(state, part, copy=False)
        return self._write_snapshot(snap, step, part, generation, None, config_hash, meta)

    def write_fragment_async(self, step: int, part: str, state: Any, *, generation: int = 0,
                             substep: int | None = None, config_hash: str | None = None, meta: dict | None = None,
                             on_written: Callable[[Fragment, Mapping[str, np.ndarray]], None] | None = None,
                             compress: bool = True) -> SaveFuture[Fragment]:
        """``write_fragment`` in the background: returns once ``state`` is copied (the caller may then
        change it); encoding, uploads and the fragment run in a thread of their own, and the
        future's ``result()`` is the stored ``Fragment``. At most one write or save is in flight:
        this first waits for the previous one (and raises its error if nobody took it).

        ``substep``: a sub-step fragment (``commit.substep_key``), ``part``'s progress ``substep``
        sub-steps into the cut at ``step`` (a shard's checkpoint within a round): part of no cut,
        read back with ``read_fragment(substep=)``. Sub-step fragments chain their own delta bases:
        the first is a delta against the part's base (e.g. the cut it started from), each next one
        against the previous; the part's own base, which its fragment of the cut deltas against,
        stays as it was. ``on_written(fragment, raw)``: called in the background once the fragment is
        stored, with the raw bytes of its units by raw checksum (valid during the call), e.g. to keep
        a local copy; in a collective Checkpointer, on every rank, with the group's fragment and the
        units this rank stored. ``compress=False``: chunks stored raw unless unchanged or sparsely changed (a
        fragment read back soon and then deleted, where the CPU matters more than the bytes).

        In a collective Checkpointer every rank calls it at the same point with its own state, as
        ``write_fragment``; the result is the part's ``GroupFragment`` (every rank's the same)."""
        commit.check_step(step)
        commit.check_part_name(part)
        check_substep(substep)
        self._check_open()
        self._drain()
        base_key = substep_chain(part) if substep is not None else part
        snap = self.writer.snapshot(state, part, copy=True, chain=base_key)
        fut: SaveFuture[Fragment] = SaveFuture(step, f"write of part '{part}'")

        def work() -> Fragment:
            commit.check_live(self.store, part, generation)
            frag = self._write_snapshot(snap, step, part, generation, substep, config_hash, meta, compress)
            units = self.writer.unit_bytes(snap, base_key)
            if on_written is not None and units is not None:
                on_written(frag, units)
            return frag

        self._in_background(fut, work)
        return fut

    def _write_snapshot(self, snap: Snapshot, step: int, part: str, generation: int, substep: int | None,
                        config_hash: str | None, meta: dict | None, compress: bool = True) -> Fragment:
        key = commit.substep_key(step, part, generation, substep) if substep is not None else None
        if substep is not None:
            meta = {**(meta or {}), "substep": substep}
        with self.writer.writing(snap, part, step, base_key=substep_chain(part) if substep is not None else None,
                                 compress=compress, generation=generation, config_hash=config_hash, meta=meta) as enc:
            commit.check_live(self.store, part, generation)  # fenced while encoding: do not publish it
            commit.put_fragment(self.store, enc.fragment, key)
        return enc.fragment

    def read_fragment(self, step: int, part: str, *, generation: int | None = None,
                      device: Any = "cpu", adopt: bool = False, select: list[str] | None = None,
                      fragment: AnyFragment | None = None, into: Any = None, rank: int | None = None,
                      substep: int | None = None, known: Mapping[str, np.ndarray] | None = None) -> Any:
        """The state in a (possibly not yet committed) fragment; generation None = the live one.
        Used by a coordinator to combine the shards of a cut before it commits it. ``adopt=True``
        makes the fragment the delta base of this Checkpointer's next write of ``part`` (as
        ``restore(keep_base=True)`` does). ``select``: only these top-level keys or '/'-paths
        (as in ``restore``). ``fragment``: that fragment, already read (e.g. by ``commit.gather``):
        it is not read again. ``into``: fill that state's tensors in place (as ``restore`` does).
        ``substep``: the sub-step fragment ``substep`` instead (``write_fragment_async(substep=)``);
        adopted, it is the base of the part's next sub-step write. ``known``: raw bytes of units the
        caller holds, by raw checksum (e.g. a local copy): used instead of reading their objects, and
        checked against their checksums like any chunk.

        A group's part comes back as saved rank ``rank`` had it (default: this process's rank in
        its collective group, else 0), sharded tensors whole or filled into ``into``'s DTensor
        shards; no collective call is made (each rank reads what it needs)."""
        self._drain()
        gen = self.live_generation(part) if generation is None else generation
        commit.check_step(step)
        commit.check_part_name(part)
        key = commit.fragment_key(step, part, gen) if substep is None else commit.substep_key(step, part, gen, substep)
        frag = fragment
        if frag is None:
            try:
                frag, _ = commit.read_fragment(self.store, key)
            except ObjectNotFound:
                raise NoCheckpoint(f"no fragment {key} in {self.url}: part '{part}' generation {gen} has not "
                                   f"written step {step} yet") from None
        if (frag.step, frag.part, frag.generation, frag.meta.get("substep")) != (step, part, gen, substep):
            raise CorruptCheckpoint(f"{self.url}/{key} describes step {frag.step}, part '{frag.part}', generation "
                                    f"{frag.generation}, sub-step {frag.meta.get('substep')}")
        if adopt and select is not None:
            raise ValueError("adopt=True needs the whole part (it becomes the delta base): drop select")
        if isinstance(frag, GroupFragment):
            return self._restore_group_part(frag, into, select, device, rank, keep=adopt, substep=substep is not None,
                                            known=known)
        state, raw = restore_part(frag, self.store, self._pool, device=device, keep=adopt, select=select, into=into,
                                  known=known)
        if raw is not None:
            self._bases.set(part if substep is None else substep_chain(part), base_of(frag, self.options.chunk_bytes, raw))
        return state

    def gather(self, step: int, parts: list[str], *, timeout: float = 600.0) -> dict[str, tuple[AnyFragment, str]]:
        """Coordinator: wait until every part has a fragment of its live generation for ``step``;
        {part: (fragment, checksum of its stored bytes)} (``commit.gather``), what ``commit(fragments=)``
        then commits exactly."""
        return commit.gather(self.store, commit.check_step(step), [commit.check_part_name(p) for p in parts],
                             timeout=timeout)

    def commit(self, step: int, parts: list[str], *, timeout: float = 600.0, meta: dict | None = None,
               parent: int | None = None, lineage: dict | None = None,
               fragments: dict[str, tuple[AnyFragment, str]] | None = None) -> CommitInfo:
        """Coordinator: wait for a fragment of the live generation of every part, then publish the
        cut. The manifest names each part's fragment object (it stays O(parts) in size).

        ``fragments``: parts already gathered (``commit.gather``: fragment and the checksum of its
        stored bytes), committed exactly as given: a coordinator that combined those very fragments
        commits them, not a generation fenced in since. Only the other parts are waited for."""
        t0 = time.perf_counter()
        given = dict(fragments or {})
        missing = [p for p in parts if p not in given]
        found = self.gather(step, missing, timeout=timeout) if missing else {}
        if parent is None:
            prior = [s for s in self.steps() if s < step]
            parent = prior[-1] if prior else None
        manifest, created = commit.commit_step(self.store, step, {p: (given.get(p) or found[p]) for p in parts},
                                               parent=parent, meta=meta, lineage=lineage)
        return CommitInfo.of(manifest, created, 0.0, time.perf_counter() - t0)

    def fence(self, part: str, generation: int, reason: str = "", by: str = "",
              details: dict | None = None) -> bool:
        return commit.fence(self.store, commit.check_part_name(part), generation, reason, by, details)

    def live_generation(self, part: str) -> int:
        return commit.live_generation(self.store, part)

    # --- groups of ranks: docs/distributed.md --------------------------------------------------------

    def read_rank(self, step: int, part: str = SINGLE_PART, rank: int = 0, *, generation: int | None = None,
                  fragment: AnyFragment | None = None, select: list[str] | None = None) -> RankState:
        """Saved rank ``rank``'s state of a group's ``part`` as plain values, in this one process: its
        DTensors as the local tensors it held, with ``shards`` = {path: ShardInfo(global shape,
        offsets)}. Of committed ``step``, or with ``generation`` (None = the live one, of a cut not
        committed yet) or ``fragment`` given, of that fragment. What a coordinator averages piece by
        piece; ``write_group`` writes such states back in the same layout."""
        from .distributed.restoring import load_group, read_rank_state

        self._check_open()
        frag = fragment if fragment is not None else self._fragment_of(step, part, generation)
        group = load_group(self.store, self._pool, frag)
        if not 0 <= rank < group.world:
            raise ValueError(f"rank={rank}: step {step}, part '{part}' was saved by ranks 0..{group.world - 1}")
        return read_rank_state(group, self.store, self._pool, rank, select)

    def write_group(self, step: int, part: str, ranks: list[RankState], *, generation: int = 0,
                    config_hash: str | None = None, meta: dict | None = None) -> GroupFragment:
        """Write ``part`` of the cut at ``step`` as a group of ``len(ranks)`` ranks from this one
        process: each rank's state as plain values (``RankState``, as ``read_rank`` gives), stored as
        a collective ``write_fragment`` of those ranks would store them (values equal on every rank
        once, each rank's fragment a delta against the one this Checkpointer wrote for it before)."""
        from .distributed.local import plain_state
        from .distributed.saving import write_group

        commit.check_step(step)
        commit.check_part_name(part)
        self._check_open()
        if not ranks:
            raise ValueError("write_group needs the state of at least one rank")
        commit.check_live(self.store, part, generation)
        locals_ = [plain_state(r.state, r.shards) for r in ranks]
        return write_group(self.writer, step, part, locals_, generation=generation, config_hash=config_hash, meta=meta)

    def _fragment_of(self, step: int, part: str, generation: int | None) -> AnyFragment:
        """Part ``part``'s fragment of committed ``step`` (``generation`` None), or of that generation."""
        if generation is None:
            return self.fragment(step, part)
        key = commit.fragment_key(commit.check_step(step), commit.check_part_name(part), generation)
        try:
            return commit.read_fragment(self.store, key)[0]
        except ObjectNotFound:
            raise NoCheckpoint(f"no fragment {key} in {self.url}") from None

    def _restore_group_part(self, frag: GroupFragment, into: Any, select: list[str] | None, device: Any,
                            rank: int | None, *, keep: bool = False, substep: bool = False,
                            known: Mapping[str, np.ndarray] | None = None) -> Any:
        """A group's part in this process (no collective call): saved rank ``rank``'s state; ``keep``:
        it becomes the base of this rank's next write of the part (``substep``: of its next sub-step);
        ``known``: raw units by raw checksum, of any rank's fragment, used instead of their objects."""
        from .distributed.restoring import load_group, restore_group
        from .distributed.saving import rank_base_key

        group = load_group(self.store, self._pool, frag)
        mine = self.rank
        source = rank if rank is not None else (mine if mine < group.world else 0)
        if not 0 <= source < group.world:
            raise ValueError(f"rank={source}: step {frag.step}, part '{frag.part}' was saved by ranks 0..{group.world - 1}")
        state, raw = restore_group(group, self.store, self._pool, rank=source, into=into, select=select, device=device,
                                   keep=keep and source == mine, known=known)
        if raw is not None:
            key = rank_base_key(frag.part, mine)
            self._bases.set(substep_chain(key) if substep else key, base_of(group.fragments[source],
                                                                             self.options.chunk_bytes, raw))
        return state

    # --- retention -------------------------------------------------------------------------------

    def gc(self, policy: RetentionPolicy, *, grace_s: float = DEFAULT_GRACE_S, dry_run: bool = False,
           wait_s: float = DEFAULT_SAVE_WAIT_S) -> GcReport:
        """Drop checkpoints the policy does not keep and sweep unreferenced objects (see ckptlib.gc).
        ``wait_s``: how long to wait for saves that began before this GC before deferring the sweeps."""
        self._check_open()
        self._drain()
        self._fragments.clear()
        return collect_garbage(self.store, policy, grace_s=grace_s, dry_run=dry_run, wait_s=wait_s)

    # --- lifetime --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this Checkpointer of {self.url} is closed; create a new one")

    def close(self) -> None:
        """Wait for a save (and a compaction) in flight, raising the save's error if nobody took it,
        then free threads and memory. Idempotent."""
        if self._closed:
            return
        try:
            self._drain(finish=True)
        finally:
            self._closed = True
            self._background.shutdown(wait=True)
            self.writer.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_substep(substep: int | None) -> None:
    """ValueError unless ``substep`` is a sub-step number (``write_fragment_async(substep=)``) or None."""
    if substep is not None and (isinstance(substep, bool) or not isinstance(substep, int) or substep < 0):
        raise ValueError(f"substep must be a non-negative int or None, got {substep!r}")


def _value_at(state: Any, path: str) -> Any:
    """The value at '/'-path ``path`` of a (pruned) restored state: keys named as ``tree.key_name``
    names them, a str key before an int's digits (as ``restore(select=)`` chose them)."""
    from .tree import key_name

    for name in (p for p in path.split("/") if p):
        keys = [k for k in state if key_name(k) == name]
        state = state[next((k for k in keys if isinstance(k, str)), keys[0])]
    return state
