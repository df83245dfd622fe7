"""``PartWriter``: writes one part. Snapshot -> encode -> put -> fragment, under a save lease.

Both checkpointers compose one: the single writer (``ckptlib.checkpointer``) publishes what it
encodes as a manifest or a fragment of a cut; the collective one (``ckptlib.distributed``) as a
rank's fragment of a group's part. Either way the caller publishes inside ``writing``::

    snap = writer.snapshot(state, part, copy=False)
    with writer.writing(snap, part, step) as enc:     # encoded and put, under the save lease
        commit.commit_step(store, step, {part: (enc.fragment, None)}, ...)   # the caller's publish
    # here enc's base is the part's next delta base

The writer owns what that needs: the store, the ``WriteOptions``, the encode/IO pool, the delta
bases (``DeltaBases``: one per chain, a part's or a rank's or a sub-step chain), the store's marker,
and which suspect objects (``ckptlib.damage``) its saves found intact. One part is written at a
time per chain; the pool and the bases are shared by the chains.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from . import commit, damage
from .bases import Base, DeltaBases, chain_origin
from .chunking import auto_chunk_bytes
from .errors import CorruptCheckpoint, FormatVersionError, NoCheckpoint, StoreError
from .leases import Lease
from .save import EncodedPart, Layout, Snapshot, WriteOptions, encode_part, take_secure_snapshot, take_snapshot
from .store import Store

log = logging.getLogger("ckptlib")


def default_threads(store: Store) -> int:
    """Encode/IO threads: twice the cores (numpy, zstd and hashing release the GIL); at least 16
    for a remote store, where most of a thread's time is a request in flight."""
    cores = (os.cpu_count() or 2) * 2
    return min(32, cores) if store.capabilities.atomic_rename else min(64, max(16, cores))


