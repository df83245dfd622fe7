"""Save one part of a checkpoint: snapshot -> units -> encode -> upload -> digests -> Fragment.

Called by ``Checkpointer`` (the only caller). The phases are the code of ``encode_part``:

1. ``take_snapshot`` and ``take_secure_snapshot`` are the only steps that read the caller's tensors.
   ``take_snapshot(copy=False)`` copies only what it cannot read in place (other devices, layouts,
   small leaves into their packs); a save the caller waits for then encodes CPU tensors straight
   from their memory, which must not change until the save returns. A background save takes
   ``take_secure_snapshot`` instead: each unit read in place is patched into the base's buffer (few
   changes) or copied into a pool buffer, and the caller may change its state as soon as it
   returns. (``copy=True`` copies every leaf into host buffers.)
2. Each unit is encoded (``ckptlib.encoding``: unchanged, delta or keyframe) and uploaded with
   ``put_if_absent`` under a content-derived key: a retry or a concurrent identical save rewrites
   nothing and is safe. An object that exists is trusted unless the damage record names it
   (``suspects``, ``ckptlib.damage``): then its stored bytes are compared with the payload and
   written over when they differ. When one upload fails the others stop (nothing more is written)
   and that error is raised.
3. Each leaf's digest and place (chunks, or an offset in a pack) and the blob table (every object
   the part needs, delta chains included) make the ``Fragment``. It writes no fragment and no
   manifest; publishing is ``commit``'s job.
4. With ``retain``, the digest of every unit, and the bytes of those whose next save may take a
   delta, are kept as the next save's delta base (``bases.Retainer``: one base at a time, never
   two; with ``keyframe_every=1`` no bytes at all).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from . import codecs
from .bases import Base, BufferPool, Retainer, buffer_address, host_buffer
from .chunking import Unit, plan_units
from .damage import Suspects
from .encoding import DEFAULT_DELTA_BUDGET, DEFAULT_KEYFRAME_EVERY, EncodedUnit, EncodeOptions, UnitHint, encode_unit
from .errors import ObjectNotFound, ObjectTooLarge
from .leases import Lease
from .leaves import copy_into, raw_view
from .manifest import MAX_CHAIN, Blob, Fragment, Leaf, part_digest
from .store import Store
from .throttle import RateLimiter
from .tree import SpecMemo, flatten
from .types import TORCH_KINDS, LeafSpec

__all__ = ["DEFAULT_DELTA_BUDGET", "DEFAULT_KEYFRAME_EVERY", "EncodedPart", "Layout", "Snapshot", "WriteOptions",
           "encode_part", "take_snapshot"]


@dataclass(frozen=True)
class WriteOptions:
    chunk_bytes: int | None  # None: each part's own (its base's, or chunking.auto_chunk_bytes)
    keyframe_every: int  # longest delta chain + 1: restore reads at most this many objects per chunk
    zstd_level: int
    limiter: RateLimiter = field(default_factory=lambda: RateLimiter(None))  # upload bandwidth
    delta_budget: float | None = DEFAULT_DELTA_BUDGET  # a chain's deltas add up to at most this many keyframes
    compress: bool = True  # False: raw chunks, only unchanged and sparse-change wins (``EncodeOptions.compress``)

    @classmethod
    def checked(cls, chunk_bytes: int | None, keyframe_every: int, delta_budget: float | None, zstd_level: int,
                max_upload_bytes_per_s: float | None) -> WriteOptions:
        """The options of a ``Checkpointer``, each checked (ValueError naming the bound)."""
        if not isinstance(keyframe_every, int) or not 1 <= keyframe_every <= MAX_CHAIN:
            raise ValueError(f"keyframe_every must be an int in 1..{MAX_CHAIN}, got {keyframe_every!r}")
        if delta_budget is not None and not delta_budget > 0:
            raise ValueError(f"delta_budget must be > 0 (or None for no limit), got {delta_budget}")
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes < 4096):
            raise ValueError(f"chunk_bytes must be an int >= 4096, got {chunk_bytes!r}; about 1-4 MiB suits most stores")
        if not isinstance(zstd_level, int) or not -7 <= zstd_level <= 22:
            raise ValueError(f"zstd_level must be an int in -7..22, got {zstd_level!r}")
        return cls(chunk_bytes, keyframe_every, zstd_level, RateLimiter(max_upload_bytes_per_s), delta_budget)

    @property
    def encoding(self) -> EncodeOptions:
        return EncodeOptions(self.keyframe_every, self.delta_budget, self.zstd_level, self.compress)


@dataclass
class Snapshot:
    """A state's leaves as raw bytes, in flatten order, and the units they are stored in."""

    skeleton: Any
    specs: list[LeafSpec]
    units: list[Unit]
    unit_data: list[np.ndarray]  # raw bytes of each unit (views)
    # raw bytes of each leaf (views; a packed leaf's is a slice of its pack). After take_secure_snapshot a
    # leaf read in place still points at the caller's memory: only ``unit_data`` is ours then
    leaf_data: list[np.ndarray]
    owned: list[bool]  # unit_data[u] is our memory, not the caller's
    chunk_bytes: int = 0
    seconds: float = 0.0
    # unit -> (positions of its changed elements, their old values): changes a snapshot by difference
    # found and patched into the base's buffer, which is now ``unit_data[u]`` (``take_secure_snapshot``)
    changes: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def logical_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


