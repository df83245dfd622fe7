"""State trees as the benchmark walks them: dicts, lists and tuples holding tensors and other values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def map_tensors(state: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] = lambda x: x) -> Any:
    """A copy of ``state``'s containers with ``fn`` applied to tensors and ``other`` to other leaves."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, dict):
        return {k: map_tensors(v, fn, other) for k, v in state.items()}
    if isinstance(state, list):
        return [map_tensors(v, fn, other) for v in state]
    if isinstance(state, tuple):
        return tuple(map_tensors(v, fn, other) for v in state)
    return other(state)


def tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor of ``state``, in walk order."""
    found: list[torch.Tensor] = []
    map_tensors(state, found.append)
    return found


def copy_tensors(dest: Any, src: Any) -> None:
    """Copy every tensor of ``src`` into the tensor at the same place in ``dest``."""
    if isinstance(dest, torch.Tensor):
        dest.copy_(src)
    elif isinstance(dest, dict):
        for k in dest:
            copy_tensors(dest[k], src[k])
    elif isinstance(dest, (list, tuple)):
        for d, v in zip(dest, src):
            copy_tensors(d, v)


def refill(buffers: Any, values: Any) -> Any:
    """``buffers``' tensors with ``values``' non-tensor leaves (same structure)."""
    if isinstance(buffers, torch.Tensor):
        return buffers
    if isinstance(buffers, dict):
        return {k: refill(buffers[k], values[k]) for k in buffers}
    if isinstance(buffers, (list, tuple)):
        return type(buffers)(refill(b, v) for b, v in zip(buffers, values))
    return values


def cpu_empty(t: torch.Tensor) -> torch.Tensor:
    """Uninitialised CPU memory of ``t``'s shape and dtype."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in C order, as a flat uint8 tensor on the CPU."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
