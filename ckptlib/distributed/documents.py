"""The documents of a group's part (docs/format.md, "Group fragments"): rank fragments and the group fragment.

A part saved by a group of R ranks (a torch.distributed job, or a shard of R ranks) is stored as:

* one **rank fragment** per rank, ``fragments/<step>/<part>.g<gen>.r<rank>.<save id>.json``: an
  ordinary fragment (format 2: skeleton, leaves, blob table, digest) of the values this rank
  *stores* (its DTensors' local shards, its own values, and the replicated values it was given to
  write for the group), plus a ``rank`` member, the ``RankLayout``: this rank's whole state as it
  saw it (its skeleton, and per leaf the logical spec, the DTensor piece it held, the digest of its
  bytes and which rank's fragment stores them);
* one **group fragment** (format 3, ``"kind": "group"``), embedded in the manifest of a
  ``Checkpointer.save`` or at ``fragments/<step>/<part>.g<gen>.json`` for a multi-part cut: the rank
  fragments by key and checksum, the union of their blob tables (what GC and sizes need, without
  reading the rank fragments) and a digest over the ranks' logical digests.

A save id (16 hex digits, one per collective save) makes rank fragment keys unique per attempt: the
rank fragments of a group that died mid-save never block the next save of the same step.

Nothing here imports torch; every document is checked as it is parsed (``CorruptCheckpoint`` on
anything malformed, through ``docfields.parse_document``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..docfields import CHECKSUM, MAX_FRAGMENT_BYTES, checksum_field, int_field, meta_field, parse_document
from ..errors import FormatVersionError
from ..fragment import Blob, Fragment, fragment_key
from ..types import MAX_NDIM, LeafSpec

GROUP_FORMAT = 3
MAX_WORLD = 1 << 16  # ranks a group fragment may name (a forged world costs no more than this)
_SAVE_ID = re.compile(r"^[0-9a-f]{16}$")
_PART = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
RANK_KEY = re.compile(rf"^fragments/(\d+)/({_PART})\.g(\d+)\.r(\d+)\.([0-9a-f]{{16}})\.json$")

__all__ = ["GROUP_FORMAT", "AnyFragment", "GroupFragment", "LocalLeaf", "Piece", "RankFragment", "RankLayout",
           "RankRef", "group_digest", "loads_any_fragment", "loads_rank_fragment", "parse_any_fragment",
           "rank_digest", "rank_fragment_key"]


def rank_fragment_key(step: int, part: str, generation: int, rank: int, save_id: str) -> str:
    return f"fragments/{step}/{part}.g{generation}.r{rank}.{save_id}.json"


def _ints(v: Any, what: str, n: int) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) != n:
        raise ValueError(f"{what} {str(v)[:60]} is not a list of {n} ints")
    return tuple(int_field(x, what) for x in v)


@dataclass(frozen=True)
class Piece:
    """The part of a global tensor one rank held: the box at ``offsets`` of ``shape`` (C order, its
    bytes contiguous), and, for the record, the DTensor placements and mesh shape it came from."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    placements: tuple[str, ...] = ()
    mesh: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_json(self) -> dict[str, Any]:
        return {"offsets": list(self.offsets), "shape": list(self.shape), "placements": list(self.placements),
                "mesh": list(self.mesh)}

    @classmethod
    def from_json(cls, d: dict[str, Any], global_shape: tuple[int, ...]) -> Piece:
        n = len(global_shape)
        piece = cls(_ints(d["offsets"], "piece offsets", n), _ints(d["shape"], "piece shape", n),
                    tuple(str(p)[:64] for p in d.get("placements", [])[:MAX_NDIM]),
                    tuple(int_field(x, "mesh size", 1, MAX_WORLD) for x in d.get("mesh", [])[:MAX_NDIM]))
        if any(o + s > g for o, s, g in zip(piece.offsets, piece.shape, global_shape)):
            raise ValueError(f"piece at {list(piece.offsets)} of shape {list(piece.shape)} lies outside the global "
                             f"shape {list(global_shape)}")
        return piece


