"""A rank's state as local leaves: every DTensor becomes its local shard and the piece of the global
tensor it is (``LocalState``); and where a DTensor (or plain tensor) of a destination state sits in
its global tensor (``region``).

Only ``Shard`` and ``Replicate`` placements are stored (FSDP2's ``_StridedShard`` included: its local
shard is one box of the global tensor, as ``compute_local_shape_and_global_offset`` says); a
``Partial`` DTensor holds a summand, not a value, and is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .. import codecs
from ..errors import UnsupportedState
from ..leaves import copy_into, raw_view
from ..tree import flatten
from ..types import LeafSpec
from .documents import Piece

__all__ = ["LocalState", "ShardInfo", "local_state", "plain_state", "region"]


@dataclass(frozen=True)
class ShardInfo:
    """Where a local tensor sits in its global tensor: the global shape and its offsets there (its own
    shape is the local tensor's); ``placements`` and ``mesh`` are recorded as given (informational)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    placements: tuple[str, ...] = ()
    mesh: tuple[int, ...] = ()


@dataclass
class LocalState:
    """A flattened rank state. ``leaves[i]`` = (spec of the stored local value, the value);
    ``logical[i]``: the leaf as the state holds it (a DTensor's: the global tensor's spec);
    ``pieces[i]``: the box a sharded leaf is (absent: the whole value); ``replicated``: leaves
    whose every copy on other ranks is the same (a ``Replicate`` placement)."""

    skeleton: Any
    leaves: list[tuple[LeafSpec, Any]]
    logical: list[LeafSpec]
    pieces: dict[int, Piece] = field(default_factory=dict)
    replicated: set[int] = field(default_factory=set)

    @property
    def local_bytes(self) -> int:
        return sum(spec.nbytes for spec, _ in self.leaves)

    def digest(self, i: int) -> str:
        """XXH3-128 of leaf ``i``'s bytes (what a fragment's leaf digest is); copies only if it must."""
        spec, obj = self.leaves[i]
        view = raw_view(obj, spec)
        if view is None:
            view = np.empty(spec.nbytes, dtype=np.uint8)
            copy_into(obj, spec, view)
        return codecs.checksum(view)


def _torch() -> Any:
    import torch

    return torch


def _placement_name(p: Any) -> str:
    return repr(p)[:64]


def _dtensor_piece(dt: Any, path: str) -> tuple[Piece, bool]:
    """The box ``dt``'s local shard is in its global tensor, and whether it is replicated on some
    mesh dimension."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in dt.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise UnsupportedState(
                f"cannot checkpoint the DTensor at '{path or '/'}': its placement {p!r} holds a partial value; "
                "redistribute it to Shard or Replicate placements first (dt.redistribute(mesh, [Replicate()]))")
    shape, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    piece = Piece(tuple(int(o) for o in offsets), tuple(int(s) for s in shape),
                  tuple(_placement_name(p) for p in dt.placements), tuple(int(n) for n in dt.device_mesh.shape))
    return piece, any(isinstance(p, Replicate) for p in dt.placements)


def local_state(state: Any) -> LocalState:
    """Flatten a rank's state (as ``get_state_dict`` gives it): each DTensor is stored as its local
    shard, C-contiguous, and recorded with the box it is of the global tensor."""
    torch = _torch()
    found: dict[int, tuple[Any, Piece, bool, Any]] = {}

    def hook(obj: Any, path: str) -> Any:
        from torch.distributed.tensor import DTensor

        if not isinstance(obj, DTensor):
            return None
        piece, replicated = _dtensor_piece(obj, path)
        with torch.no_grad():
            local = obj.to_local().detach()
        if tuple(local.shape) != piece.shape:
            raise UnsupportedState(f"the DTensor at '{path or '/'}' has a local shard of shape {list(local.shape)}, "
                                   f"not the {list(piece.shape)} its placements give: store it padded? (unsupported)")
        if not local.is_contiguous():
            local = local.contiguous()
        found[id(local)] = (obj, piece, replicated, local)  # the tuple keeps ``local`` alive while flattening
        return local

    skeleton, leaves = flatten(state, subclass=hook)
    logical: list[LeafSpec] = []
    pieces: dict[int, Piece] = {}
    replicated: set[int] = set()
    for i, (spec, obj) in enumerate(leaves):
        entry = found.get(id(obj))
        if entry is None:
            logical.append(spec)
            continue
        dt, piece, rep, _ = entry
        shape = tuple(int(n) for n in dt.shape)
        logical.append(replace(spec, shape=shape, nbytes=math.prod(shape) * spec.itemsize, stride=None,
                               param=isinstance(dt, torch.nn.Parameter),
                               requires_grad=bool(dt.requires_grad) and dt.is_leaf))
        pieces[i] = piece
        if rep:
            replicated.add(i)
    return LocalState(skeleton, leaves, logical, pieces, replicated)


def plain_state(state: Any, shards: dict[str, ShardInfo]) -> LocalState:
    """Flatten a rank's state given as plain values: ``shards`` names, by leaf path, the tensors that
    are local shards of a global tensor (what ``Checkpointer.read_rank`` returns, for a process that
    writes a group's part without a process group)."""
    skeleton, leaves = flatten(state)
    logical: list[LeafSpec] = []
    pieces: dict[int, Piece] = {}
    paths = [spec.path for spec, _ in leaves]
    unknown = sorted(set(shards) - set(paths))
    if unknown:
        raise ValueError(f"shards name paths the state has no tensor at: {unknown[:5]}")
    for i, (spec, _) in enumerate(leaves):
        info = shards.get(spec.path)
        if info is None:
            logical.append(spec)
            continue
        if spec.kind != "torch" or spec.stride is not None or len(info.global_shape) != len(spec.shape) \
                or len(info.offsets) != len(spec.shape):
            raise ValueError(f"'{spec.path}': a shard must be a C-contiguous torch tensor of the global tensor's rank")
        logical.append(replace(spec, shape=tuple(info.global_shape),
                               nbytes=math.prod(info.global_shape) * spec.itemsize))
        pieces[i] = Piece(tuple(info.offsets), tuple(spec.shape), tuple(info.placements), tuple(info.mesh))
    if len(set(paths)) != len(paths):
        raise ValueError("two leaves of the state have the same path: give them distinct keys")
    return LocalState(skeleton, leaves, logical, pieces)


def region(dest: Any, spec: LeafSpec) -> tuple[tuple[int, ...], tuple[int, ...], Any]:
    """(offsets, shape, local object) of the part of the global value ``spec`` that ``dest`` holds: a
    DTensor's local shard, or the whole value for anything else."""
    torch = _torch() if spec.kind == "torch" else None
    if torch is not None and isinstance(dest, torch.Tensor) and type(dest) is not torch.Tensor \
            and type(dest) is not torch.nn.Parameter:
        from torch.distributed.tensor import DTensor

        if isinstance(dest, DTensor):
            piece, _ = _dtensor_piece(dest, spec.path)
            with torch.no_grad():
                return piece.offsets, piece.shape, dest.to_local()  # its memory: filled in place
    return (0,) * len(spec.shape), tuple(spec.shape), dest