@dataclass
class EncodedPart:
    """What ``encode_part`` made: the fragment (not yet published), with ``retain`` the next save's
    base (this fragment with its bytes), and the bytes of objects found stored already while a GC
    ran (what ``Lease.before_publish`` must check still exist), and the suspect objects it found
    holding its bytes or wrote again (``confirmed``)."""

    fragment: Fragment
    next_base: Base | None
    reused: dict[str, bytes]
    confirmed: set[str] = field(default_factory=set)


# --- 1. snapshot -----------------------------------------------------------------------------------

class Layout:
    """What a chain's snapshots plan once and reuse while the state keeps its layout: the tensors'
    specs (``tree.SpecMemo``) and the units (``plan_units``, a function of the specs and the chunk
    size, known again by the specs' identity). One per chain (a writer's saves of one chain are
    taken one at a time); a state laid out anew is planned anew."""

    def __init__(self) -> None:
        self.specs = SpecMemo()
        self._plan: tuple[list[LeafSpec], int, list[Unit]] | None = None

    def units(self, specs: list[LeafSpec], chunk_bytes: int) -> list[Unit]:
        last = self._plan
        if (last is not None and last[1] == chunk_bytes and len(last[0]) == len(specs)
                and all(a is b for a, b in zip(last[0], specs))):
            return list(last[2])
        units = plan_units(specs, chunk_bytes)
        self._plan = (specs, chunk_bytes, list(units))
        return units


Work = list[tuple[int, Callable[[], None]]]  # (bytes it moves, what moves them): a snapshot's parallel part


def take_snapshot(state: Any, pool: Executor, chunk_bytes: int | Callable[[int], int], *, copy: bool = True,
                  buffers: Callable[[int, bool], np.ndarray] | None = None, layout: Layout | None = None) -> Snapshot:
    """The leaves of ``state`` as raw bytes (the blocking part of a save).

    With tensors on a GPU the host buffers are pinned (page-locked): device-to-host copies into
    pinned memory run at full bus speed and asynchronously. ``buffers(nbytes, pinned)``: where the
    host buffers come from (a writer's ``bases.BufferPool``: buffers of earlier snapshots, whose
    pages are faulted in already; pinning is slow, and so are page faults on fresh memory).
    ``layout``: the chain's plan, reused while the state keeps its layout (``Layout``).
    """
    t0 = time.perf_counter()
    snap, copies, on_gpu = _planned_snapshot(state, chunk_bytes, copy, buffers, layout)
    _run(pool, copies, on_gpu)
    snap.seconds = time.perf_counter() - t0
    return snap


