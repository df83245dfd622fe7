"""Save one part of a checkpoint: snapshot -> units (chunks, packs) -> keyframe/delta -> put_if_absent -> Fragment.

Called by ``Checkpointer`` (the only caller). Contract:

* ``take_snapshot`` is the only step that reads the caller's tensors. With ``copy=True`` (a
  background save) it copies every leaf into host buffers and the caller may change its state as
  soon as it returns. With ``copy=False`` (a save the caller waits for) it copies only what it
  cannot read in place (other devices, layouts, small leaves into their packs): CPU tensors are
  encoded straight from their memory, which must not change until the save returns.
* ``encode_part`` writes every unit the part needs that is not already stored, with
  ``put_if_absent`` under a content-derived key: a retry or a concurrent identical save rewrites
  nothing and is safe. It writes no fragment and no manifest; publishing is ``commit``'s job. When
  one upload fails it stops the others (nothing more is written) and raises that error.
* A unit is ``unchanged`` (its raw checksum is already in the base's blob table: referenced, not
  written), a ``delta`` against the unit with the same identity in the base (when the base holds
  its bytes, its chain is shorter than ``keyframe_every``, the chain's deltas stay within
  ``delta_budget`` keyframes, and the delta pays), or a ``keyframe`` (raw when it does not compress).
* With ``retain``, it also returns the bytes of every unit for the next save's deltas: the
  snapshot's own buffers where it made them, else copies written into the previous base's buffers
  (so a Checkpointer holds one base at a time, never two).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import codecs
from .chunking import Unit, plan_units
from .leases import Lease
from .manifest import Blob, Fragment, Leaf, part_digest
from .store import Store
from .throttle import RateLimiter
from .tree import copy_into, flatten, raw_view
from .types import LeafSpec

# A delta lengthens the chain a restore must decode, so it is kept only when it is at least this
# much smaller than a keyframe of the same chunk, and while the chain's deltas, it included, add up
# to at most ``delta_budget`` keyframes of the chunk as it is now. The keyframe is estimated by the
# size of the chain's own keyframe, and encoded only when the estimate says the delta may not do.
_DELTA_PAYS = 0.9
# Defaults of a Checkpointer (measured in docs/decisions.md, "Keyframes by budget"): a chunk's chain
# gets a new keyframe once its deltas add up to twice the keyframe's size, or after 32 links.
DEFAULT_KEYFRAME_EVERY = 32
DEFAULT_DELTA_BUDGET = 2.0
# Below this share of changed elements a sparse delta beats a dense one (measured on the tinylm,
# recsys, finetune and finetune-bf16 workloads: within 0.5% of always picking the smaller).
_SPARSE_BELOW = 0.3
# A keyframe that zstd shrinks by less than this is stored raw: its restore is then a copy
# (docs/decisions.md, "Raw keyframes").
RAW_KEYFRAME_ABOVE = 0.98


@dataclass(frozen=True)
class WriteOptions:
    chunk_bytes: int | None  # None: each part's own (its base's, or chunking.auto_chunk_bytes)
    keyframe_every: int  # longest delta chain + 1: restore reads at most this many objects per chunk
    zstd_level: int
    limiter: RateLimiter = field(default_factory=lambda: RateLimiter(None))  # upload bandwidth
    delta_budget: float | None = DEFAULT_DELTA_BUDGET  # a chain's deltas add up to at most this many keyframes


@dataclass
class Snapshot:
    """A state's leaves as raw bytes, in flatten order, and the units they are stored in."""

    skeleton: Any
    specs: list[LeafSpec]
    units: list[Unit]
    unit_data: list[np.ndarray]  # raw bytes of each unit (views)
    leaf_data: list[np.ndarray]  # raw bytes of each leaf (views; a packed leaf's is a slice of its pack)
    owned: list[bool]  # unit_data[u] is our memory, not the caller's
    chunk_bytes: int = 0
    seconds: float = 0.0


