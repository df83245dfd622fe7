"""A group's part in memory: its group fragment and rank fragments, checked together, and where each
value's bytes are (``Group``). Pure: reading the documents is ``restoring.load_group``'s job.

The checks (what makes a group's part whole, run by the leader before it writes the group fragment
and by every reader after it read the rank fragments):

* every rank fragment is of this step, part, generation and save, and has the digest the group
  fragment names for its rank;
* a rank that shares another's skeleton has the digest that skeleton gives;
* a value another rank stores is there, at the path it is stored under, with the same dtype, local
  shape and digest;
* the pieces of each sharded tensor agree on its global spec across ranks and tile it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..manifest import Fragment, part_digest
from ..tree import leaf_indices, prune
from . import pieces as geometry
from .documents import GroupFragment, LocalLeaf, RankFragment, RankLayout, rank_digest

PLAIN_SAVE_ID = "0" * 16  # a plain fragment seen as a group of one


def stored_path(path: str) -> str:
    """The path a value of a rank's state is stored under in its rank fragment: the state's top-level
    key, then the rest of its path as one key (packs stay per top-level key, as in a plain save)."""
    parts = path.split("/", 2)
    top = parts[1] if len(parts) > 1 else ""
    rest = parts[2] if len(parts) > 2 else ""
    return f"/{top}/{rest}"


@dataclass(frozen=True)
class Where:
    """The stored bytes of a value: leaf ``index`` of rank ``rank``'s fragment."""

    rank: int
    index: int


class Group:
    """The rank fragments of one part (``fragments[r]`` is rank r's) and, unless it is a plain
    fragment seen as a group of one, its group fragment."""

    def __init__(self, fragments: list[RankFragment], group: GroupFragment | None):
        self.fragments, self.group = fragments, group
        self._paths: list[dict[str, int] | None] = [None] * len(fragments)
        self._pieces: dict[str, list[tuple[Where, geometry.Box]]] | None = None

    @classmethod
    def of_plain(cls, fragment: Fragment) -> Group:
        """A plain (single-process) fragment as a group of one: each value whole, stored by rank 0."""
        leaves = tuple(LocalLeaf(leaf.spec, leaf.digest, 0, i) for i, leaf in enumerate(fragment.leaves))
        layout = RankLayout(0, 1, PLAIN_SAVE_ID, fragment.skeleton, None, leaves, rank_digest(fragment.skeleton, leaves))
        return cls([RankFragment.of(fragment, layout)], None)

    @property
    def world(self) -> int:
        return len(self.fragments)

    @property
    def step(self) -> int:
        return self.fragments[0].step

    @property
    def part(self) -> str:
        return self.fragments[0].part

    def layout(self, rank: int) -> RankLayout:
        layout = self.fragments[rank].layout
        assert layout is not None
        return layout

    def skeleton(self, rank: int) -> Any:
        layout = self.layout(rank)
        return layout.skeleton if layout.skeleton_of is None else self.layout(layout.skeleton_of).skeleton

    def where(self, rank: int, i: int) -> Where:
        """Where rank ``rank``'s leaf ``i`` is stored."""
        leaf = self.layout(rank).leaves[i]
        if leaf.owner == rank:
            return Where(rank, leaf.index)
        index = self._stored_index(leaf.owner, leaf.spec.path)
        if index is None:
            raise ValueError(f"rank {rank}'s '{leaf.spec.path}' is stored by rank {leaf.owner}, whose fragment "
                             "does not have it")
        return Where(leaf.owner, index)

    def _stored_index(self, rank: int, path: str) -> int | None:
        paths = self._paths[rank]
        if paths is None:
            paths = self._paths[rank] = {leaf.spec.path: i for i, leaf in enumerate(self.fragments[rank].leaves)}
        return paths.get(stored_path(path))

    def boxes(self, rank: int, i: int) -> list[tuple[Where, geometry.Box]]:
        """Every saved box of rank ``rank``'s leaf ``i``: all ranks' pieces of a sharded tensor, or the
        one whole value of anything else."""
        leaf = self.layout(rank).leaves[i]
        if leaf.piece is None:
            return [(self.where(rank, i), ((0,) * len(leaf.spec.shape), leaf.spec.shape))]
        return self._piece_index()[leaf.spec.path]

    def _piece_index(self) -> dict[str, list[tuple[Where, geometry.Box]]]:
        if self._pieces is None:
            index: dict[str, dict[geometry.Box, Where]] = {}
            for r in range(self.world):
                for i, leaf in enumerate(self.layout(r).leaves):
                    if leaf.piece is not None:
                        box = (leaf.piece.offsets, leaf.piece.shape)
                        index.setdefault(leaf.spec.path, {}).setdefault(box, self.where(r, i))
            self._pieces = {path: [(w, box) for box, w in boxes.items()] for path, boxes in index.items()}
        return self._pieces

    def per_rank_values(self, select: list[str] | None = None) -> list[str]:
        """Paths of values (under ``select``) that are not the same on every rank (a per-rank counter
        or RNG state), and '/' when the ranks' non-tensor values differ: what a rank the checkpoint
        has no counterpart for cannot take from another rank."""
        def wanted(r: int) -> tuple[Any, set[int]]:
            skeleton = self.skeleton(r) if select is None else prune(self.skeleton(r), list(select))
            return skeleton, leaf_indices(skeleton)

        out = []
        skeletons = [wanted(r) for r in range(self.world)]
        if len({rank_digest(sk, ()) for sk, _ in skeletons}) > 1:
            out.append("/ (the ranks' non-tensor values)")
        first = {leaf.spec.path: leaf for leaf in self.layout(0).leaves}
        for r in range(1, self.world):
            for i, leaf in enumerate(self.layout(r).leaves):
                mine = first.get(leaf.spec.path)
                if i in skeletons[r][1] and leaf.piece is None and (
                        mine is None or mine.digest != leaf.digest or mine.spec != leaf.spec):
                    out.append(leaf.spec.path)
        return sorted(set(out))

    def problems(self) -> list[str]:
        """Everything that makes this group's part not whole (see the module docstring); [] when it is."""
        out: list[str] = []
        g = self.group
        for r, frag in enumerate(self.fragments):
            layout = self.layout(r)
            ident = (frag.step, frag.part, frag.generation, layout.rank, layout.world)
            if ident != (self.step, self.part, self.fragments[0].generation, r, self.world):
                out.append(f"rank {r}'s fragment describes step {frag.step}, part '{frag.part}', generation "
                           f"{frag.generation}, rank {layout.rank} of {layout.world}")
                continue
            if g is not None and (layout.save_id != g.save_id or layout.digest != g.ranks[r].digest):
                out.append(f"rank {r}'s fragment is not the one the group fragment names (save or digest)")
            if layout.skeleton_of is not None and rank_digest(self.skeleton(r), layout.leaves) != layout.digest:
                out.append(f"rank {r}'s digest does not match the skeleton it shares with rank {layout.skeleton_of}")
            out += self._stored_problems(r, layout)
        if not out:
            out += self._tiling_problems()
        return out

    def _stored_problems(self, r: int, layout: RankLayout) -> list[str]:
        out = []
        for i, leaf in enumerate(layout.leaves):
            if leaf.owner == r:
                continue
            try:
                w = self.where(r, i)
            except ValueError as e:
                out.append(str(e))
                continue
            stored = self.fragments[w.rank].leaves[w.index]
            if (stored.spec.kind, stored.spec.dtype, stored.spec.shape, stored.digest) != (
                    leaf.spec.kind, leaf.spec.dtype, leaf.local_shape, leaf.digest):
                out.append(f"rank {r}'s '{leaf.spec.path}' differs from what rank {w.rank} stored for it")
        return out

    def _tiling_problems(self) -> list[str]:
        specs: dict[str, LocalLeaf] = {}
        out = []
        for r in range(self.world):
            for leaf in self.layout(r).leaves:
                if leaf.piece is None:
                    continue
                seen = specs.setdefault(leaf.spec.path, leaf)
                if seen.spec.logical_json() != leaf.spec.logical_json():
                    out.append(f"'{leaf.spec.path}' is {seen.spec.dtype} {list(seen.spec.shape)} on one rank and "
                               f"{leaf.spec.dtype} {list(leaf.spec.shape)} on rank {r}")
        for path, leaf in specs.items():
            why = geometry.tiling_problem(leaf.spec.shape, [box for _, box in self._piece_index()[path]])
            if why:
                out.append(f"'{path}' {list(leaf.spec.shape)}: {why} (were all of its ranks in the group?)")
        return out


