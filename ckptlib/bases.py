"""Delta bases: the previous version of each part a writer saves against, and the memory it holds.

A writer (``Checkpointer``) keeps at most one ``Base`` per part: the blob table of the part's last
fragment (every chunk found there is referenced, not rewritten), which unit held which chunk, and,
where known, the chunks' raw bytes (what deltas are taken against). ``DeltaBases`` is that
bookkeeping: it finds a part's base (its own last save or restore, else the latest committed
checkpoint's table, without bytes), adopts a save's result once it is published, and forgets the
bytes of a save that failed. Memory: one copy of the state at most (``Retainer`` writes a
synchronous save's bytes into the old base's buffers instead of holding old and new side by side),
and only of units whose next save may take a delta: with ``keyframe_every=1`` a base holds digests
(all an unchanged chunk's dedup needs) and no bytes.

``BufferPool`` is where snapshots write: the buffers of the last snapshot that the base did not
keep (units written as keyframes keep no base bytes: ``encoding.UnitHint``), and those of the old
base's units whose bytes the new base stopped holding (a delta try that did not pay, a frozen unit),
are handed to the next snapshot of the same part, their pages already faulted in, so a snapshot of
a dense state runs at memcpy speed while the writer holds one copy of it (docs/decisions.md 44, 65,
67).
"""

from __future__ import annotations

import bisect
import math
import mmap
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .chunking import DEFAULT_CHUNK_BYTES, Unit, plan_units
from .encoding import EncodedUnit, Previous, UnitHint, takes_delta
from .manifest import Blob, Fragment


@dataclass
class Base:
    """The previous version of a part. ``blobs``: the blob table of its fragment; ``units``: unit
    identity -> raw checksum, as this writer plans units; ``raw``: the raw bytes of chunks, by
    checksum, where known (after a save, or a restore that kept them; empty otherwise: then changed
    units are written as keyframes)."""

    step: int
    blobs: dict[str, Blob]
    units: dict[tuple, str] = field(default_factory=dict)
    raw: dict[str, np.ndarray] = field(default_factory=dict)
    chunk_bytes: int | None = None  # what it was planned with
    hints: dict[tuple, UnitHint] = field(default_factory=dict)  # unit identity -> what its last encode measured

    def without_bytes(self) -> Base:
        return Base(self.step, self.blobs, self.units, chunk_bytes=self.chunk_bytes, hints=self.hints)

    def previous(self, unit: Unit) -> Previous | None:
        """``unit``'s previous version, when this base holds its bytes (of the same size) and blob."""
        digest = self.units.get(unit.ident)
        data = self.raw.get(digest) if digest is not None else None
        blob = self.blobs.get(digest) if digest is not None else None
        if data is None or blob is None or data.nbytes != unit.nbytes:
            return None
        return Previous(digest, data, blob)  # type: ignore[arg-type]


def base_of(fragment: Fragment, chunk_bytes: int | None, raw: dict[str, Any] | None = None) -> Base:
    """A fragment as the base of this writer's next save of its part, with the raw chunk bytes
    given (by checksum). Units are matched by how this writer plans them (``chunk_bytes``, or the
    fragment's own); a unit planned differently has no base, so its next save is a keyframe."""
    size = chunk_bytes or fragment.chunk_bytes or DEFAULT_CHUNK_BYTES
    units = {}
    for unit in plan_units([leaf.spec for leaf in fragment.leaves], size):
        digest = _unit_digest(unit, fragment)
        if digest is not None:
            units[unit.ident] = digest
    return Base(fragment.step, dict(fragment.blobs), units, dict(raw or {}), size)