@dataclass
class Base:
    """The previous version of a part: what deltas are taken against and unchanged units are
    found in. ``blobs``: the blob table of its fragment (every checksum found there is stored and
    is referenced, not rewritten); ``units``: unit identity -> raw checksum, as this writer plans
    units; ``raw``: the raw bytes of chunks, by checksum, where known (after a save, or a restore
    that kept them; empty otherwise: then changed units are written as keyframes)."""

    step: int
    blobs: dict[str, Blob]
    units: dict[tuple, str] = field(default_factory=dict)
    raw: dict[str, np.ndarray] = field(default_factory=dict)
    chunk_bytes: int | None = None  # what it was planned with

    @property
    def held_bytes(self) -> int:
        return sum(b.nbytes for b in self.raw.values())

    def without_bytes(self) -> Base:
        return Base(self.step, self.blobs, self.units, chunk_bytes=self.chunk_bytes)


def _host_buffer(nbytes: int, pinned: bool = False) -> np.ndarray:
    """A buffer for a snapshot or a base. Large ones are anonymous memory maps of their own: freed,
    they go back to the system at once. From malloc, the buffers a save frees stay in the
    allocator's arenas (glibc raises its mmap threshold after the first large free), and a
    Checkpointer's memory would grow by a third of the state over the one copy it holds."""
    if pinned:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    if nbytes >= _MAPPED_ABOVE:
        return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    return np.empty(nbytes, dtype=np.uint8)


_MAPPED_ABOVE = 64 << 10


def take_snapshot(state: Any, pool: Executor, chunk_bytes: int | Callable[[int], int], *, copy: bool = True,
                  spare: dict[int, list[np.ndarray]] | None = None) -> Snapshot:
    """The leaves of ``state`` as raw bytes (the blocking part of a save).

    With tensors on a GPU the host buffers are pinned (page-locked): device-to-host copies into
    pinned memory run at full bus speed and asynchronously. ``spare``: buffers of earlier
    snapshots to reuse, by size (pinning is slow; so are page faults on fresh memory).
    """
    t0 = time.perf_counter()
    skeleton, leaves = flatten(state)
    specs = [spec for spec, _ in leaves]
    if callable(chunk_bytes):
        chunk_bytes = chunk_bytes(sum(spec.nbytes for spec in specs))
    units = plan_units(specs, chunk_bytes)
    on_gpu = any(spec.kind == "torch" and obj.is_cuda for spec, obj in leaves)
    spare = spare if spare is not None else {}

    def buffer(nbytes: int) -> np.ndarray:
        reuse = spare.get(nbytes)
        return reuse.pop() if reuse else _host_buffer(nbytes, pinned=on_gpu)

    leaf_data: list[np.ndarray | None] = [None] * len(specs)
    to_copy: list[int] = []  # leaves copied into buffers of ours
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
            view = None if copy else raw_view(leaves[i][1], specs[i])
            if view is None:
                view = buffer(specs[i].nbytes)
                to_copy.append(i)
                copied.add(i)
            leaf_data[i] = view
        unit_data.append(leaf_data[i][seg.leaf_start:seg.leaf_start + seg.length])  # type: ignore[index]
        owned.append(i in copied)
    for i, data in enumerate(leaf_data):
        if data is None:  # zero-byte leaves
            leaf_data[i] = np.empty(0, dtype=np.uint8)

    # torch.copy_ and numpy copies release the GIL: copy in parallel, in a few groups of about equal
    # bytes (one task per leaf would cost more in dispatch than copying a small tensor).
    def copy_group(indices: list[int]) -> None:
        for i in indices:
            copy_into(leaves[i][1], specs[i], leaf_data[i], non_blocking=on_gpu)  # type: ignore[arg-type]

    list(pool.map(copy_group, _balanced_groups([specs[i].nbytes for i in to_copy], _SNAPSHOT_GROUPS, to_copy)))
    if on_gpu:
        import torch

        torch.cuda.synchronize()  # the asynchronous copies must land before the caller moves on
    return Snapshot(skeleton, specs, units, unit_data, leaf_data, owned, chunk_bytes,  # type: ignore[arg-type]
                    time.perf_counter() - t0)