def take_secure_snapshot(state: Any, pool: Executor, chunk_bytes: int | Callable[[int], int], base: Base | None,
                         buffers: BufferPool, layout: Layout | None = None) -> Snapshot:
    """A snapshot of ``state`` that is our own, so the caller may change its state as soon as this
    returns: the blocking part of a background save, without a second copy of the state.

    Small leaves are copied into their packs, as ``take_snapshot(copy=False)`` does; a unit read in
    place whose previous bytes the base holds (in a buffer of its own) is compared with them, and
    when few elements changed, the changes are written into the base's buffer, which becomes the
    unit's snapshot, with the old values kept beside it (``snap.changes``, what its sparse delta is
    made of). A comparison reads two streams and writes nothing: no page of fresh memory is touched,
    where a copy into fresh memory costs 4-5x a memcpy in page faults (docs/decisions.md 44). Every
    other unit is copied into a buffer from ``buffers`` (the writer's pool: pages already faulted
    in, or fresh ones when it has none of that size, which is why more change is patched then).
    The copies and the comparisons share one round of the pool (each of two rounds waited for its
    slowest group). If anything fails, the base's bytes are dropped (some may be patched)."""
    t0 = time.perf_counter()
    snap, copies, on_gpu = _planned_snapshot(state, chunk_bytes, False, buffers.take, layout)
    try:
        _run(pool, copies + _securing(snap, base, buffers), on_gpu)
    except BaseException:
        if base is not None:
            base.raw.clear()  # (some of its bytes may be patched)
        raise
    snap.seconds = time.perf_counter() - t0
    return snap


def _planned_snapshot(state: Any, chunk_bytes: int | Callable[[int], int], copy: bool,
                      buffers: Callable[[int, bool], np.ndarray] | None,
                      layout: Layout | None) -> tuple[Snapshot, Work, bool]:
    """The snapshot with its units placed, the copies still to make into our buffers, and whether a
    leaf is on a GPU (its copies are asynchronous: ``_run`` synchronises)."""
    skeleton, leaves = flatten(state, memo=layout.specs if layout is not None else None)
    specs = [spec for spec, _ in leaves]
    if callable(chunk_bytes):
        chunk_bytes = chunk_bytes(sum(spec.nbytes for spec in specs))
    units = layout.units(specs, chunk_bytes) if layout is not None else plan_units(specs, chunk_bytes)
    on_gpu = any(spec.kind in TORCH_KINDS and obj.is_cuda for spec, obj in leaves)

    def buffer(nbytes: int) -> np.ndarray:
        return buffers(nbytes, on_gpu) if buffers is not None else host_buffer(nbytes, pinned=on_gpu)

    unit_data, leaf_data, owned, to_copy = _place_units(units, leaves, buffer, copy)

    snap = Snapshot(skeleton, specs, units, unit_data, leaf_data, owned, chunk_bytes)
    copies: Work = [(specs[i].nbytes, functools.partial(copy_into, leaves[i][1], specs[i], leaf_data[i], on_gpu))
              for i in to_copy]
    return snap, copies, on_gpu


def _run(pool: Executor, work: Work, on_gpu: bool = False) -> None:
    """Do ``work`` on the pool in a few groups of about equal bytes (torch.copy_ and numpy copies
    release the GIL; one task per item would cost more in dispatch than copying a small tensor)."""
    def group(members: list[int]) -> None:
        for k in members:
            work[k][1]()

    list(pool.map(group, _balanced_groups([nbytes for nbytes, _ in work], _SNAPSHOT_GROUPS, list(range(len(work))))))
    if on_gpu:
        import torch

        torch.cuda.synchronize()  # the asynchronous copies must land before the caller moves on