def local_view(group: Group, rank: int) -> Fragment:
    """Saved rank ``rank``'s state as a plain fragment (in memory): its skeleton, and each leaf with
    its local shape and the chunks of whichever rank stored it. What reads a part leaf by leaf
    (validation) reads of a group's part: each rank's state as it held it, its shards as plain tensors.
    Its ``meta[GLOBAL_SHAPES]``: {leaf path: global shape} of the leaves that are shards (their own
    shape is the local one), so that shapes are compared as the tensors' (``global_shape``)."""
    layout = group.layout(rank)
    global_shapes: dict[str, list[int]] = {}
    skeleton = group.skeleton(rank)
    leaves = []
    blobs: dict[str, Any] = {}
    for i, leaf in enumerate(layout.leaves):
        w = group.where(rank, i)
        frag = group.fragments[w.rank]
        stored = frag.leaves[w.index]
        shape = leaf.local_shape
        if tuple(shape) != tuple(leaf.spec.shape):
            global_shapes[leaf.spec.path] = list(leaf.spec.shape)
        spec = replace(leaf.spec, shape=shape, nbytes=stored.spec.nbytes)
        leaves.append(replace(stored, spec=spec))
        for digest, *_ in stored.segments():
            d: str | None = digest
            while d is not None and d not in blobs:
                blobs[d] = frag.blobs[d]
                d = blobs[d].base
    first = group.fragments[0]
    g = group.group
    return Fragment(first.step, first.part, first.generation, g.config_hash if g else first.config_hash, skeleton,
                    tuple(leaves), blobs, part_digest(skeleton, leaves), sum(leaf.spec.nbytes for leaf in leaves),
                    group.fragments[rank].bytes_written, dict(group.fragments[rank].stats),
                    {**(g.meta if g else first.meta), **({GLOBAL_SHAPES: global_shapes} if global_shapes else {})},
                    chunk_bytes=first.chunk_bytes)


GLOBAL_SHAPES = "global_shapes"  # a rank's view: the global shapes of its shards (``local_view``)


def global_shape(frag: Fragment, leaf_path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape of the leaf at ``leaf_path`` of ``frag`` whose own shape is ``shape``: the
    same, but in a rank's view of a group's part where the leaf is a shard (``local_view``)."""
    known = (frag.meta or {}).get(GLOBAL_SHAPES) or {}
    return tuple(known[leaf_path]) if leaf_path in known else tuple(shape)