@dataclass(frozen=True)
class LocalLeaf:
    """One leaf of a rank's state: its logical spec (a DTensor's: the global tensor's), the piece of it
    the rank held (None: the whole value), the digest of the bytes the rank held, and where they are
    stored: leaf ``index`` of rank ``owner``'s fragment (another rank's for a replicated value)."""

    spec: LeafSpec
    digest: str
    owner: int
    index: int
    piece: Piece | None = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.piece.shape if self.piece is not None else self.spec.shape

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {**self.spec.to_json(), "digest": self.digest, "owner": self.owner, "index": self.index}
        if self.piece is not None:
            d["piece"] = self.piece.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LocalLeaf:
        spec = LeafSpec.from_json(d)
        piece = Piece.from_json(d["piece"], spec.shape) if d.get("piece") is not None else None
        if piece is not None and (spec.kind != "torch" or spec.stride is not None):
            raise ValueError(f"'{spec.path}': only C-ordered torch tensors are stored as pieces")
        return cls(spec, checksum_field(d["digest"], "leaf digest"), int_field(d["owner"], "owner", 0, MAX_WORLD),
                   int_field(d["index"], "leaf index", 0, 1 << 40), piece)


@dataclass(frozen=True)
class RankLayout:
    """A rank's whole state as it saved it: ``skeleton`` (the tree grammar of ``ckptlib.tree``, its
    leaf numbers index ``leaves``), or None and ``skeleton_of`` = the lower rank whose skeleton it
    shares (written once), and ``digest`` = ``rank_digest`` of the skeleton and leaves."""

    rank: int
    world: int
    save_id: str
    skeleton: Any
    skeleton_of: int | None
    leaves: tuple[LocalLeaf, ...]
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.world, "save_id": self.save_id, "skeleton": self.skeleton,
                "skeleton_of": self.skeleton_of, "leaves": [leaf.to_json() for leaf in self.leaves],
                "digest": self.digest}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankLayout:
        world = int_field(d["world"], "world", 1, MAX_WORLD)
        rank = int_field(d["rank"], "rank", 0, world - 1)
        save_id = d["save_id"]
        if not isinstance(save_id, str) or not _SAVE_ID.match(save_id):
            raise ValueError(f"save id {str(save_id)[:40]!r} is not 16 hex digits")
        of = d.get("skeleton_of")
        if of is not None:
            int_field(of, "skeleton_of", 0, rank - 1 if rank else -1)
        leaves = tuple(LocalLeaf.from_json(x) for x in d["leaves"])
        if any(leaf.owner >= world for leaf in leaves):
            raise ValueError(f"a leaf names an owner rank outside the group of {world}")
        return cls(rank, world, save_id, d["skeleton"], of, leaves, checksum_field(d["digest"], "rank digest"))