def _place_units(units: list[Unit], leaves: list[tuple[LeafSpec, Any]], buffer: Callable[[int], np.ndarray],
                 copy: bool) -> tuple[list[np.ndarray], list[np.ndarray], list[bool], list[int]]:
    """Where each unit's and leaf's bytes are: (unit views, leaf views, unit is our memory, leaves to
    copy into our buffers). A packed unit is a buffer of ours; a chunk is a view of its leaf, which
    is the caller's memory when it can be read in place (and ``copy`` is off), else a buffer."""
    leaf_data: list[np.ndarray | None] = [None] * len(leaves)
    to_copy: list[int] = []
    copied: set[int] = set()
    unit_data: list[np.ndarray] = []
    owned: list[bool] = []
    for unit in units:
        if unit.packed:
            buf = buffer(unit.nbytes)
            for seg in unit.segments:
                leaf_data[seg.leaf] = buf[seg.unit_start:seg.unit_start + seg.length]
                to_copy.append(seg.leaf)
            unit_data.append(buf)
            owned.append(True)
            continue
        (seg,) = unit.segments
        i = seg.leaf
        if leaf_data[i] is None:
            spec = leaves[i][0]
            view = None if copy else raw_view(leaves[i][1], spec)
            if view is None:
                view = buffer(spec.nbytes)
                to_copy.append(i)
                copied.add(i)
            leaf_data[i] = view
        unit_data.append(leaf_data[i][seg.leaf_start:seg.leaf_start + seg.length])  # type: ignore[index]
        owned.append(i in copied)
    empty = np.empty(0, dtype=np.uint8)  # zero-byte leaves are in no unit
    return unit_data, [d if d is not None else empty for d in leaf_data], owned, to_copy


_SNAPSHOT_GROUPS = 8
# A snapshot by difference patches the base in place while fewer than this share of a unit's elements
# changed; above it a copy is faster. Into a buffer of the pool (pages touched already) a copy is
# 20-40x cheaper than a patch of 2%; into fresh memory, where each page faults, it is not: on the
# AMD EPYC VM here, 1 MiB of bf16 took 0.34 ms to patch at 2%, 0.70 ms at 5%, 1.25 ms at 10%, and
# 1.07 ms to copy into fresh pages (0.03 ms into touched ones); 4 MiB of int32 2.6 ms at 10%
# against 4.4 ms (an Intel Xeon VM before it: 1.1 ms at 10% against 0.44 ms, so 2% there).
_PATCH_BELOW = 0.02
_PATCH_BELOW_FRESH = 0.08
_SAMPLE_RUNS, _RUN = 64, 16  # elements looked at before a unit is compared whole: 64 runs of 16


def _mostly_changed(new: np.ndarray, old: np.ndarray, below: float) -> bool:
    """Whether a sample of the unit (``_SAMPLE_RUNS`` evenly spaced runs of ``_RUN`` elements)
    already shows far more change than a patch takes (4x ``below``): a dense unit (every weight of
    a dense model moves each step) is then copied without first being compared whole, a pass over
    two streams that could only say "copy". Runs, not single elements: 1,024 elements a page apart
    cost as many cache and TLB misses on memory the step left cold (4 MiB of uint32, cold: 0.03 ms
    a unit against 0.01 for the runs).
    Only the choice between patch and copy depends on it, never what the snapshot holds."""
    if new.size < 8 * _SAMPLE_RUNS * _RUN:
        return False
    rows = new.size // _SAMPLE_RUNS * _SAMPLE_RUNS
    sample = new[:rows].reshape(_SAMPLE_RUNS, -1)[:, :_RUN]
    differs = sample != old[:rows].reshape(_SAMPLE_RUNS, -1)[:, :_RUN]
    return int(np.count_nonzero(differs)) > 4 * below * differs.size


