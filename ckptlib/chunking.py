"""Which stored chunk holds which bytes of which leaf. Pure; no I/O, no copies.

A *unit* is one stored chunk: either a slice of a large leaf (leaves of at least one chunk are
cut into fixed-size chunks), or a *pack* of small leaves (each smaller than a chunk) laid end to
end. Packing keeps the number of objects near ``bytes / chunk_bytes`` instead of one object per
tensor: a ResNet-50 state has 481 tensors, most of them small.

Packs are made per group (top-level key, element size, float or not; see ``LeafSpec.group``) so
a partial restore of one key reads only its own packs and byte planes line up; within a group
leaves are placed first-fit by decreasing size, so packs are nearly full. A group's pack at most
half full (a small group, or a large one's rest) goes to the packs shared by its element size and
kind instead, kept whole: a flat state of many small groups (``w0``..``w99``, or ``layer{i}.``)
is still about ``bytes / chunk_bytes`` objects, and a small group still reads one pack. The plan
depends only on the leaves' paths, sizes and types: the same state shape gives the same units at
every save, and a unit's delta base is the unit with the same ``ident`` in the previous checkpoint.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .types import LeafSpec

DEFAULT_CHUNK_BYTES = 4 << 20  # 4 MiB: large enough for zstd and S3, small enough to parallelise
MIN_AUTO_CHUNK_BYTES = 256 << 10
FULL_CHUNK_FROM = 16 * DEFAULT_CHUNK_BYTES  # 64 MiB


def auto_chunk_bytes(state_bytes: int) -> int:
    """The chunk size for a state of ``state_bytes``: about 1/32 of it as a power of two, between
    256 KiB and 4 MiB, and 4 MiB from 64 MiB up. A restore decodes a few chunks per core at a time,
    so chunks small against the state keep its memory beside the state small (docs/decisions.md,
    "Memory"); 4 MiB is large enough for zstd and for S3 requests, and from 64 MiB up its buffers
    are small beside the state while the stream is 3% smaller than with 2 MiB (decision 60)."""
    if state_bytes >= FULL_CHUNK_FROM:
        return DEFAULT_CHUNK_BYTES
    size = MIN_AUTO_CHUNK_BYTES
    while size < DEFAULT_CHUNK_BYTES and size * 2 * 32 <= state_bytes:
        size *= 2
    return size


def chunk_size_for(itemsize: int, chunk_bytes: int) -> int:
    """Chunk length in bytes: a multiple of the element size, so byte planes line up."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    return max(itemsize, chunk_bytes - chunk_bytes % itemsize)


def chunk_ranges(nbytes: int, size: int) -> list[tuple[int, int]]:
    """[(start, stop)] covering 0..nbytes in order; an empty leaf has no chunks."""
    return [(start, min(start + size, nbytes)) for start in range(0, nbytes, size)]


@dataclass(frozen=True)
class Segment:
    """``length`` bytes of leaf ``leaf`` from ``leaf_start`` sit at ``unit_start`` in the unit."""

    leaf: int
    leaf_start: int
    unit_start: int
    length: int


@dataclass(frozen=True)
class Unit:
    ident: tuple  # what identifies "the same unit" in the previous checkpoint (its delta base)
    nbytes: int
    itemsize: int
    is_float: bool
    segments: tuple[Segment, ...]

    @property
    def packed(self) -> bool:
        return self.ident[0] == "pack"


def plan_units(specs: list[LeafSpec], chunk_bytes: int) -> list[Unit]:
    """The units of a part, in a deterministic order: chunks of large leaves, then each group's
    packs, then the shared packs."""
    units: list[Unit] = []
    small: dict[tuple, list[int]] = defaultdict(list)
    for i, spec in enumerate(specs):
        size = chunk_size_for(spec.itemsize, chunk_bytes)
        if spec.nbytes == 0:
            continue
        if spec.nbytes < size:
            small[spec.group].append(i)
            continue
        for j, (a, b) in enumerate(chunk_ranges(spec.nbytes, size)):
            units.append(Unit(("leaf", spec.path, spec.nbytes, size, j), b - a, spec.itemsize, spec.is_float,
                              (Segment(i, a, 0, b - a),)))
    sizes = [spec.nbytes for spec in specs]
    # (itemsize, is_float) -> the groups' packs at most half full, each with the identity it has alone
    shared: dict[tuple[int, bool], list[tuple[list[int], tuple]]] = defaultdict(list)
    for group in sorted(small, key=lambda g: min(small[g])):
        top, itemsize, is_float = group
        capacity = chunk_size_for(itemsize, chunk_bytes)
        for k, members in enumerate(_first_fit_decreasing([[i] for i in small[group]], sizes, capacity)):
            if 2 * sum(sizes[i] for i in members) <= capacity:  # first-fit leaves at most one per group
                shared[itemsize, is_float].append((members, ("pack", top, itemsize, is_float, k)))
            else:
                units.append(_pack(("pack", top, itemsize, is_float, k), members, specs))
    for (itemsize, is_float), pieces in shared.items():
        alone = {members[0]: ident for members, ident in pieces}
        capacity = chunk_size_for(itemsize, chunk_bytes)
        for k, members in enumerate(_first_fit_decreasing([m for m, _ in pieces], sizes, capacity)):
            # a piece that shares with no other keeps its own identity (and so its delta base)
            ident = alone.get(members[0]) if all(specs[i].group == specs[members[0]].group for i in members) else None
            units.append(_pack(ident or ("pack", None, itemsize, is_float, k), members, specs))
    return units


def _pack(ident: tuple, members: list[int], specs: list[LeafSpec]) -> Unit:
    """The pack of leaves ``members`` laid end to end; its identity is ``ident`` and its layout."""
    segments, offset = [], 0
    for i in members:
        segments.append(Segment(i, 0, offset, specs[i].nbytes))
        offset += specs[i].nbytes
    layout = tuple((specs[i].path, specs[i].nbytes) for i in members)
    first = specs[members[0]]
    return Unit((*ident, layout), offset, first.itemsize, first.is_float, tuple(segments))


def _first_fit_decreasing(items: list[list[int]], sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of items (lists of leaf indices, each kept whole; each bin's bytes <= capacity), placed
    largest first; a bin's leaves in state order, bins in the order of their first leaf."""
    bins: list[list[int]] = []
    free: list[int] = []
    for item in sorted(items, key=lambda item: (-sum(sizes[i] for i in item), item[0])):
        n = sum(sizes[i] for i in item)
        for b, room in enumerate(free):
            if n <= room:
                bins[b].extend(item)
                free[b] -= n
                break
        else:
            bins.append(list(item))
            free.append(capacity - n)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])
