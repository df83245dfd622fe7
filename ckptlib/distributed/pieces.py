"""Geometry of pieces of a global tensor: boxes, their overlaps, and the bytes a box needs. Pure.

A *box* is ``(offsets, shape)`` in the global tensor's index space. A rank holds one box of each
DTensor (its local shard, C order); a restore fills the box of its own shard from the saved boxes
it overlaps. The saved bytes of a box are its elements in C order, so a sub-box of a saved piece
is read as the contiguous run of elements from its first to its last element (for a dim-0 slab,
exactly its rows): ``element_span``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-ordered array of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def overlap(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover (global coordinates), or None when they do not meet."""
    offsets, shape = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return tuple(offsets), tuple(shape)


def relative(box: Box, within: Box) -> tuple[int, ...]:
    """``box``'s offsets inside the box ``within`` (which contains it)."""
    return tuple(o - w for o, w in zip(box[0], within[0]))


def element_span(shape: Sequence[int], at: Sequence[int], sub: Sequence[int]) -> tuple[int, int]:
    """(first, stop) elements of the C-ordered array ``shape`` that the sub-box at ``at`` of shape
    ``sub`` lies in: every element of the sub-box is in that run, and its ends are the sub-box's."""
    strides = c_strides(shape)
    first = sum(a * s for a, s in zip(at, strides))
    last = sum((a + n - 1) * s for a, n, s in zip(at, sub, strides))
    return first, last + 1


def is_contiguous(shape: Sequence[int], sub: Sequence[int]) -> bool:
    """Whether a sub-box of shape ``sub`` of a C-ordered array ``shape`` is one run of elements:
    size 1 in the leading dims, the whole extent in the trailing ones, anything in one between."""
    dims = len(shape)
    j = 0
    while j < dims and sub[j] == 1:
        j += 1
    return all(sub[k] == shape[k] for k in range(j + 1, dims))


def tiling_problem(global_shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why the distinct ``boxes`` do not tile the global tensor exactly (None: they do): each inside
    it, no two overlapping, and together as many elements as it has."""
    total = math.prod(global_shape)
    distinct = sorted(set(boxes))
    for off, shape in distinct:
        if len(off) != len(global_shape) or any(o < 0 or o + s > g for o, s, g in zip(off, shape, global_shape)):
            return f"a piece at {list(off)} of shape {list(shape)} lies outside {list(global_shape)}"
    covered = sum(math.prod(shape) for _, shape in distinct)
    if covered != total:
        return f"its pieces cover {covered} of its {total} elements"
    nonempty = [b for b in distinct if math.prod(b[1])]
    if global_shape and len(nonempty) <= 512:  # distinct boxes that add up to the whole overlap only if they also leave a gap
        for i, a in enumerate(nonempty):
            for b in nonempty[i + 1:]:
                if b[0][0] >= a[0][0] + a[1][0]:
                    break  # sorted by the first offset: no later box meets ``a`` in dim 0
                if overlap(a, b) is not None:
                    return f"pieces at {list(a[0])} and {list(b[0])} overlap"
    return None
