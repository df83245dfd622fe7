"""Leaf objects <-> their raw bytes: what a save reads from a tensor and a restore writes into one.

A leaf is a torch tensor, a numpy array or a bytes/bytearray object (``types.LeafSpec``). Its raw
bytes are its elements in stored order: C order, or the memory order of a dense non-contiguous
torch layout (``spec.stride``), or Fortran order (``spec.order == "F"``). torch is imported only
for torch leaves.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from .errors import CorruptCheckpoint
from .types import LeafSpec


def _torch():
    import torch  # imported only when a state holds or names torch objects

    return torch


def copy_into(obj: Any, spec: LeafSpec, out: np.ndarray, non_blocking: bool = False) -> None:
    """Copy a leaf's bytes, in the order the spec stores them, into ``out`` (uint8, spec.nbytes).
    One copy from any device or layout. ``non_blocking`` (pinned ``out`` only): the caller
    synchronises the device before using ``out``."""
    if spec.nbytes == 0:
        return
    if spec.kind == "torch":
        torch = _torch()
        src = obj.detach()
        if spec.stride is not None:  # memory order of a dense non-contiguous layout
            src = src.as_strided((spec.numel,), (1,))
        dst = torch.from_numpy(out).view(src.dtype).view(src.shape)
        dst.copy_(src, non_blocking=non_blocking and src.is_cuda)
    elif spec.kind in ("bytes", "bytearray"):
        out[:] = np.frombuffer(obj, dtype=np.uint8)
    else:
        a = np.asarray(obj)
        out[:] = (a.ravel(order="K") if spec.order == "F" else np.ascontiguousarray(a).reshape(-1)).view(np.uint8)


def raw_view(obj: Any, spec: LeafSpec) -> np.ndarray | None:
    """The leaf's bytes in stored order without a copy (a view of a CPU tensor/array's memory), or
    None when only a copy can give them (another device, a layout the spec does not store as is)."""
    if spec.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    if spec.kind == "torch":
        if obj.device.type != "cpu" or obj.is_conj() or obj.is_neg():
            return None
        t = obj.detach()
        if spec.stride is not None:
            if tuple(t.stride()) != spec.stride:
                return None
            t = t.as_strided((spec.numel,), (1,))
        elif not t.is_contiguous():
            return None
        return t.reshape(-1).view(_torch().uint8).numpy()
    if spec.kind in ("bytes", "bytearray"):
        return np.frombuffer(obj, dtype=np.uint8)
    a = obj
    if spec.order == "F":
        return a.ravel(order="F").view(np.uint8) if a.flags.f_contiguous else None
    return a.reshape(-1).view(np.uint8) if a.flags.c_contiguous else None


def empty_leaf(spec: LeafSpec) -> tuple[Any, np.ndarray]:
    """A new CPU leaf object for ``spec`` and a uint8 view of its memory, in stored order."""
    if spec.kind == "torch":
        torch = _torch()
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpoint(f"torch {torch.__version__} has no dtype {spec.dtype!r} (leaf '{spec.path}')")
        if spec.stride is not None:
            t = torch.empty_strided(spec.shape, spec.stride, dtype=dtype)
            flat = t.as_strided((spec.numel,), (1,))
        else:
            t = torch.empty(spec.shape, dtype=dtype)
            flat = t.reshape(-1)
        raw = flat.view(torch.uint8).numpy() if spec.nbytes else np.empty(0, np.uint8)
        return t, raw
    if spec.kind in ("bytes", "bytearray"):
        buf = bytearray(spec.nbytes)
        return buf, np.frombuffer(buf, dtype=np.uint8) if spec.nbytes else np.empty(0, np.uint8)
    order: Literal["C", "F"] = "F" if spec.order == "F" else "C"
    a = np.empty(spec.shape, dtype=np.dtype(spec.dtype), order=order)
    return a, a.ravel(order=order).view(np.uint8)


def finish_leaf(obj: Any, spec: LeafSpec, device: Any = "cpu") -> Any:
    """The leaf as the state held it: on ``device``, a Parameter again, bytes immutable again."""
    if spec.kind == "torch":
        if str(device) != "cpu":
            obj = obj.to(device)
        if spec.param:
            return _torch().nn.Parameter(obj, requires_grad=spec.requires_grad)
        return obj.requires_grad_(True) if spec.requires_grad else obj
    if spec.kind == "bytes":
        return bytes(obj)
    if spec.kind == "npscalar":  # format 1
        return obj[()]
    return obj
