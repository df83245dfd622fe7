"""Split a leaf's bytes into fixed-size chunks. Pure; no copies (numpy views)."""

from __future__ import annotations

import numpy as np

DEFAULT_CHUNK_BYTES = 4 << 20  # 4 MiB: large enough for zstd and S3, small enough to parallelise


def chunk_size_for(itemsize: int, chunk_bytes: int) -> int:
    """Chunk length in bytes: a multiple of the element size, so byte planes line up."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    return max(itemsize, chunk_bytes - chunk_bytes % itemsize)


def chunk_ranges(nbytes: int, size: int) -> list[tuple[int, int]]:
    """[(start, stop)] covering 0..nbytes in order; an empty leaf has no chunks."""
    return [(start, min(start + size, nbytes)) for start in range(0, nbytes, size)]


def chunk_views(raw: np.ndarray, size: int) -> list[np.ndarray]:
    return [raw[a:b] for a, b in chunk_ranges(raw.nbytes, size)]