class PartWriter:
    """Writes parts of checkpoints to ``store`` with ``options`` (see ``writing``).

    ``load_base(key)``: the delta base of a chain this writer has neither written nor been given
    (``bases.set``) yet, e.g. the latest committed checkpoint's table; None for none.
    ``threads``: the encode/IO pool's size (None: ``default_threads``). ``reuse_buffers``: keep a written snapshot's buffers
    for the next snapshot of its chain (None: only pinned ones, a GPU state's, slow to allocate).
    Thread-safety: one ``writing`` per chain at a time; the chains may be written from different
    threads."""

    def __init__(self, store: Store, options: WriteOptions, *, load_base: Callable[[str], Base | None],
                 threads: int | None = None, reuse_buffers: bool | None = None):
        self.store = store
        self.options = options
        self.reuse_buffers = reuse_buffers
        self.pool = ThreadPoolExecutor(max_workers=threads or default_threads(store), thread_name_prefix="ckpt-io")
        self.bases = DeltaBases(load_base)
        self._marked = False
        self._lock = threading.Lock()
        # suspect objects (ckptlib.damage) this writer found intact or wrote again, by note
        self._confirmed: dict[tuple[int, str], set[str]] = {}
        self._layouts: dict[str, Layout] = {}  # by chain: what its snapshots plan once (save.Layout)

    def chunk_size(self, key: str) -> int | Callable[[int], int]:
        """The chunk size of chain ``key``'s next write: the option, else its base's (so deltas line
        up), else one chosen from the state's size."""
        if self.options.chunk_bytes is not None:
            return self.options.chunk_bytes
        base = self.bases.get(key)
        if base is not None and base.chunk_bytes:
            return base.chunk_bytes
        return auto_chunk_bytes

    def snapshot(self, state: Any, key: str, *, copy: bool, chain: str | None = None) -> Snapshot:
        """``state`` as raw bytes, chunked as chain ``key``'s next write (``copy=False``: CPU tensors
        read in place, so the state must not change until its ``writing`` ends). ``chain``: whose
        buffers it reuses, when not ``key``'s (a sub-step chain's)."""
        return take_snapshot(state, self.pool, self.chunk_size(key), copy=copy,
                             buffers=self.bases.buffers(chain or key).take, layout=self._layout(key))

    def secure_snapshot(self, state: Any, key: str) -> Snapshot:
        """A snapshot that is this writer's own once it returns, without a second copy of the state:
        each unit read in place is patched into chain ``key``'s base or copied (``take_secure_snapshot``)."""
        return take_secure_snapshot(state, self.pool, self.chunk_size(key), self.bases.held(key),
                                    self.bases.buffers(key), self._layout(key))

    def _layout(self, key: str) -> Layout:
        """Chain ``key``'s plan (``save.Layout``), kept while the writer lives."""
        with self._lock:
            return self._layouts.setdefault(key, Layout())

    @contextmanager
    def writing(self, snap: Snapshot, part: str, step: int, *, base_key: str | None = None, compress: bool = True,
                **fragment: Any) -> Iterator[EncodedPart]:
        """Encode ``snap`` as ``part`` of ``step`` against its chain's base and put its objects, under
        a save lease; give the ``EncodedPart`` (its fragment not published yet) to the block, which
        publishes it (commits a manifest, puts a fragment) while the lease is held.

        The block returns: the encoded part becomes the chain's next base. It raises (or encoding
        did): the chain keeps its base's blob table and forgets its bytes (a snapshot read in place
        may have written over them), and the error goes on. Objects a GC beside the lease swept are
        put again as keyframes before the block runs. ``base_key``: the chain, when not the part's
        own: a rank's (``part#r<rank>``) or a sub-step chain (``bases.substep_chain``), which starts
        from its origin's base and leaves that as it is. ``compress=False``: raw chunks
        (``EncodeOptions.compress``). ``fragment``: the fragment's fields (``encode_part``)."""
        options = self.options if compress else replace(self.options, compress=False)
        key = base_key or part
        origin = chain_origin(key)
        base = self.bases.held(key) if origin else self.bases.get(key)
        own_chain = base is not None or origin is None
        if base is None and origin:
            base = self.bases.get(origin)
        # No object is trusted because it exists, not even one this writer saved (ckptlib.damage):
        # one listing per save, beside the lease's writes; on a healthy run it finds nothing.
        listing = self.pool.submit(damage.notes, self.store)
        with Lease(self.store, "save", base.step if base else None) as lease:
            self._ensure_marker()  # under the lease: a GC running beside it leaves its temp file alone
            found = listing.result()
            with self._lock:
                suspects = damage.Suspects.of(found, self._confirmed) if found else None
            if suspects is not None:
                base = suspects.clean(base)
            if base is not None and not lease.gc_seen and not self._still_committed(base, origin if origin and not own_chain else key):
                log.info("step %d, the base of this save of part '%s' of step %d, is no longer committed as it was "
                         "(a garbage collection dropped it since): writing the part as keyframes", base.step, part, step)
                base = None
            try:
                enc = self._encode(snap, base, options, lease, suspects, step=step, part=part, **fragment)
                yield enc
            except BaseException:
                self.bases.forget_bytes(key)
                raise
        if found:
            with self._lock:
                damage.confirm(self._confirmed, found, enc.confirmed)
        keep_spare = self.reuse_buffers if self.reuse_buffers is not None else _pinned(snap)
        # a sub-step chain's first base is the part's own: its buffers are never handed out as spares
        self.bases.adopt(key, enc.next_base, base, keep_spare and own_chain,  # type: ignore[arg-type]
                         snap.logical_bytes if own_chain else 0)

    def _still_committed(self, base: Base, key: str) -> bool:
        """Whether the store still keeps every object ``base`` (chain ``key``'s) names. No lease kept
        them between this writer's saves: a GC then may have dropped its step (when it was not the
        newest: an older step saved again, one restored with ``keep_base``) and swept its objects.
        It keeps them if ``base``'s step commits them for the chain's part, or if that step is newer
        than every commit (a pending fragment's, e.g. a sub-step chain's: GC keeps those). Looked at
        after this save's lease was written, which makes every later GC keep the step; a GC that
        already held the lock then is covered by ``before_publish``."""
        part = key.partition("#r")[0].removesuffix("/substeps")
        try:
            manifest = commit.read_manifest(self.store, base.step)
        except NoCheckpoint:
            return base.step > max(commit.committed_steps(self.store), default=-1)
        except (CorruptCheckpoint, FormatVersionError):
            return False
        try:
            blobs = commit.load_any_part(self.store, manifest, part).blobs
        except (NoCheckpoint, CorruptCheckpoint, FormatVersionError):
            return False
        return all((b := blobs.get(digest)) is not None and b.key == blob.key for digest, blob in base.blobs.items())

    def _encode(self, snap: Snapshot, base: Base | None, options: WriteOptions, lease: Lease,
                suspects: damage.Suspects | None, *, step: int, part: str, **fragment: Any) -> EncodedPart:
        """Encode and put ``snap``; once more as keyframes if a GC beside the lease swept what it needs."""
        enc = encode_part(snap, base, self.store, self.pool, options, step=step, part=part, lease=lease,
                          retain=True, suspects=suspects, **fragment)
        missing = lease.before_publish([b.key for b in enc.fragment.blobs.values()], enc.reused)
        if not missing:
            return enc
        # A GC that held the lock as this save began swept objects it wrote or built on (docs/format.md,
        # "Garbage collection"): encode again, keyframes only. That GC has ended, and every later one
        # sees this lease.
        log.warning("a garbage collection beside this save of step %d swept %d objects it needs (e.g. "
                    "%s): writing part '%s' again as keyframes", step, len(missing), missing[0], part)
        enc = encode_part(snap, None, self.store, self.pool, options, step=step, part=part, lease=lease,
                          retain=True, suspects=suspects, **fragment)
        missing = lease.before_publish([b.key for b in enc.fragment.blobs.values()], {})
        if missing:
            raise StoreError(f"{len(missing)} objects of step {step} (e.g. {self.store.url}/{missing[0]}) "
                             "vanished as they were written: is another program deleting in this store?")
        return enc

    def _ensure_marker(self) -> None:
        if not self._marked:
            commit.ensure_marker(self.store)
            self._marked = True

    def unit_bytes(self, snap: Snapshot, key: str) -> dict[str, np.ndarray] | None:
        """The raw bytes of every unit of ``snap``, just written on chain ``key``, by raw checksum
        (the base it became names each unit's); None when the chain holds no base."""
        base = self.bases.held(key)
        if base is None:
            return None
        return {base.units[unit.ident]: data for unit, data in zip(snap.units, snap.unit_data)}

    def close(self) -> None:
        """Free the pool's threads and the bases' memory (after the last ``writing``)."""
        self.pool.shutdown(wait=True)
        self.bases.clear()


def _pinned(snap: Snapshot) -> bool:
    """Whether a snapshot's buffers are pinned host memory (a GPU state's)."""
    if not snap.unit_data or "torch" not in sys.modules:
        return False
    import torch

    return torch.cuda.is_available() and torch.from_numpy(snap.unit_data[0]).is_pinned()
