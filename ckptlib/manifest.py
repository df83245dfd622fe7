"""JSON documents of the format: fragments (one part of a cut) and manifests (the commit point).

The JSON is the format; these frozen dataclasses are typed views of it. Nothing here is ever
pickled or imports torch. Every document read from a store is checked as it is parsed: a
malformed, truncated or hostile one raises ``CorruptCheckpoint`` naming where, never a raw
KeyError/TypeError, and nothing in it can make a reader allocate more than it declares (leaf
sizes are checked in ``LeafSpec.checked``; chunk counts against sizes here).

Format 2 (written now; format 1 is still read). A fragment::

    {"format": 2, "checksum": "xxh3-128", "step": 10, "part": "shard-0", "generation": 0, "chunk_bytes": 1048576,
     "config_hash": "...", "skeleton": <node, see ckptlib.tree>,
     "leaves": [{"path", "kind", "dtype", "shape", ["stride"], ["order"], ["param"], ["requires_grad"],
                 "nbytes", "itemsize", "digest",
                 "chunk_bytes", "chunks": [<raw checksum>, ...]       (a leaf of one chunk or more)
                 | "pack": <raw checksum>, "offset": <byte offset>}],  (a small leaf inside a pack)
     "blobs": {<raw checksum>: {"key", "size", "nbytes", "codecs": [...], "base": <raw checksum>|null,
                                "depth": 0..}},
     "digest": <logical digest of the part>, "logical_bytes", "bytes_written", "stats", "meta"}

A manifest lists its parts with their digests; a single-writer manifest embeds its one fragment
(one read restores it), a multi-part one names each part's fragment object and its checksum, so
its size is O(parts) and a reader of one part parses O(that part's tensors)::

    {"format": 2, "step", "parent", "created", "digest", "single",
     "parts": {name: {"digest", "generation", "logical_bytes", "bytes_written", "stored_bytes", "stats",
                      "fragment": {...}  |  "key": "fragments/...", "checksum": <xxh3-128 of its bytes>}},
     "logical_bytes", "bytes_written", "stored_bytes", "lineage": null | {"run", "step"}, "meta"}
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import xxhash

from .errors import CorruptCheckpoint, FormatVersionError, UnsupportedState
from .types import MAX_LEAF_BYTES, LeafSpec

if TYPE_CHECKING:
    from .distributed.documents import AnyFragment, GroupFragment

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
CHECKSUM = "xxh3-128"  # the hash of chunk checksums and leaf digests, recorded in every fragment
MAX_CHAIN = 1024  # deepest delta chain a manifest may declare (keyframe_every is at most this)

# Caps of the documents (docs/format.md, "Caps"), checked before a document is read whole and by
# the writer, which refuses to write what a reader would refuse. A fragment costs about 290 bytes
# per chunk and 270 per leaf: 128 MiB holds some 450,000 chunks (1.7 TiB in 4 MiB chunks) per part.
MAX_FRAGMENT_BYTES = 128 << 20
MANIFEST_FIELDS_BYTES = 1 << 20  # a manifest's own fields and its meta
PART_REF_BYTES = 4 << 10  # one part's entry in a multi-part manifest (digest, sizes, stats, key)
MAX_MANIFEST_BYTES = MAX_FRAGMENT_BYTES + MANIFEST_FIELDS_BYTES  # a single-writer one embeds its fragment
# What a stored object may hold for ``nbytes`` raw bytes: a keyframe is at most the raw bytes (stored
# raw when zstd does not pay), a delta smaller than a keyframe; format 1's tiny zstd frames had headers.
STORED_SLACK_BYTES = 64 << 10


def multi_part_cap(parts: int) -> int:
    """The largest multi-part manifest of ``parts`` parts: O(parts), it names their fragments."""
    return MANIFEST_FIELDS_BYTES + parts * PART_REF_BYTES


def max_stored_bytes(nbytes: int) -> int:
    """The largest object an encoding of ``nbytes`` raw bytes is stored as."""
    return 2 * nbytes + STORED_SLACK_BYTES

_BLOB_KEY = re.compile(r"^chunks/([0-9a-f]{2})/(\1[0-9a-f]{30})$")
_CHECKSUM = re.compile(r"^[0-9a-f]{32}$")
_FRAGMENT_KEY = re.compile(r"^fragments/\d+/[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\.g\d+\.json$")


def _int(v: Any, what: str, lo: int = 0, hi: int = MAX_LEAF_BYTES) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{what} {v!r} is not an int in [{lo}, {hi}]")
    return v


def _checksum(v: Any, what: str) -> str:
    if not isinstance(v, str) or not _CHECKSUM.match(v):
        raise ValueError(f"{what} {str(v)[:40]!r} is not a {CHECKSUM} checksum")
    return v


def _meta(v: Any) -> dict[str, Any]:
    """A document's ``meta``: an object of at most ``MANIFEST_FIELDS_BYTES`` (as writers refuse more).
    Measured as a lower bound of its JSON size, walking it and stopping as soon as it is over: the
    check costs no more than the cap, whatever was stored (ValueError)."""
    if not isinstance(v, dict):
        raise ValueError(f"meta is a {type(v).__name__}, not an object")
    budget, stack = MANIFEST_FIELDS_BYTES, [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            budget -= 1 + sum(len(k) + 4 for k in x)  # {"k":v,...}: quotes, colon, comma per member
            stack.extend(x.values())
        elif isinstance(x, list):
            budget -= 1 + len(x)
            stack.extend(x)
        else:
            budget -= len(x) + 2 if isinstance(x, str) else 1
        if budget < 0:
            raise ValueError(f"its meta is more than the {MANIFEST_FIELDS_BYTES} bytes any ckptlib writes "
                             "(writers refuse a larger meta)")
    return v


@dataclass(frozen=True)
class Blob:
    """One stored object: the encoding of one raw chunk (identified by its raw checksum)."""

    key: str
    size: int  # stored (encoded) bytes
    nbytes: int  # raw bytes
    codecs: tuple[dict[str, Any], ...]
    base: str | None  # raw checksum of the chunk this delta applies to
    depth: int  # 0 = keyframe; a delta is depth(base) + 1

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "nbytes": self.nbytes,
                "codecs": list(self.codecs), "base": self.base, "depth": self.depth}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Blob:
        if not isinstance(d.get("key"), str) or not _BLOB_KEY.match(d["key"]):
            raise ValueError(f"blob key {str(d.get('key'))[:80]!r} is not chunks/<h2>/<hash>")
        codecs = d["codecs"]
        if not isinstance(codecs, list) or not codecs or not all(isinstance(c, dict) for c in codecs):
            raise ValueError(f"blob {d['key']} has no codec list")
        base = d["base"]
        if base is not None:
            _checksum(base, "blob base")
        nbytes = _int(d["nbytes"], "blob nbytes")
        size = _int(d["size"], "blob size", 0, max_stored_bytes(nbytes))
        return cls(d["key"], size, nbytes, tuple(codecs), base, _int(d["depth"], "blob depth", 0, MAX_CHAIN))


@dataclass(frozen=True)
class Leaf:
    """A leaf's spec, digest and where its bytes are: ``chunks`` of ``chunk_bytes`` each, or at
    ``offset`` inside the packed chunk ``pack``."""

    spec: LeafSpec
    digest: str  # checksum of the leaf's whole raw bytes (independent of chunking and packing)
    chunk_bytes: int | None
    chunks: tuple[str, ...] = ()  # raw checksums, in order
    pack: str | None = None
    offset: int = 0

    def segments(self) -> list[tuple[str, int, int, int]]:
        """[(raw checksum, start in the leaf, start in that chunk, length)] covering the leaf."""
        n = self.spec.nbytes
        if self.pack is not None:
            return [(self.pack, 0, self.offset, n)] if n else []
        size = self.chunk_bytes or 1
        return [(d, j * size, 0, min(size, n - j * size)) for j, d in enumerate(self.chunks)]

    def to_json(self) -> dict[str, Any]:
        d = {**self.spec.to_json(), "digest": self.digest}
        if self.pack is not None:
            d.update(pack=self.pack, offset=self.offset)
        else:
            d.update(chunk_bytes=self.chunk_bytes, chunks=list(self.chunks))
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Leaf:
        spec = LeafSpec.from_json(d)
        digest = _checksum(d["digest"], "leaf digest")
        if "pack" in d:
            return cls(spec, digest, None, (), _checksum(d["pack"], "pack"), _int(d["offset"], "pack offset"))
        chunk_bytes = _int(d["chunk_bytes"], "chunk_bytes", 1)
        if chunk_bytes % spec.itemsize:
            raise ValueError(f"chunk_bytes {chunk_bytes} of '{spec.path}' is not a multiple of its itemsize")
        chunks = d["chunks"]
        if not isinstance(chunks, list) or len(chunks) != math.ceil(spec.nbytes / chunk_bytes):
            raise ValueError(f"'{spec.path}' lists {len(chunks) if isinstance(chunks, list) else chunks!r} chunks; "
                             f"{spec.nbytes} bytes in chunks of {chunk_bytes} need {math.ceil(spec.nbytes / chunk_bytes)}")
        return cls(spec, digest, chunk_bytes, tuple(_checksum(c, "chunk") for c in chunks))


@dataclass(frozen=True)
class Fragment:
    step: int
    part: str
    generation: int
    config_hash: str | None
    skeleton: Any
    leaves: tuple[Leaf, ...]
    blobs: dict[str, Blob]
    digest: str
    logical_bytes: int
    bytes_written: int
    stats: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT_VERSION
    chunk_bytes: int | None = None  # the writer's chunk size (format 2); its next save plans alike
    document_bytes: int | None = field(default=None, compare=False)  # bytes of the object it was read from

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "checksum": CHECKSUM, "step": self.step, "part": self.part,
                "chunk_bytes": self.chunk_bytes,
                "generation": self.generation, "config_hash": self.config_hash,
                "skeleton": self.skeleton, "leaves": [leaf.to_json() for leaf in self.leaves],
                "blobs": {k: b.to_json() for k, b in self.blobs.items()}, "digest": self.digest,
                "logical_bytes": self.logical_bytes, "bytes_written": self.bytes_written,
                "stats": self.stats, "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Fragment:
        fmt = _check_format(d)
        if d.get("checksum") != CHECKSUM:
            raise FormatVersionError(
                f"fragment of part {str(d.get('part'))[:64]!r} uses checksum {str(d.get('checksum'))[:40]!r}; this "
                f"ckptlib verifies {CHECKSUM!r}. It was written by another ckptlib version: read it with that version."
            )
        blobs = {_checksum(k, "blob table key"): Blob.from_json(b) for k, b in d["blobs"].items()}
        leaves = tuple(Leaf.from_json(x) for x in d["leaves"])
        frag = cls(_int(d["step"], "step", 0, 2**63), str(d["part"]), _int(d["generation"], "generation", 0, 2**63),
                   d.get("config_hash"), d["skeleton"], leaves, blobs, _checksum(d["digest"], "digest"),
                   _int(d["logical_bytes"], "logical_bytes", 0, 2**63), _int(d["bytes_written"], "bytes_written", 0, 2**63),
                   dict(d.get("stats", {})), _meta(d.get("meta", {})), fmt,
                   _int(d["chunk_bytes"], "chunk_bytes", 1) if d.get("chunk_bytes") is not None else None)
        frag.check_consistent()
        return frag

    def check_consistent(self) -> None:
        """Every chunk a leaf names is in the blob table with the size its leaves need (a chunk its
        leaf's length, a pack exactly the end of its last leaf, and no more than the writer's chunk
        size), every delta chain ends at a keyframe of the table, and the digest matches the
        skeleton and leaves (ValueError)."""
        pack_end: dict[str, int] = {}
        for leaf in self.leaves:
            self._check_chunking(leaf)
            for digest, _start, at, length in leaf.segments():
                blob = self.blobs.get(digest)
                if blob is None:
                    raise ValueError(f"'{leaf.spec.path}' names chunk {digest}, which is not in the blob table")
                if at + length > blob.nbytes or (leaf.pack is None and blob.nbytes != length):
                    raise ValueError(f"'{leaf.spec.path}' takes bytes {at}..{at + length} of chunk {digest}, which "
                                     f"holds {blob.nbytes}")
                if leaf.pack is not None:
                    pack_end[digest] = max(pack_end.get(digest, 0), at + length)
        if len({b.key for b in self.blobs.values()}) != len(self.blobs):  # a key is a hash of its raw checksum
            raise ValueError("two chunks of its blob table name the same stored object")
        for digest, end in pack_end.items():
            nbytes = self.blobs[digest].nbytes
            if nbytes != end or (self.chunk_bytes is not None and nbytes > self.chunk_bytes):
                raise ValueError(f"pack {digest} declares {nbytes} bytes; its leaves end at byte {end} and a pack holds "
                                 f"at most the chunk size ({self.chunk_bytes})")
        ok: set[str] = set()  # chunks whose chains were checked already
        for digest, blob in self.blobs.items():
            chain, d, b = [digest], digest, blob
            while b.base is not None and d not in ok:  # bounded by MAX_CHAIN; a loop is refused
                if b.base in chain or len(chain) > MAX_CHAIN:
                    raise ValueError(f"the delta chain of chunk {digest} loops or is longer than {MAX_CHAIN}")
                base = self.blobs.get(b.base)
                if base is None:
                    raise ValueError(f"chunk {d} is a delta of {b.base}, which is not in the blob table")
                if base.nbytes != b.nbytes:
                    raise ValueError(f"chunk {d} ({b.nbytes} bytes) is a delta of a {base.nbytes}-byte chunk")
                chain.append(b.base)
                d, b = b.base, base
            ok.update(chain)
        if part_digest(self.skeleton, list(self.leaves), self.format) != self.digest:
            raise ValueError("its digest does not match its skeleton and leaves")

    def _check_chunking(self, leaf: Leaf) -> None:
        """A chunked leaf's chunks are no larger than the writer's chunk size (or one element)."""
        if leaf.pack is None and self.chunk_bytes is not None and leaf.chunk_bytes is not None \
                and leaf.chunk_bytes > max(self.chunk_bytes, leaf.spec.itemsize):
            raise ValueError(f"'{leaf.spec.path}' is cut in chunks of {leaf.chunk_bytes} bytes; the part's chunk size "
                             f"is {self.chunk_bytes}")

    @property
    def stored_bytes(self) -> int:
        return sum(b.size for b in self.blobs.values())


@dataclass(frozen=True)
class PartRef:
    """A manifest's entry for one part: its digest and sizes, and its fragment (embedded, or the
    key of the fragment object with a checksum of its bytes)."""

    name: str
    digest: str
    generation: int
    logical_bytes: int
    bytes_written: int
    stored_bytes: int
    stats: dict[str, int]
    config_hash: str | None = None
    fragment: Fragment | GroupFragment | None = None  # embedded (single-writer manifests, and every format 1 one)
    key: str | None = None
    checksum: str | None = None
    size: int | None = None  # bytes of the fragment object (recorded since ckptlib 0.3): its read's cap

    @classmethod
    def of(cls, name: str, frag: AnyFragment, *, embed: bool, checksum: str | None = None) -> PartRef:
        return cls(name, frag.digest, frag.generation, frag.logical_bytes, frag.bytes_written, frag.stored_bytes,
                   dict(frag.stats), frag.config_hash, frag if embed else None,
                   None if embed else fragment_key(frag.step, frag.part, frag.generation), checksum,
                   None if embed else frag.document_bytes)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"digest": self.digest, "generation": self.generation,
                             "logical_bytes": self.logical_bytes, "bytes_written": self.bytes_written,
                             "stored_bytes": self.stored_bytes, "stats": self.stats, "config_hash": self.config_hash}
        if self.fragment is not None:
            d["fragment"] = self.fragment.to_json()
        else:
            d.update(key=self.key, checksum=self.checksum)
            if self.size is not None:
                d["size"] = self.size
        return d

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> PartRef:
        from .distributed.documents import parse_any_fragment  # a group's part (docs/format.md, "Group fragments")

        frag = parse_any_fragment(d["fragment"]) if "fragment" in d else None
        key = checksum = size = None
        if frag is None:
            key, checksum = d["key"], _checksum(d["checksum"], "fragment checksum")
            if not isinstance(key, str) or not _FRAGMENT_KEY.match(key):
                raise ValueError(f"part {name!r} names fragment {str(key)[:80]!r}, not fragments/<step>/<part>.g<gen>.json")
            if d.get("size") is not None:
                size = _int(d["size"], "fragment size", 2, MAX_FRAGMENT_BYTES)
        return cls(name, _checksum(d["digest"], "part digest"), _int(d["generation"], "generation", 0, 2**63),
                   _int(d["logical_bytes"], "logical_bytes", 0, 2**63), _int(d["bytes_written"], "bytes_written", 0, 2**63),
                   _int(d["stored_bytes"], "stored_bytes", 0, 2**63), dict(d.get("stats", {})), d.get("config_hash"),
                   frag, key, checksum, size)

    @classmethod
    def from_v1(cls, name: str, d: dict[str, Any]) -> PartRef:
        return cls.of(name, Fragment.from_json(d), embed=True)


@dataclass(frozen=True)
class Manifest:
    step: int
    parent: int | None
    created: str
    digest: str
    single: bool
    parts: dict[str, PartRef]
    meta: dict[str, Any] = field(default_factory=dict)
    lineage: dict[str, Any] | None = None  # {"run": <url of the run branched from>, "step": <its step>}
    stored_bytes: int = 0  # bytes of every object this checkpoint needs (deduplicated across parts)
    format: int = FORMAT_VERSION

    @property
    def logical_bytes(self) -> int:
        return sum(p.logical_bytes for p in self.parts.values())

    @property
    def bytes_written(self) -> int:
        return sum(p.bytes_written for p in self.parts.values())

    @property
    def kind(self) -> str:
        """'keyframe' if nothing written for this checkpoint is a delta, else 'delta'."""
        return "delta" if any(p.stats.get("delta", 0) for p in self.parts.values()) else "keyframe"

    @property
    def stats(self) -> dict[str, int]:
        """Chunks by kind over all parts: {"keyframe": n, "delta": n, "unchanged": n}."""
        total: dict[str, int] = {}
        for p in self.parts.values():
            for k, v in p.stats.items():
                total[k] = total.get(k, 0) + v
        return total

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "step": self.step, "parent": self.parent,
                "created": self.created, "digest": self.digest, "single": self.single,
                "parts": {k: p.to_json() for k, p in self.parts.items()},
                "logical_bytes": self.logical_bytes, "bytes_written": self.bytes_written,
                "stored_bytes": self.stored_bytes, "lineage": self.lineage, "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        fmt = _check_format(d)
        raw_parts = d["parts"]
        if not isinstance(raw_parts, dict):
            raise ValueError("parts is not an object")
        if fmt == 1:
            parts = {name: PartRef.from_v1(name, f) for name, f in raw_parts.items()}
            sizes = {b.key: b.size for p in parts.values() if p.fragment is not None for b in p.fragment.blobs.values()}
            stored = sum(sizes.values())
        else:
            parts = {name: PartRef.from_json(name, p) for name, p in raw_parts.items()}
            stored = _int(d["stored_bytes"], "stored_bytes", 0, 2**63)
        parent = d.get("parent")
        if parent is not None:
            _int(parent, "parent", 0, 2**63)
        lineage = d.get("lineage")
        if lineage is not None and not (isinstance(lineage, dict) and isinstance(lineage.get("run"), str)
                                        and isinstance(lineage.get("step"), int)):
            raise ValueError("lineage is not {run, step}")
        m = cls(_int(d["step"], "step", 0, 2**63), parent, str(d["created"]), _checksum(d["digest"], "digest"),
                bool(d["single"]), parts, dict(d.get("meta", {})), lineage, stored, fmt)
        m.check_coverage()
        return m

    def check_coverage(self) -> None:
        """The parts listed are the parts committed: the digest covers every part's name and digest
        (a manifest with a part removed or swapped no longer matches it)."""
        if self.single and list(self.parts) != ["state"]:
            raise ValueError(f"a single-writer manifest has exactly the part 'state', not {sorted(self.parts)}")
        if not self.parts:
            raise ValueError("it lists no parts")
        if combined_digest({n: p.digest for n, p in self.parts.items()}, self.single) != self.digest:
            raise ValueError("its digest does not match its parts (a part was removed, added or replaced)")


def fragment_key(step: int, part: str, generation: int) -> str:
    return f"fragments/{step}/{part}.g{generation}.json"


def part_digest(skeleton: Any, leaves: list[Leaf], fmt: int = FORMAT_VERSION) -> str:
    """Logical digest: structure, names, types, shapes and raw bytes; not chunking or encoding."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(skeleton, separators=(",", ":")).encode())
    for leaf in leaves:
        s = leaf.spec
        if fmt == 1:
            h.update(f"\0{s.path}\0{s.kind}\0{s.dtype}\0{list(s.shape)}\0{leaf.digest}".encode())
        else:
            h.update(b"\0" + json.dumps(s.logical_json(), separators=(",", ":")).encode() + b"\0" + leaf.digest.encode())
    return h.hexdigest()


