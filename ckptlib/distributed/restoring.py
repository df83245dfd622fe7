"""Reading a group's part: onto any layout, reading only the bytes a rank needs (docs/distributed.md).

A rank restores the state one saved rank (its *source*: itself, or rank 0 when the checkpoint has
fewer ranks) had: that rank's skeleton and non-tensor values, its plain tensors, and every tensor
that was sharded filled from all the saved pieces of it. Each destination is a box of the global
tensor (a DTensor's local shard, or a whole tensor); for each saved piece it overlaps:

* the same box (a resume on the same layout): the stored leaf is decoded straight into the
  destination's memory and checked against its digest (``restore.decode_leaves``);
* another box (resharding): only the bytes of the overlap's span are read (``restore.decode_ranges``:
  the chunks covering them), into the destination's memory when the overlap is one run in both
  (dim-0 shards), else into a buffer copied into place.

Names, global shapes and dtypes are checked against the destination first (``bind.bind_into``),
every mismatch listed in one ValueError, before anything is read.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..bases import Base, base_of
from ..commit import load_any_part
from ..errors import CheckpointError, CorruptCheckpoint
from ..leaves import empty_leaf
from ..manifest import Fragment, Manifest
from ..restore import Binding, ByteRange, Problem, assemble, bind_selection, decode_leaves, decode_ranges, inspect_part
from ..store import Store
from ..tree import MISSING, unflatten
from ..types import LeafSpec
from . import pieces as geometry
from .documents import AnyFragment, GroupFragment, RankFragment
from .group import Group, local_view
from .local import ShardInfo, region
from .saving import read_rank_fragments

__all__ = ["RankState", "check_restore", "load_group", "part_views", "rank_base", "read_rank_state", "restore_group", "source_rank", "verify_group"]


@dataclass(frozen=True)
class RankState:
    """One rank's state as plain values: ``state`` with every DTensor as its local tensor, and
    ``shards``: {leaf path: where that local tensor sits in its global tensor}. What
    ``Checkpointer.read_rank`` returns and ``Checkpointer.write_group`` takes."""

    state: Any
    shards: dict[str, ShardInfo]


def load_group(store: Store, pool: Executor, frag: AnyFragment) -> Group:
    """A part as a group: a group fragment's rank fragments read (checked against their checksums)
    and checked together; a plain fragment as a group of one."""
    if not isinstance(frag, GroupFragment):
        return Group.of_plain(frag)
    frags = read_rank_fragments(store, pool, [(r.key, r.checksum) for r in frag.ranks])
    group = Group(frags, frag)
    problems = group.problems()
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptCheckpoint(f"step {frag.step}, part '{frag.part}' ({frag.world} ranks) is not whole: "
                                f"{problems[0]}{more}")
    return group


def source_rank(group: Group, rank: int, world: int, chosen: int | None, select: list[str] | None) -> int:
    """The saved rank whose state rank ``rank`` of ``world`` restores: ``chosen``, else its own, else
    (a rank the checkpoint has no counterpart for) rank 0 when no value of the selection differs
    per rank; refused otherwise, naming them."""
    if chosen is not None:
        if not 0 <= chosen < group.world:
            raise ValueError(f"rank={chosen}: step {group.step} was saved by ranks 0..{group.world - 1}")
        return chosen
    if rank < group.world:
        return rank
    differ = group.per_rank_values(select)
    if differ:
        raise CheckpointError(
            f"step {group.step} was saved by {group.world} ranks whose values differ at {differ[:5]}; this is rank "
            f"{rank} of {world}, which the checkpoint has no counterpart for: pass rank=<a saved rank> to take that "
            "rank's values, or select= keys without per-rank values")
    return 0


def check_restore(group: Group, rank: int, into: Any, select: list[str] | None) -> None:
    """Raise what restoring saved rank ``rank``'s state into ``into`` would raise before reading anything
    (KeyError for a selection the state lacks, ValueError listing every mismatch)."""
    _bind(group, rank, into, select)


def _bind(group: Group, rank: int, into: Any, select: list[str] | None) -> Binding:
    return bind_selection(group.skeleton(rank), [leaf.spec for leaf in group.layout(rank).leaves], group.step,
                          group.part, into=into, select=select, detail=f", saved by {group.world} ranks")


@dataclass
class _Copy:
    """The overlap of a saved piece with a destination, decoded into ``buf`` (the span of the piece
    from the overlap's first to last element), to copy into its place."""

    buf: np.ndarray
    piece_shape: tuple[int, ...]
    shape: tuple[int, ...]
    dest: Any
    at_dest: tuple[int, ...]

    def apply(self) -> None:
        import torch

        src = torch.from_numpy(self.buf).view(self.dest.dtype)
        src = src.as_strided(self.shape, geometry.c_strides(self.piece_shape))
        with torch.no_grad():
            self.dest[tuple(slice(a, a + n) for a, n in zip(self.at_dest, self.shape))].copy_(src)


def _host_bytes(t: Any) -> np.ndarray | None:
    """A CPU contiguous tensor's bytes (a view), else None."""
    import torch

    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()


class _Reads:
    """What a restore reads from each rank's fragment: whole stored leaves, and byte ranges."""

    def __init__(self) -> None:
        self.whole: dict[int, dict[int, Any]] = defaultdict(dict)  # rank -> {stored leaf: destination or None}
        self.leaf_of: dict[tuple[int, int], int] = {}  # (rank, stored leaf) -> the leaf it fills
        self.ranges: dict[int, list[ByteRange]] = defaultdict(list)
        self.copies: list[_Copy] = []

    def add_pieces(self, spec: LeafSpec, boxes: list, target: geometry.Box, dest: Any) -> None:
        """Read the overlaps of ``boxes`` with ``target``, whose memory is the tensor ``dest``."""
        size = spec.itemsize
        raw = _host_bytes(dest)
        covered = 0
        for where, box in boxes:
            ov = geometry.overlap(box, target)
            if ov is None:
                continue
            first, stop = geometry.element_span(box[1], geometry.relative(ov, box), ov[1])
            at_dest = geometry.relative(ov, target)
            if raw is not None and geometry.is_contiguous(box[1], ov[1]) and geometry.is_contiguous(target[1], ov[1]):
                lo, hi = geometry.element_span(target[1], at_dest, ov[1])
                out = raw[lo * size:hi * size]
            else:
                out = np.empty((stop - first) * size, dtype=np.uint8)
                self.copies.append(_Copy(out, box[1], ov[1], dest, at_dest))
            self.ranges[where.rank].append(ByteRange(where.index, first * size, stop * size, out))
            covered += math.prod(ov[1])
        if covered != math.prod(target[1]):
            raise CorruptCheckpoint(f"the saved pieces of '{spec.path}' cover {covered} of the {math.prod(target[1])} "
                                    f"elements at {list(target[0])} of shape {list(target[1])}")


def _fill(group: Group, store: Store, pool: Executor, rank: int, wanted: list[int], dests: dict[int, Any],
          keep: bool, known: Mapping[str, np.ndarray] | None = None) -> tuple[dict[int, Any], dict[str, np.ndarray] | None]:
    """Fill the destinations of saved rank ``rank``'s leaves ``wanted`` (new objects where none is
    given); (objects by leaf, the raw chunks of ``rank``'s own fragment decoded, with ``keep``).
    ``known``: raw chunks by raw checksum (of any rank's fragment) read instead of their objects."""
    layout = group.layout(rank)
    reads = _Reads()
    objects: dict[int, Any] = {}
    for i in wanted:
        spec = layout.leaves[i].spec
        dest = dests.get(i)
        offsets, shape, local = region(dest, spec) if dest is not None else ((0,) * len(spec.shape), spec.shape, None)
        boxes = group.boxes(rank, i)
        exact = next((w for w, box in boxes if box == (offsets, shape)), None)
        if dest is not None:
            objects[i] = dest
        if exact is not None:
            reads.whole[exact.rank][exact.index] = local
            reads.leaf_of[(exact.rank, exact.index)] = i
            continue
        if local is None:
            local, _ = empty_leaf(spec)
            objects[i] = local
        reads.add_pieces(spec, boxes, (offsets, shape), local)
    problems: list[Problem] = []
    kept = None
    for owner in sorted(set(reads.whole) | set(reads.ranges)):
        frag = group.fragments[owner]
        if reads.whole.get(owner):
            todo = reads.whole[owner]
            got, found, k = decode_leaves(frag, store, pool, sorted(todo),
                                          dests={j: d for j, d in todo.items() if d is not None},
                                          known=known, keep=keep and owner == rank)
            problems += found
            kept = k if k is not None else kept
            for j, obj in got.items():
                objects.setdefault(reads.leaf_of[(owner, j)], obj)
        if reads.ranges.get(owner):
            problems += decode_ranges(frag, store, pool, reads.ranges[owner], known=known)
    if problems:
        more = f" (and {len(problems) - 1} more problems; run `ckpt verify` for all)" if len(problems) > 1 else ""
        raise CorruptCheckpoint(f"{problems[0]}{more}")
    for c in reads.copies:
        c.apply()
    return objects, kept


def restore_group(group: Group, store: Store, pool: Executor, *, rank: int, into: Any = None,
                  select: list[str] | None = None, device: Any = "cpu", keep: bool = False,
                  known: Mapping[str, np.ndarray] | None = None) -> tuple[Any, dict[str, np.ndarray] | None]:
    """(saved rank ``rank``'s state, filled into ``into`` where it holds tensors; with ``keep`` the raw
    chunks decoded from that rank's own fragment). Sharded tensors the destination lacks come back
    whole (full tensors). ``known``: raw chunks already held, by raw checksum (checked as any)."""
    b = _bind(group, rank, into, select)
    objects, kept = _fill(group, store, pool, rank, b.wanted, b.dests, keep, known)
    return assemble(b, objects, device), kept


def read_rank_state(group: Group, store: Store, pool: Executor, rank: int,
                    select: list[str] | None = None) -> RankState:
    """Saved rank ``rank``'s state as plain values: its DTensors as the local tensors it held (with
    where they sit), everything else as it saved it."""
    b = _bind(group, rank, None, select)
    layout = group.layout(rank)
    local_specs = [replace(leaf.spec, shape=leaf.local_shape, nbytes=math.prod(leaf.local_shape) * leaf.spec.itemsize)
                   for leaf in layout.leaves]
    by_owner: dict[int, dict[int, int]] = defaultdict(dict)  # owner -> {stored leaf: the leaf it is}
    for i in b.wanted:
        w = group.where(rank, i)
        by_owner[w.rank][w.index] = i
    objects: dict[int, Any] = {}
    for owner, todo in sorted(by_owner.items()):
        got, problems, _ = decode_leaves(group.fragments[owner], store, pool, sorted(todo))
        if problems:
            raise CorruptCheckpoint(str(problems[0]))
        objects.update((todo[j], obj) for j, obj in got.items())
    chosen = set(b.wanted)
    shards = {leaf.spec.path: ShardInfo(leaf.spec.shape, leaf.piece.offsets, leaf.piece.placements, leaf.piece.mesh)
              for i, leaf in enumerate(layout.leaves) if leaf.piece is not None and i in chosen}
    return RankState(assemble(Binding(b.skeleton, local_specs, b.wanted, {}, []), objects), shards)


def verify_group(group: GroupFragment, store: Store, pool: Executor) -> list[Problem]:
    """Decode every rank fragment of ``group`` and check it whole, and the rank fragments together."""
    try:
        loaded = load_group(store, pool, group)
    except CorruptCheckpoint as e:
        return [Problem(group.step, group.part, "/", None, None, str(e))]
    problems = [p for frag in loaded.fragments for p in inspect_part(frag, store, pool)[1]]
    for r in range(loaded.world):  # each rank's own skeleton, as a restore builds it
        specs = [leaf.spec for leaf in loaded.layout(r).leaves]
        try:
            unflatten(loaded.skeleton(r), [MISSING] * len(specs), specs)
        except CorruptCheckpoint as e:
            problems.append(Problem(group.step, group.part, "/", None, None, f"rank {r}: {e}"))
    return problems


def rank_base(frag: AnyFragment, store: Store, pool: Executor, rank: int, chunk_bytes: int | None,
              raw: Mapping[str, np.ndarray] | None = None) -> Base | None:
    """The delta base of rank ``rank``'s next save of a part whose last committed fragment is
    ``frag``: that rank's fragment in it (its blob table: unchanged chunks are referenced, not
    written again), if it has one."""
    if isinstance(frag, GroupFragment):
        if rank >= frag.world:
            return None
        ref = frag.ranks[rank]
        mine: Fragment = read_rank_fragments(store, pool, [(ref.key, ref.checksum)])[0]
    elif isinstance(frag, RankFragment) or rank == 0:
        mine = frag
    else:
        return None
    return base_of(mine, chunk_bytes, dict(raw or {}))


def part_views(store: Store, pool: Executor, manifest: Manifest, name: str) -> dict[str, Fragment]:
    """Part ``name`` of a committed manifest as plain fragments: the part's own, or, for a group's
    part, each rank's state as it held it (``<name>/r<rank>``, ``group.local_view``)."""
    frag = load_any_part(store, manifest, name)
    if not isinstance(frag, GroupFragment):
        return {name: frag}
    group = load_group(store, pool, frag)
    return {f"{name}/r{r}": local_view(group, r) for r in range(group.world)}
