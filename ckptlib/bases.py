"""Delta bases: the previous version of each part a writer saves against, and the memory it holds.

A writer (``Checkpointer``) keeps at most one ``Base`` per part: the blob table of the part's last
fragment (every chunk found there is referenced, not rewritten), which unit held which chunk, and,
where known, the chunks' raw bytes (what deltas are taken against). ``DeltaBases`` is that
bookkeeping: it finds a part's base (its own last save or restore, else the latest committed
checkpoint's table, without bytes), adopts a save's result once it is published, and forgets the
bytes of a save that failed. Memory: one copy of the state at most (``retain_unit`` writes a
synchronous save's bytes into the old base's buffers instead of holding old and new side by side).
"""

from __future__ import annotations

import mmap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .chunking import DEFAULT_CHUNK_BYTES, Unit, plan_units
from .encoding import Previous
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

    def without_bytes(self) -> Base:
        return Base(self.step, self.blobs, self.units, chunk_bytes=self.chunk_bytes)

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

    A snapshot's own copy becomes the base (not the old buffer even when unchanged: a view keeps its
    whole buffer alive, and old and new buffers must not both stay). A unit read in place from the
    caller's memory is copied into the old base's buffer of that unit when no other unit still
    needs it, else into a new buffer."""

    def __init__(self, base: Base | None):
        self.base = base
        # a buffer may be written over in place only if no other unit still needs it as its base
        self._shared = Counter(base.units.values()) if base is not None else Counter()

    def keep(self, unit: Unit, view: np.ndarray, owned: bool, digest: str) -> np.ndarray:
        if owned:
            return view
        prev = self.base.units.get(unit.ident) if self.base is not None else None
        old = self.base.raw.get(prev) if self.base is not None and prev is not None else None
        if prev is not None and old is not None and old.nbytes == view.nbytes:
            if prev == digest:
                return old  # the base holds these bytes already
            if self._shared[prev] == 1:  # read in place: copy into the old buffer
                old[:] = view
                return old
        kept = host_buffer(view.nbytes)
        kept[:] = view
        return kept


class DeltaBases:
    """Per part: the delta base and the staging buffers kept for the next snapshot.

    ``load(part)`` gives the base of a part this writer has neither saved nor restored yet (the
    latest committed checkpoint's blob table, or None); it is called at most once per part."""

    def __init__(self, load: Callable[[str], Base | None]):
        self._load = load
        self._bases: dict[str, Base] = {}
        self._spare: dict[str, dict[int, list[np.ndarray]]] = {}

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
        """A restore kept ``base`` (with its bytes): the staging buffers of older saves are dropped."""
        self._bases[part] = base
        self._spare.pop(part, None)

    def take_spare(self, part: str) -> dict[int, list[np.ndarray]] | None:
        return self._spare.pop(part, None)

    def adopt(self, part: str, new: Base, old: Base | None, keep_spare: bool) -> None:
        """A published save's result becomes the part's base. With ``keep_spare``, the old base's
        buffers that the new one does not hold are kept for the next snapshot (by size)."""
        self._bases[part] = new
        if keep_spare and old is not None:
            live = {id(b) for b in new.raw.values()}
            spare: dict[int, list[np.ndarray]] = {}
            for buf in old.raw.values():
                if id(buf) not in live:
                    spare.setdefault(buf.nbytes, []).append(buf)
            self._spare[part] = spare

    def forget_bytes(self, part: str) -> None:
        """After a failed save: a save that read the caller's memory in place has written over the
        old base's bytes as it went, so keep only what is certainly right, the last blob table."""
        base = self._bases.get(part)
        if base is not None:
            self._bases[part] = base.without_bytes()
        self._spare.pop(part, None)

    def clear(self) -> None:
        self._bases.clear()
        self._spare.clear()