def _securing(snap: Snapshot, base: Base | None, buffers: BufferPool) -> Work:
    """The securing of each unit still read in place (``take_secure_snapshot``)."""
    shared = Counter(base.units.values()) if base is not None else Counter()

    def secure(u: int) -> None:
        unit, view = snap.units[u], snap.unit_data[u]
        previous = base.previous(unit) if base is not None else None
        hint = base.hints.get(unit.ident) if base is not None else None
        if (previous is not None and shared[previous.digest] == 1 and codecs.integer_deltas_apply(unit.itemsize)
                and (hint is None or hint.patched or hint.due(u))):  # one that changed much last time: copied
            uint = f"u{unit.itemsize}"
            new, old = view.view(uint), previous.data.view(uint)
            below = _PATCH_BELOW if buffers.has_free(view.nbytes) else _PATCH_BELOW_FRESH
            if not _mostly_changed(new, old, below):
                differs = new != old
                if np.count_nonzero(differs) < below * new.size:
                    positions = np.flatnonzero(differs)
                    snap.changes[u] = (positions, old[positions])
                    old[positions] = new[positions]
                    snap.unit_data[u], snap.owned[u] = previous.data, True
                    return
        copy = buffers.take(view.nbytes)
        copy[:] = view
        snap.unit_data[u], snap.owned[u] = copy, True

    return [(snap.units[u].nbytes, functools.partial(secure, u)) for u in range(len(snap.units)) if not snap.owned[u]]


def _balanced_groups(sizes: list[int], n: int, items: list[int]) -> list[list[int]]:
    """``items`` split into at most n groups of about equal total size (largest first, greedy)."""
    groups: list[list[int]] = [[] for _ in range(min(n, len(items)))]
    totals = [0] * len(groups)
    for k in sorted(range(len(items)), key=lambda k: -sizes[k]):
        g = totals.index(min(totals))
        groups[g].append(items[k])
        totals[g] += sizes[k]
    return [g for g in groups if g]


# --- the driver ------------------------------------------------------------------------------------

def encode_part(snap: Snapshot, base: Base | None, store: Store, pool: Executor, opts: WriteOptions, *,
                step: int, part: str, generation: int = 0, config_hash: str | None = None,
                meta: dict[str, Any] | None = None, lease: Lease | None = None,
                retain: bool = False, suspects: Suspects | None = None) -> EncodedPart:
    """Encode and upload every unit of ``snap`` against ``base``; the fragment of ``part`` at ``step``.
    ``suspects``: stored objects not trusted because they exist (``base`` must not reference them:
    ``Suspects.clean``)."""
    uploader = _Uploader(store, opts.limiter, lease, suspects)
    units = _encode_units(snap, base, pool, opts, uploader, retain)  # 2. encode + upload
    if retain:
        _detach_partly_kept(snap, units)
    if lease is not None:
        lease.renew()
    leaves = _leaf_entries(snap, [u.digest for u in units], pool)  # 3. digests, places, the blob table
    table = _blob_table(units, base.blobs if base else {})
    fragment = Fragment(
        step=step, part=part, generation=generation, config_hash=config_hash, skeleton=snap.skeleton,
        leaves=tuple(leaves), blobs=table, digest=part_digest(snap.skeleton, leaves),
        logical_bytes=snap.logical_bytes, bytes_written=sum(u.written for u in units),
        stats=_stats(units), meta=dict(meta or {}), chunk_bytes=snap.chunk_bytes,
    )
    next_base = None
    if retain:  # 4. the next save's base
        next_base = Base(step, dict(table), {unit.ident: u.digest for unit, u in zip(snap.units, units)},
                         {u.digest: u.kept for u in units if u.kept is not None}, snap.chunk_bytes,
                         {unit.ident: u.hint for unit, u in zip(snap.units, units)})
    return EncodedPart(fragment, next_base, uploader.reused, uploader.confirmed)


# --- 2. encode and upload --------------------------------------------------------------------------

@dataclass
class _UnitDone:
    digest: str
    kind: str
    blob: Blob | None
    written: int  # bytes this save stored for the unit (0: unchanged, or the object was there)
    kept: np.ndarray | None  # its bytes for the next base (with retain)
    hint: UnitHint  # what its encode measured, for its next save


class _Cancelled(Exception):
    """An upload skipped because another one of the same save failed."""