def combined_digest(part_digests: dict[str, str], single: bool) -> str:
    """The checkpoint's logical digest: the part's own for a single save, else a hash of all parts."""
    if single:
        (only,) = part_digests.values()
        return only
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(part_digests):
        h.update(f"{name}\0{part_digests[name]}\0".encode())
    return h.hexdigest()


def dumps(doc: AnyFragment | Manifest) -> bytes:
    """The stored bytes of a document; UnsupportedState when a reader would refuse them (its cap)."""
    # key order is part of a state; NaN cannot appear (non-finite floats are tagged in the skeleton)
    meta = len(json.dumps(doc.meta, separators=(",", ":"), allow_nan=False).encode())
    if meta > MANIFEST_FIELDS_BYTES:
        raise UnsupportedState(f"meta of {meta} bytes, more than the {MANIFEST_FIELDS_BYTES} a reader accepts "
                               "(docs/format.md, \"Caps\"): keep meta small (store large data as state)")
    data = json.dumps(doc.to_json(), separators=(",", ":"), allow_nan=False).encode()
    cap = document_cap(doc)
    if len(data) > cap:
        what = (f"the manifest of step {doc.step} ({len(doc.parts)} parts)" if isinstance(doc, Manifest)
                else f"the fragment of part '{doc.part}'")
        raise UnsupportedState(
            f"{what} would be {len(data)} bytes, more than the {cap} a reader accepts (docs/format.md, \"Caps\"): "
            "save with a larger chunk_bytes (fewer chunks), split the state into parts, or keep meta and "
            "config_hash small")
    return data