@dataclass(frozen=True)
class RankFragment(Fragment):
    """A rank's fragment: the ``Fragment`` of the values it stores, and its ``layout``. The values it
    stores are each an own leaf of its layout (``owner`` = this rank), and every one is."""

    layout: RankLayout | None = None  # set on every rank fragment (a default only because Fragment's fields have some)

    def to_json(self) -> dict[str, Any]:
        assert self.layout is not None
        return {**super().to_json(), "rank": self.layout.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankFragment:
        frag = super().from_json(d)
        assert isinstance(frag, RankFragment)
        out = replace(frag, layout=RankLayout.from_json(d["rank"]))
        out.check_layout()
        return out

    @classmethod
    def of(cls, fragment: Fragment, layout: RankLayout) -> RankFragment:
        out = cls(**{f.name: getattr(fragment, f.name) for f in fields(Fragment)}, layout=layout)
        out.check_layout()
        return out

    def check_layout(self) -> None:
        """Each own leaf of the layout names a stored leaf of the same dtype, local shape and digest,
        every stored leaf is named once, and the layout's digest matches it (ValueError)."""
        layout = self.layout
        if layout is None:
            raise ValueError("a rank fragment without its layout")
        named: set[int] = set()
        for leaf in layout.leaves:
            if leaf.owner != layout.rank:
                continue
            if not 0 <= leaf.index < len(self.leaves) or leaf.index in named:
                raise ValueError(f"'{leaf.spec.path}' names stored leaf {leaf.index} (of {len(self.leaves)}) "
                                 "out of range or twice")
            named.add(leaf.index)
            stored = self.leaves[leaf.index]
            if (stored.spec.kind, stored.spec.dtype, stored.spec.shape, stored.digest) != (
                    leaf.spec.kind, leaf.spec.dtype, leaf.local_shape, leaf.digest):
                raise ValueError(f"'{leaf.spec.path}' does not match stored leaf '{stored.spec.path}'")
        if len(named) != len(self.leaves):
            raise ValueError(f"{len(self.leaves) - len(named)} stored leaves belong to no leaf of the rank's state")
        if layout.skeleton_of is None and rank_digest(layout.skeleton, layout.leaves) != layout.digest:
            raise ValueError("the rank's digest does not match its skeleton and leaves")


@dataclass(frozen=True)
class RankRef:
    """A group fragment's entry for one rank: where its fragment is, the checksum of its bytes, its
    logical digest and sizes."""

    rank: int
    key: str
    checksum: str
    digest: str
    logical_bytes: int
    bytes_written: int
    stats: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "key": self.key, "checksum": self.checksum, "digest": self.digest,
                "logical_bytes": self.logical_bytes, "bytes_written": self.bytes_written, "stats": self.stats}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RankRef:
        return cls(int_field(d["rank"], "rank", 0, MAX_WORLD), str(d["key"]), checksum_field(d["checksum"], "rank checksum"),
                   checksum_field(d["digest"], "rank digest"), int_field(d["logical_bytes"], "logical_bytes", 0, 2**63),
                   int_field(d["bytes_written"], "bytes_written", 0, 2**63),
                   {str(k): int_field(v, "stat", 0, 2**63) for k, v in dict(d.get("stats", {})).items()})


@dataclass(frozen=True)
class GroupFragment:
    """One part saved by a group of ``world`` ranks: its rank fragments (``ranks``, in rank order), the
    union of their blob tables, and ``digest`` = ``group_digest`` of the ranks' digests. It has the
    attributes a manifest's part entry needs, as a ``Fragment`` has."""

    step: int
    part: str
    generation: int
    config_hash: str | None
    world: int
    save_id: str
    ranks: tuple[RankRef, ...]
    blobs: dict[str, Blob]
    digest: str
    logical_bytes: int
    bytes_written: int
    stats: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    format: int = GROUP_FORMAT
    document_bytes: int | None = field(default=None, compare=False)  # bytes of the object it was read from

    @property
    def stored_bytes(self) -> int:
        return sum(b.size for b in self.blobs.values())

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "kind": "group", "checksum": CHECKSUM, "step": self.step, "part": self.part,
                "generation": self.generation, "config_hash": self.config_hash, "world": self.world,
                "save_id": self.save_id, "ranks": [r.to_json() for r in self.ranks],
                "blobs": {k: b.to_json() for k, b in self.blobs.items()}, "digest": self.digest,
                "logical_bytes": self.logical_bytes, "bytes_written": self.bytes_written, "stats": self.stats,
                "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GroupFragment:
        if d.get("format") != GROUP_FORMAT or d.get("checksum") != CHECKSUM:
            raise FormatVersionError(
                f"group fragment of part {str(d.get('part'))[:64]!r} has format {str(d.get('format'))[:20]!r} and "
                f"checksum {str(d.get('checksum'))[:40]!r}; this ckptlib reads format {GROUP_FORMAT} with "
                f"{CHECKSUM!r}: install the ckptlib version that wrote it, or a newer one")
        world = int_field(d["world"], "world", 1, MAX_WORLD)
        ranks = d["ranks"]
        if not isinstance(ranks, list) or len(ranks) != world:  # counted before anything is built
            raise ValueError(f"it declares {world} ranks but lists "
                             f"{len(ranks) if isinstance(ranks, list) else 'no list of'} rank fragments")
        g = cls(int_field(d["step"], "step", 0, 2**63), str(d["part"]), int_field(d["generation"], "generation", 0, 2**63),
                d.get("config_hash"), world, str(d["save_id"]), tuple(RankRef.from_json(r) for r in ranks),
                {checksum_field(k, "blob table key"): Blob.from_json(b) for k, b in d["blobs"].items()},
                checksum_field(d["digest"], "digest"), int_field(d["logical_bytes"], "logical_bytes", 0, 2**63),
                int_field(d["bytes_written"], "bytes_written", 0, 2**63), dict(d.get("stats", {})), meta_field(d.get("meta", {})))
        g.check_consistent()
        return g

    def check_consistent(self) -> None:
        """Ranks 0..world-1 in order, each fragment key of this step, part, generation and save, and the
        digest over the ranks' digests (ValueError)."""
        if not _SAVE_ID.match(self.save_id):
            raise ValueError(f"save id {self.save_id[:40]!r} is not 16 hex digits")
        if [r.rank for r in self.ranks] != list(range(self.world)):
            raise ValueError(f"it lists ranks {[r.rank for r in self.ranks][:8]}, not 0..{self.world - 1}")
        for r in self.ranks:
            if r.key != rank_fragment_key(self.step, self.part, self.generation, r.rank, self.save_id):
                raise ValueError(f"rank {r.rank}'s fragment key {r.key[:120]!r} is not this group's")
        if group_digest(self.world, [r.digest for r in self.ranks]) != self.digest:
            raise ValueError("its digest does not match its ranks' digests")

    @property
    def key(self) -> str:
        """Where a multi-part cut stores it."""
        return fragment_key(self.step, self.part, self.generation)