def _unit_digest(unit: Unit, fragment: Fragment) -> str | None:
    """The checksum of the chunk of ``fragment`` that holds exactly ``unit``'s bytes, if any."""
    leaves = fragment.leaves
    if unit.packed:
        digests = {leaves[s.leaf].pack for s in unit.segments}
        if len(digests) != 1 or any(leaves[s.leaf].offset != s.unit_start for s in unit.segments):
            return None
        return digests.pop()
    (seg,) = unit.segments
    leaf = leaves[seg.leaf]
    size = leaf.chunk_bytes
    if leaf.pack is not None or not size or seg.leaf_start % size or seg.length != min(size, leaf.spec.nbytes - seg.leaf_start):
        return None
    return leaf.chunks[seg.leaf_start // size]


def host_buffer(nbytes: int, pinned: bool = False) -> np.ndarray:
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


class Retainer:
    """Which bytes of a new save the next base holds, one unit at a time (thread-safe per unit).

    Bytes are kept only where the unit's next save may take a delta: not when its chain is at its
    bound (``keyframe_every``: with 1, never), nor when its hint says no delta will pay. A
    snapshot's own copy becomes the base (not the old buffer even when unchanged: a view keeps its
    whole buffer alive, and old and new buffers must not both stay). A unit read in place from the
    caller's memory is copied into the old base's buffer of that unit when no other unit still
    needs it, else into a new buffer."""

    def __init__(self, base: Base | None, keyframe_every: int):
        self.base = base
        self.keyframe_every = keyframe_every
        # a buffer may be written over in place only if no other unit still needs it as its base
        self._shared = Counter(base.units.values()) if base is not None else Counter()

    def keep(self, unit: Unit, view: np.ndarray, owned: bool, enc: EncodedUnit, position: int) -> np.ndarray | None:
        """The buffer holding ``unit``'s bytes (``view``, just encoded as ``enc``) for the next base,
        or None when its next save will not take a delta: then its snapshot buffer goes back to the
        pool, and the base holds only its digest."""
        # an unchanged unit's blob is the base's (it is unchanged because the base's table holds it)
        blob = enc.blob if enc.blob is not None else self.base.blobs[enc.digest]  # type: ignore[union-attr]
        if not (enc.hint.keep_bytes(position) and takes_delta(blob.depth, self.keyframe_every, position)):
            return None
        if owned:
            return view
        prev = self.base.units.get(unit.ident) if self.base is not None else None
        old = self.base.raw.get(prev) if self.base is not None and prev is not None else None
        if prev is not None and old is not None and old.nbytes == view.nbytes:
            if prev == enc.digest:
                return old  # the base holds these bytes already
            if self._shared[prev] == 1:  # read in place: copy into the old buffer
                old[:] = view
                return old
        kept = host_buffer(view.nbytes)
        kept[:] = view
        return kept


class BufferPool:
    """Snapshot buffers of one part, by size: ``take`` hands out a free one (its pages already
    faulted in) or a new one, and remembers it; ``settle`` keeps, of what the last snapshot took,
    the buffers the new base does not hold (and drops every other free buffer), so the pool never
    holds more than one snapshot's worth, less what the base holds."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._taken: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, pinned: bool = False) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            buf = free.pop() if free else None
        if buf is None:
            buf = host_buffer(nbytes, pinned=pinned)
        with self._lock:
            self._taken.append(buf)
        return buf

    def has_free(self, nbytes: int) -> bool:
        """Whether ``take(nbytes)`` would hand out a buffer whose pages are touched already."""
        with self._lock:
            return bool(self._free.get(nbytes))

    def settle(self, held: list[np.ndarray], extra: list[np.ndarray] | None = None, room: float = math.inf) -> None:
        """After a save: ``held`` are the arrays the new base keeps; ``extra`` more buffers to keep
        free (an old base's) while the free ones add up to at most ``room`` bytes."""
        kept = _Ranges(held)
        with self._lock:
            taken, self._taken = self._taken, []
            self._free = {}
            seen: set[int] = set()
            free = 0
            for buf, limit in [*((b, math.inf) for b in taken), *((b, room) for b in extra or [])]:
                if _address(buf) not in seen and not kept.overlaps(buf) and free + buf.nbytes <= limit:
                    seen.add(_address(buf))
                    self._free.setdefault(buf.nbytes, []).append(buf)
                    free += buf.nbytes

    def clear(self) -> None:
        with self._lock:
            self._free, self._taken = {}, []

    @property
    def free_bytes(self) -> int:
        return sum(b.nbytes for bufs in self._free.values() for b in bufs)


class _Ranges:
    """Address ranges of arrays (merged), to ask whether a buffer shares memory with any of them."""

    def __init__(self, arrays: list[np.ndarray]):
        merged: list[list[int]] = []
        for lo, hi in sorted((_address(a), _address(a) + a.nbytes) for a in arrays if a.nbytes):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._starts = [lo for lo, _ in merged]
        self._ends = [hi for _, hi in merged]

    def overlaps(self, buf: np.ndarray) -> bool:
        lo, hi = _address(buf), _address(buf) + buf.nbytes
        i = bisect.bisect_left(self._starts, hi) - 1  # the last range that starts before our end
        return i >= 0 and self._ends[i] > lo


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


class DeltaBases:
    """Per part: the delta base and the pool of snapshot buffers (``BufferPool``).

    ``load(part)`` gives the base of a part this writer has neither saved nor restored yet (the
    latest committed checkpoint's table, or None); it is called at most once per part."""

    def __init__(self, load: Callable[[str], Base | None]):
        self._load = load
        self._bases: dict[str, Base] = {}
        self._pools: dict[str, BufferPool] = {}

    def get(self, part: str) -> Base | None:
        if part not in self._bases:
            base = self._load(part)
            if base is None:
                return None
            self._bases[part] = base
        return self._bases[part]

    def held(self, part: str) -> Base | None:
        """The base of ``part`` if one is held already (never loads)."""
        return self._bases.get(part)

    def set(self, part: str, base: Base) -> None:
        """A restore kept ``base`` (with its bytes): the snapshot buffers of older saves are dropped."""
        self._bases[part] = base
        self._pools.pop(part, None)

    def buffers(self, part: str) -> BufferPool:
        """Where the next snapshot of ``part`` writes (one snapshot of a part at a time)."""
        return self._pools.setdefault(part, BufferPool())

    def adopt(self, part: str, new: Base, old: Base | None, keep_spare: bool, snapshot_bytes: int = 0) -> None:
        """A published save's result becomes the part's base; the snapshot buffers it does not hold
        go back to the pool. So do the old base's buffers that the new one does not hold: with
        ``keep_spare`` (pinned memory, slow to allocate) all of them. Without, those of whole units
        whose bytes the base stopped holding (a dense unit's delta try that did not pay first, then
        a frozen unit found unchanged twice): the next snapshot copies each such unit and finds a
        buffer for it, where it would fault fresh pages in for as many units (decision 65). They
        are kept while the pool and the bytes the new base keeps for good (not for a dense unit's
        next try) add up to at most ``snapshot_bytes``: one copy of the state, never a spare one."""
        self._bases[part] = new
        room = math.inf
        if old is None:
            extra = []
        elif keep_spare:
            extra = [_owner(b) for b in old.raw.values()]
        else:
            dense = [b for ident, digest in old.units.items()
                     if (b := old.raw.get(digest)) is not None and (h := new.hints.get(ident)) is not None and h.dense]
            # dense units' first: their next snapshot surely copies them (settle keeps each buffer once)
            extra = [b for b in [*dense, *old.raw.values()] if _whole(b)]
            room = snapshot_bytes - sum(b.nbytes for ident, digest in new.units.items()
                                        if (b := new.raw.get(digest)) is not None
                                        and not ((h := new.hints.get(ident)) is not None and h.dense))
        self.buffers(part).settle(list(new.raw.values()), extra, room)

    def forget_bytes(self, part: str) -> None:
        """After a failed save: a save that read the caller's memory in place has written over the
        old base's bytes as it went, so keep only what is certainly right, the last blob table."""
        base = self._bases.get(part)
        if base is not None:
            self._bases[part] = base.without_bytes()
        self._pools.pop(part, None)

    def clear(self) -> None:
        self._bases.clear()
        self._pools.clear()


def substep_chain(key: str) -> str:
    """The key of the chain of sub-step bases beside the chain ``key`` (a part's, or a rank's of a
    group's part, ``part#r<rank>``): a part's sub-step fragments delta against each other, never
    against (or into) its own chain. No part name holds a '/'."""
    part, sep, rank = key.partition("#r")
    return f"{part}/substeps{sep}{rank}"


def chain_origin(key: str) -> str | None:
    """The chain a sub-step chain ``key`` starts from (its first sub-step is a delta against that
    chain's base); None when ``key`` is no sub-step chain."""
    part, sep, rank = key.partition("#r")
    return part.removesuffix("/substeps") + sep + rank if part.endswith("/substeps") else None


def buffer_address(view: np.ndarray) -> int:
    """The address of the whole buffer ``view`` was cut from (views of one buffer share it)."""
    return _address(_owner(view))


def _whole(a: np.ndarray) -> bool:
    """Whether ``a`` is a writable buffer of its own (not a view that keeps a larger one alive)."""
    return a.flags.writeable and a.flags.c_contiguous and not isinstance(a.base, np.ndarray)


def _owner(view: np.ndarray) -> np.ndarray:
    """The whole buffer a view was cut from (a snapshot buffer), as a flat uint8 array."""
    root = view
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root.reshape(-1).view(np.uint8) if root.flags.c_contiguous else view