_SNAPSHOT_GROUPS = 8


def _balanced_groups(sizes: list[int], n: int, items: list[int]) -> list[list[int]]:
    """``items`` split into at most n groups of about equal total size (largest first, greedy)."""
    groups: list[list[int]] = [[] for _ in range(min(n, len(items)))]
    totals = [0] * len(groups)
    for k in sorted(range(len(items)), key=lambda k: -sizes[k]):
        g = totals.index(min(totals))
        groups[g].append(items[k])
        totals[g] += sizes[k]
    return [g for g in groups if g]


def _delta_codecs(view: np.ndarray, base_view: np.ndarray, unit: Unit, level: int) -> list:
    """Sparse or dense integer deltas for 1/2/4/8-byte elements, XOR for anything else."""
    if not codecs.integer_deltas_apply(unit.itemsize):
        return codecs.delta_codecs(unit.itemsize, level)
    uint = np.dtype(f"u{unit.itemsize}")
    changed = np.count_nonzero(view.view(uint) != base_view.view(uint))
    if changed < _SPARSE_BELOW * (view.nbytes // unit.itemsize):
        return codecs.sparse_codecs(unit.itemsize, level, unit.is_float)
    return codecs.arith_codecs(unit.itemsize, level, unit.is_float)


def _keyframe(view: np.ndarray, unit: Unit, level: int) -> tuple[list, np.ndarray]:
    """(codecs, payload) of a keyframe: byte planes + zstd, or the raw bytes when zstd does not pay."""
    chosen = codecs.keyframe_codecs(unit.itemsize, level)
    payload = codecs.encode(view, chosen)
    if payload.nbytes >= RAW_KEYFRAME_ABOVE * view.nbytes:
        return [codecs.Raw()], view
    return chosen, payload


def _chain_sizes(blob: Blob, known: dict[str, Blob]) -> tuple[int, int]:
    """(encoded size of the keyframe at the root of ``blob``'s delta chain, or its raw size if
    unknown; encoded bytes of the chain's deltas up to and including ``blob``)."""
    deltas = 0
    while blob.base is not None and blob.base in known:
        deltas += blob.size
        blob = known[blob.base]
    if blob.base is not None:
        return blob.nbytes, deltas + blob.size
    return blob.size, deltas


def _keyframe_better(delta: int, chain_deltas: int, keyframe: int, budget: float | None) -> bool:
    """Whether a keyframe of ``keyframe`` bytes beats a delta of ``delta`` bytes that would bring its
    chain's deltas to ``chain_deltas`` bytes: the delta does not pay, or the chain is over budget."""
    return delta >= _DELTA_PAYS * keyframe or (budget is not None and chain_deltas > budget * keyframe)


def _chain_cap(keyframe_every: int, position: int) -> int:
    """The chain bound of the unit at ``position`` in the part: ``keyframe_every``, lowered by up to
    a quarter for some positions. Units whose chains all started at one save (the first, say) would
    otherwise all reach the bound at the same save, and that save would upload the whole state
    again; staggered, the keyframes spread over a quarter of the cycle. Never above the bound."""
    spread = keyframe_every // 4
    return keyframe_every - position % spread if spread > 1 else keyframe_every


def blob_key(raw_digest: str, base: str | None, codec_configs: list[dict[str, Any]]) -> str:
    """Content-derived object key: the same chunk encoded the same way always lands on the same key."""
    ident = json.dumps([raw_digest, base, codec_configs], sort_keys=True, separators=(",", ":"))
    h = hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()
    return f"chunks/{h[:2]}/{h}"


class _Cancelled(Exception):
    """An upload skipped because another one of the same save failed."""


@dataclass
class _Encoded:
    digest: str
    blob: Blob | None
    wrote: bool
    kind: str
    keep: np.ndarray | None


def encode_part(
    snap: Snapshot,
    base: Base | None,
    store: Store,
    pool: Executor,
    opts: WriteOptions,
    *,
    step: int,
    part: str,
    generation: int = 0,
    config_hash: str | None = None,
    meta: dict[str, Any] | None = None,
    lease: Lease | None = None,
    retain: bool = False,
) -> tuple[Fragment, Base | None, dict[str, bytes]]:
    """(fragment, with ``retain`` the base of the next save (this fragment with its bytes),
    re-used objects' bytes by key when ``lease`` saw a GC running: what ``Lease.before_publish``
    must check)."""
    known = base.blobs if base else {}
    prev_units = base.units if base else {}
    prev_raw = base.raw if base else {}
    # a buffer may be written over in place only if no other unit still needs it as its base
    shared = Counter(prev_units.values())
    failed = threading.Event()
    slots = threading.Semaphore(os.cpu_count() or 2)
    reused: dict[str, bytes] = {}
    reused_lock = threading.Lock()

    def encode_unit(u: int) -> _Encoded:
        if failed.is_set():
            raise _Cancelled
        with slots:  # CPU work with chunk-sized buffers: one per core at a time bounds a save's memory
            digest, blob, payload, kind = encode_one(u)
        wrote = False
        if payload is not None and blob is not None:  # the upload runs outside a slot: many in flight
            opts.limiter.acquire(payload.nbytes)
            if failed.is_set():
                raise _Cancelled
            data = payload.tobytes()
            del payload
            wrote = store.put_if_absent(blob.key, data)
            if not wrote and lease is not None and lease.gc_seen:
                with reused_lock:
                    reused[blob.key] = data
        return _Encoded(digest, blob, wrote, kind, retained(u, digest))

    def encode_one(u: int) -> tuple[str, Blob | None, np.ndarray | None, str]:
        """(raw checksum, blob, payload to upload or None, kind) of unit ``u``."""
        unit, view = snap.units[u], snap.unit_data[u]
        digest = codecs.checksum(view)
        if digest in known:
            return digest, None, None, "unchanged"
        prev_digest = prev_units.get(unit.ident)
        prev_bytes = prev_raw.get(prev_digest) if prev_digest else None
        if prev_bytes is not None and prev_bytes.nbytes != view.nbytes:
            prev_digest, prev_bytes = None, None
        chosen, kind, base_ref, depth = None, "keyframe", None, 0
        base_blob = known.get(prev_digest) if prev_digest and prev_bytes is not None else None
        if base_blob is not None and base_blob.depth + 1 < _chain_cap(opts.keyframe_every, u):
            chosen = _delta_codecs(view, prev_bytes, unit, opts.zstd_level)  # type: ignore[arg-type]
            payload = codecs.encode(view, chosen, prev_bytes)
            kind, base_ref, depth = "delta", prev_digest, base_blob.depth + 1
            key_estimate, chain_deltas = _chain_sizes(base_blob, known)
            chain_deltas += payload.nbytes
            # The chain's own keyframe estimates this chunk's; only when the estimate says a
            # keyframe may be better is one encoded to decide on its real size.
            if _keyframe_better(payload.nbytes, chain_deltas, key_estimate, opts.delta_budget):
                key_codecs, key_payload = _keyframe(view, unit, opts.zstd_level)
                if _keyframe_better(payload.nbytes, chain_deltas, key_payload.nbytes, opts.delta_budget):
                    chosen, payload, kind, base_ref, depth = key_codecs, key_payload, "keyframe", None, 0
        else:
            chosen, payload = _keyframe(view, unit, opts.zstd_level)
        configs = [c.to_config() for c in chosen]
        blob = Blob(blob_key(digest, base_ref, configs), payload.nbytes, view.nbytes, tuple(configs), base_ref, depth)
        return digest, blob, payload, kind

    def retained(u: int, digest: str) -> np.ndarray | None:
        """The bytes of unit ``u`` the next base holds (with ``retain``)."""
        if not retain:
            return None
        unit, view = snap.units[u], snap.unit_data[u]
        if snap.owned[u]:
            # the snapshot's own copy becomes the base (not the old buffer even when unchanged:
            # a view keeps its whole buffer alive, and old and new buffers must not both stay)
            return view
        prev_digest = prev_units.get(unit.ident)
        prev_bytes = prev_raw.get(prev_digest) if prev_digest else None
        if prev_bytes is not None and prev_bytes.nbytes == view.nbytes:
            if prev_digest == digest:
                return prev_bytes  # the base holds these bytes already
            if prev_digest is not None and shared[prev_digest] == 1:  # read in place: copy into the old buffer
                prev_bytes[:] = view
                return prev_bytes
        keep = _host_buffer(view.nbytes)
        keep[:] = view
        return keep

    results = _run_all(pool, encode_unit, len(snap.units), failed)
    if lease is not None:
        lease.renew()

    unit_digest = [r.digest for r in results]
    leaf_units: list[list[int]] = [[] for _ in snap.specs]
    pack_of: dict[int, tuple[int, int]] = {}  # leaf -> (unit, offset)
    for u, unit in enumerate(snap.units):
        for seg in unit.segments:
            if unit.packed:
                pack_of[seg.leaf] = (u, seg.unit_start)
            else:
                leaf_units[seg.leaf].append(u)
    # A leaf's digest is the checksum of all its bytes; for a leaf of one chunk that is the chunk's.
    empty = codecs.checksum(b"")
    needs_hash = [i for i, spec in enumerate(snap.specs) if spec.nbytes and (i in pack_of or len(leaf_units[i]) > 1)]
    hashed = dict(zip(needs_hash, pool.map(lambda i: codecs.checksum(snap.leaf_data[i]), needs_hash)))
    leaves = []
    for i, spec in enumerate(snap.specs):
        digest = hashed.get(i) or (unit_digest[leaf_units[i][0]] if leaf_units[i] else empty)
        if i in pack_of:
            u, offset = pack_of[i]
            leaves.append(Leaf(spec, digest, None, (), unit_digest[u], offset))
        else:
            size = snap.units[leaf_units[i][0]].nbytes if leaf_units[i] else spec.itemsize
            leaves.append(Leaf(spec, digest, size, tuple(unit_digest[u] for u in leaf_units[i])))

    new_blobs: dict[str, Blob] = {}
    stats = {"keyframe": 0, "delta": 0, "unchanged": 0}
    bytes_written = 0
    for r in results:
        stats[r.kind] += 1
        if r.blob is not None:
            new_blobs.setdefault(r.digest, r.blob)
            bytes_written += r.blob.size if r.wrote else 0

    # The blob table holds every object the units need: new blobs plus the delta chains of both
    # new and unchanged units, so the fragment restores on its own.
    table: dict[str, Blob] = {}
    pending = list(unit_digest)
    while pending:
        d = pending.pop()
        if d in table:
            continue
        blob = new_blobs.get(d) or known[d]
        table[d] = blob
        if blob.base is not None:
            pending.append(blob.base)

    fragment = Fragment(
        step=step, part=part, generation=generation, config_hash=config_hash, skeleton=snap.skeleton,
        leaves=tuple(leaves), blobs=table, digest=part_digest(snap.skeleton, leaves),
        logical_bytes=sum(s.nbytes for s in snap.specs), bytes_written=bytes_written, stats=stats,
        meta=dict(meta or {}), chunk_bytes=snap.chunk_bytes,
    )
    new_base = None
    if retain:
        new_base = Base(step, dict(table), {unit.ident: r.digest for unit, r in zip(snap.units, results)},
                        {r.digest: r.keep for r in results if r.keep is not None}, snap.chunk_bytes)
    return fragment, new_base, reused


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