class _Uploader:
    """``put_if_absent`` of encoded units under the bandwidth limit, stopped once one has failed.
    While a GC runs beside the save (``lease.gc_seen``), the bytes of every object found stored
    already are kept: that GC may sweep it before the save publishes, and then it is written again."""

    def __init__(self, store: Store, limiter: RateLimiter, lease: Lease | None, suspects: Suspects | None = None):
        self.store, self.limiter, self.lease, self.suspects = store, limiter, lease, suspects
        self.failed = threading.Event()
        self.reused: dict[str, bytes] = {}
        self.confirmed: set[str] = set()  # suspects found holding the payload, or written again
        self._lock = threading.Lock()

    def check(self) -> None:
        if self.failed.is_set():
            raise _Cancelled

    def put(self, enc: EncodedUnit) -> int:
        """Store ``enc``'s payload as its blob (and drop the payload); the bytes written (0 when the
        object was there already, or the unit is unchanged)."""
        blob, payload, enc.payload = enc.blob, enc.payload, None
        if blob is None or payload is None:
            return 0
        self.limiter.acquire(payload.nbytes)
        self.check()
        # The payload itself, not a copy: a store reads it during the call only (Store.put_if_absent).
        # It may be a snapshot buffer, which goes back to the pool after the save: what is kept
        # beyond the call is copied.
        suspect = self.suspects is not None and blob.key in self.suspects
        written = self.store.put_if_absent(blob.key, np.ascontiguousarray(payload).data)
        if not written and suspect and not self._holds(blob.key, payload):
            self.store.put(blob.key, np.ascontiguousarray(payload).data)  # replaces the damaged object whole
            written = True
        if suspect:
            with self._lock:
                self.confirmed.add(blob.key)
        if written:
            return blob.size
        if self.lease is not None and self.lease.gc_seen:
            with self._lock:
                self.reused[blob.key] = payload.tobytes()
        return 0

    def _holds(self, key: str, payload: np.ndarray) -> bool:
        """Whether the store holds exactly ``payload`` under ``key`` (read with its size as the cap)."""
        try:
            return self.store.get(key, max_bytes=payload.nbytes) == payload.tobytes()
        except (ObjectNotFound, ObjectTooLarge):
            return False


def _encode_units(snap: Snapshot, base: Base | None, pool: Executor, opts: WriteOptions, uploader: _Uploader,
                  retain: bool) -> list[_UnitDone]:
    """Encode and upload every unit on ``pool``: CPU work one unit per core at a time (that bounds a
    save's memory), uploads outside that bound (many requests in flight)."""
    known = base.blobs if base else {}
    slots = threading.Semaphore(os.cpu_count() or 2)
    retainer = Retainer(base, opts.keyframe_every) if retain else None
    enc_opts = opts.encoding

    def one(u: int) -> _UnitDone:
        uploader.check()
        unit, view = snap.units[u], snap.unit_data[u]
        previous, hint = (base.previous(unit), base.hints.get(unit.ident)) if base else (None, None)
        if previous is not None and u in snap.changes:
            previous = replace(previous, changes=snap.changes[u])
        with slots:
            enc: EncodedUnit = encode_unit(view, unit, u, known, previous, enc_opts, hint)
        written = uploader.put(enc)  # outside a slot: many uploads in flight
        kept = retainer.keep(unit, view, snap.owned[u], enc, u) if retainer is not None else None
        return _UnitDone(enc.digest, enc.kind, enc.blob, written, kept, enc.hint)

    return _run_all(pool, one, len(snap.units), uploader.failed)


def _detach_partly_kept(snap: Snapshot, units: list[_UnitDone]) -> None:
    """A snapshot buffer may hold a whole leaf; a base that keeps the bytes of some of its chunks
    only (the others are written as keyframes and need none) would keep the whole buffer alive, out
    of the pool. Those chunks get buffers of their own, so the leaf's buffer goes back to the pool."""
    by_buffer: dict[int, list[int]] = {}
    for u, unit in enumerate(snap.units):
        if snap.owned[u] and not unit.packed:
            by_buffer.setdefault(buffer_address(snap.unit_data[u]), []).append(u)
    for members in by_buffer.values():
        kept = [u for u in members if units[u].kept is not None]
        if kept and len(kept) < len(members):
            for u in kept:
                own = host_buffer(units[u].kept.nbytes)  # type: ignore[union-attr]
                own[:] = units[u].kept
                units[u].kept = own


