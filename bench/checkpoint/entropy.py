"""The order-0 entropy bound of a dense state (``entropy_bound``), printed beside ckptlib's ratio."""

from __future__ import annotations

from typing import Any

import torch

from .series import Series
from .trees import raw_bytes, tensors


def entropy_bound(series: Series) -> float | None:
    """How many times smaller than the state the last save could be with an ideal order-0 coder
    of its byte planes (per plane, no model across bytes): of the state itself (a keyframe) and of
    its element-wise integer difference from the save before (a dense delta), whichever is smaller.
    The bound for any coder that, like zstd's entropy stage, codes bytes independently."""
    if len(series.states) < 2:
        return None
    from ckptlib import codecs

    def plane_bits(raw: Any, itemsize: int) -> float:
        planes = raw.reshape(-1, itemsize).T if itemsize > 1 else raw.reshape(1, -1)
        bits = 0.0
        for plane in planes:
            counts = torch.bincount(torch.from_numpy(plane.copy()), minlength=256).double()
            p = counts[counts > 0] / plane.size
            bits += float(-(p * p.log2()).sum()) * plane.size
        return bits

    total = key_bits = delta_bits = 0.0
    for t, o in zip(tensors(series.states[-1]), tensors(series.states[-2])):
        raw, base = raw_bytes(t).numpy(), raw_bytes(o).numpy()
        k = t.element_size()
        total += raw.size
        key_bits += plane_bits(raw, k)
        if k in (1, 2, 4, 8) and base.size == raw.size:
            delta_bits += plane_bits(codecs.ArithDelta(k, t.is_floating_point()).encode(raw, base), k)
        else:
            delta_bits += plane_bits(raw, k)
    best = min(key_bits, delta_bits) / 8
    return total / best if best else None