def document_cap(doc: AnyFragment | Manifest) -> int:
    """The most bytes a reader accepts for ``doc``'s kind and shape."""
    if not isinstance(doc, Manifest):  # a part's, a rank's or a group's fragment
        return MAX_FRAGMENT_BYTES
    if doc.single or doc.format == 1 or any(p.fragment is not None for p in doc.parts.values()):
        return MAX_MANIFEST_BYTES  # it embeds fragments
    return multi_part_cap(len(doc.parts))


def document_checksum(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def loads_manifest(data: bytes, where: str) -> Manifest:
    m = _parse(Manifest, data, where, MAX_MANIFEST_BYTES)
    if len(data) > document_cap(m):  # a multi-part manifest names its parts' fragments: O(parts)
        raise CorruptCheckpoint(f"{where} is {len(data)} bytes, more than the {document_cap(m)} a manifest of "
                                f"{len(m.parts)} parts may hold: it was not written by ckptlib")
    try:
        _meta(m.meta)  # after the cap of its shape, the tighter one for a multi-part manifest
    except ValueError as e:
        raise CorruptCheckpoint(f"{where} is not a valid manifest: {e}: it was damaged or written by something "
                                "else") from None
    return m


def loads_fragment(data: bytes, where: str) -> Fragment:
    frag = _parse(Fragment, data, where, MAX_FRAGMENT_BYTES)
    return replace(frag, document_bytes=len(data))  # what a manifest committing it records


def _parse(cls: Any, data: bytes, where: str, cap: int) -> Any:
    if len(data) > cap:
        raise CorruptCheckpoint(f"{where} is {len(data)} bytes, more than the {cap} any {cls.__name__.lower()} "
                                "ckptlib writes may hold: it was not written by ckptlib")
    try:
        return cls.from_json(json.loads(data))
    except (FormatVersionError, CorruptCheckpoint) as e:
        if isinstance(e, CorruptCheckpoint) and where not in str(e):
            raise CorruptCheckpoint(f"{where}: {e}") from None
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpoint(
            f"{where} is not a valid {cls.__name__.lower()} ({type(e).__name__}: {str(e)[:300]}): it was damaged "
            "or written by something else"
        ) from None


def _check_format(d: Any) -> int:
    if not isinstance(d, dict) or "format" not in d:
        raise KeyError("format")
    if d["format"] not in READABLE_FORMATS:
        raise FormatVersionError(
            f"checkpoint format version {str(d['format'])[:20]!r} is not supported by this ckptlib (reads versions "
            f"{', '.join(map(str, READABLE_FORMATS))}); install the ckptlib version that wrote it, or a newer one"
        )
    return int(d["format"])
