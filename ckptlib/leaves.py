"""Leaf objects <-> their raw bytes: what a save reads from a tensor and a restore writes into one.

A leaf is a torch tensor, a numpy array or a bytes/bytearray object (``types.LeafSpec``), or a
storage (a 1-D tensor of the bytes that tensors sharing memory view: ``view_of`` rebuilds them).
Its raw bytes are its elements in stored order: C order, or the memory order of a dense
non-contiguous torch layout (``spec.stride``), or Fortran order (``spec.order == "F"``). torch is
imported only for torch leaves.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from .errors import CorruptCheckpoint
from .types import TORCH_KINDS, LeafSpec, View


def _torch():
    import torch  # imported only when a state holds or names torch objects

    return torch


def copy_into(obj: Any, spec: LeafSpec, out: np.ndarray, non_blocking: bool = False) -> None:
    """Copy a leaf's bytes, in the order the spec stores them, into ``out`` (uint8, spec.nbytes).
    One copy from any device or layout. ``non_blocking`` (pinned ``out`` only): the caller
    synchronises the device before using ``out``."""
    if spec.nbytes == 0:
        return
    if spec.kind in TORCH_KINDS:
        torch = _torch()
        src = obj.detach() if obj.requires_grad else obj
        if spec.stride is not None:  # memory order of a dense non-contiguous layout
            src = src.as_strided((spec.numel,), (1,))
        elif src.is_contiguous():  # one dimension on both sides: view(shape) costs more than a small copy
            src = src.view(-1)
        dst = torch.from_numpy(out).view(src.dtype)
        if src.dim() != 1:
            dst = dst.view(src.shape)
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
    if spec.kind in TORCH_KINDS:
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
    if spec.kind in TORCH_KINDS:
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
    if spec.kind in TORCH_KINDS:
        if str(device) != "cpu":
            obj = obj.to(device)
        if spec.kind == "storage":
            return obj
        if spec.param:
            return _torch().nn.Parameter(obj, requires_grad=spec.requires_grad)
        return obj.requires_grad_(True) if spec.requires_grad else obj
    if spec.kind == "bytes":
        return bytes(obj)
    if spec.kind == "npscalar":  # format 1
        return obj[()]
    return obj


# --- tensors that view a storage -------------------------------------------------------------------

def span_of(t: Any, start: int, count: int, dtype: Any) -> Any:
    """A contiguous 1-D tensor of ``count`` elements of ``dtype`` over ``t``'s memory from element
    ``start`` (in ``dtype``'s elements) of its storage: a view, no copy."""
    return _torch().empty(0, dtype=dtype, device=t.device).set_(t.untyped_storage(), start, (count,), (1,))


def without_flags(t: Any) -> Any:
    """``t`` without its lazy conjugate/negative bits: a view of the same memory whose values are
    the memory as it is (what a storage holds)."""
    if t.is_conj():
        t = t.conj()
    if t.is_neg():
        t = _torch()._neg_view(t)
    return t


def view_of(storage: Any, view: View) -> Any:
    """The tensor ``view`` describes, viewing the memory of the storage leaf ``storage`` (a 1-D
    tensor): the same storage, offset, shape, strides, dtype and bits, no copy. ValueError when it
    does not fit in the storage (the decoder checks that first, against the spec)."""
    torch = _torch()
    base = storage.storage_offset() * storage.element_size()
    if base % view.itemsize or base + view.end > storage.untyped_storage().nbytes():
        raise ValueError(f"the view ends at byte {view.end} of a {storage.untyped_storage().nbytes() - base}-byte storage")
    t = torch.empty(0, dtype=getattr(torch, view.dtype), device=storage.device)
    t.set_(storage.untyped_storage(), base // view.itemsize + view.offset, view.shape, view.stride)
    if view.conj:
        t = t.conj()
    if view.neg:
        t = torch._neg_view(t)
    if view.param:
        return torch.nn.Parameter(t, requires_grad=view.requires_grad)
    return t.requires_grad_(True) if view.requires_grad else t