def _run_all(pool: Executor, fn: Any, n: int, failed: threading.Event) -> list[Any]:
    """fn(0..n-1) on the pool; on the first error, stop starting new calls, wait for the running
    ones, and raise that error (so a failed save leaves no upload running behind it). The failing
    call itself raises the flag, so calls still queued see it at once, whatever their order."""
    def run(i: int) -> Any:
        try:
            return fn(i)
        except _Cancelled:
            raise
        except BaseException:
            failed.set()
            raise

    futures: list[Future] = [pool.submit(run, i) for i in range(n)]
    first: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except (_Cancelled, CancelledError):
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised below, once every upload has stopped
            if first is None:
                first = e
                for other in futures:
                    other.cancel()
    if first is not None:
        raise first
    return [f.result() for f in futures]


# --- 3. the fragment's leaves and blob table -------------------------------------------------------

def _leaf_entries(snap: Snapshot, unit_digest: list[str], pool: Executor) -> list[Leaf]:
    """Each leaf's digest (the checksum of all its bytes; for a leaf of one chunk, the chunk's) and
    where its bytes are: its chunks, or an offset in a pack."""
    leaf_units: list[list[int]] = [[] for _ in snap.specs]
    pack_of: dict[int, tuple[int, int]] = {}  # leaf -> (unit, offset)
    for u, unit in enumerate(snap.units):
        for seg in unit.segments:
            if unit.packed:
                pack_of[seg.leaf] = (u, seg.unit_start)
            else:
                leaf_units[seg.leaf].append(u)
    empty = codecs.checksum(b"")
    needs_hash = [i for i, spec in enumerate(snap.specs) if spec.nbytes and (i in pack_of or len(leaf_units[i]) > 1)]

    def leaf_digest(i: int) -> str:
        # a leaf of several chunks is hashed chunk by chunk (its chunks may live in separate buffers)
        if i in pack_of:
            return codecs.checksum(snap.leaf_data[i])
        return codecs.checksum_of([snap.unit_data[u] for u in leaf_units[i]])

    hashed = dict(zip(needs_hash, pool.map(leaf_digest, needs_hash)))
    leaves = []
    for i, spec in enumerate(snap.specs):
        digest = hashed.get(i) or (unit_digest[leaf_units[i][0]] if leaf_units[i] else empty)
        if i in pack_of:
            u, offset = pack_of[i]
            leaves.append(Leaf(spec, digest, None, (), unit_digest[u], offset))
        else:
            size = snap.units[leaf_units[i][0]].nbytes if leaf_units[i] else spec.itemsize
            leaves.append(Leaf(spec, digest, size, tuple(unit_digest[u] for u in leaf_units[i])))
    return leaves


def _blob_table(units: list[_UnitDone], known: dict[str, Blob]) -> dict[str, Blob]:
    """Every object the units need: new blobs (of units with the same bytes, the first's) plus the
    delta chains of both new and unchanged units, so the fragment restores on its own."""
    new: dict[str, Blob] = {}
    for u in units:
        if u.blob is not None:
            new.setdefault(u.digest, u.blob)
    table: dict[str, Blob] = {}
    pending = [u.digest for u in units]
    while pending:
        d = pending.pop()
        if d in table:
            continue
        blob = new.get(d) or known[d]
        table[d] = blob
        if blob.base is not None:
            pending.append(blob.base)
    return table


def _stats(units: list[_UnitDone]) -> dict[str, int]:
    stats = {"keyframe": 0, "delta": 0, "unchanged": 0}
    for u in units:
        stats[u.kind] += 1
    return stats