AnyFragment = Fragment | GroupFragment


def rank_digest(skeleton: Any, leaves: tuple[LocalLeaf, ...] | list[LocalLeaf]) -> str:
    """Logical digest of a rank's state: its skeleton, and per leaf the logical spec, the piece it
    held and the digest of its bytes. Not where they are stored, nor how (owner, chunks, codecs)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(skeleton, separators=(",", ":")).encode())
    for leaf in leaves:
        piece = [list(leaf.piece.offsets), list(leaf.piece.shape)] if leaf.piece is not None else None
        h.update(b"\0" + json.dumps([leaf.spec.logical_json(), piece], separators=(",", ":")).encode()
                 + b"\0" + leaf.digest.encode())
    return h.hexdigest()


def group_digest(world: int, rank_digests: list[str]) -> str:
    """The digest of a group's part: over its world size and its ranks' digests, in rank order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"group\0{world}\0".encode())
    for d in rank_digests:
        h.update(d.encode() + b"\0")
    return h.hexdigest()


class _AnyFragment:
    """``parse_document`` target: a fragment or a group fragment, by its ``kind``."""

    @staticmethod
    def from_json(d: Any) -> AnyFragment:
        return parse_any_fragment(d)


_AnyFragment.__name__ = "fragment"  # what parse_document's errors call it (a class attribute would not rename it)


def parse_any_fragment(d: Any) -> AnyFragment:
    if isinstance(d, dict) and d.get("kind") == "group":
        return GroupFragment.from_json(d)
    if isinstance(d, dict) and "rank" in d:
        return RankFragment.from_json(d)
    return Fragment.from_json(d)


def loads_any_fragment(data: bytes, where: str) -> AnyFragment:
    """A fragment document of any kind: a part's, a rank's (``RankFragment``) or a group's."""
    frag = parse_document(_AnyFragment, data, where, MAX_FRAGMENT_BYTES)
    return replace(frag, document_bytes=len(data))  # what a manifest committing it records


def loads_rank_fragment(data: bytes, where: str) -> RankFragment:
    frag = parse_document(RankFragment, data, where, MAX_FRAGMENT_BYTES)
    assert isinstance(frag, RankFragment)
    return replace(frag, document_bytes=len(data))
