"""The fragment of one part: its leaves, where their bytes are (chunks and packs), the blob table of
the stored objects, its digest. A part's fragment is embedded in its manifest or stored beside it
(``fragment_key``); docs/format.md describes the JSON, ``ckptlib.manifest`` the documents around it.

Every fragment read is checked whole as it is parsed (``Fragment.from_json``, ``check_consistent``):
chunk counts against sizes, delta chains, the digest. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .docfields import (
    CHECKSUM,
    FORMAT_VERSION,
    MAX_CHAIN,
    checksum_field,
    format_field,
    int_field,
    max_stored_bytes,
    meta_field,
)
from .errors import FormatVersionError
from .types import LeafSpec

_BLOB_KEY = re.compile(r"^chunks/([0-9a-f]{2})/(\1[0-9a-f]{30})$")


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
            checksum_field(base, "blob base")
        nbytes = int_field(d["nbytes"], "blob nbytes")
        size = int_field(d["size"], "blob size", 0, max_stored_bytes(nbytes))
        return cls(d["key"], size, nbytes, tuple(codecs), base, int_field(d["depth"], "blob depth", 0, MAX_CHAIN))


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
        digest = checksum_field(d["digest"], "leaf digest")
        if "pack" in d:
            return cls(spec, digest, None, (), checksum_field(d["pack"], "pack"), int_field(d["offset"], "pack offset"))
        chunk_bytes = int_field(d["chunk_bytes"], "chunk_bytes", 1)
        if chunk_bytes % spec.itemsize:
            raise ValueError(f"chunk_bytes {chunk_bytes} of '{spec.path}' is not a multiple of its itemsize")
        chunks = d["chunks"]
        if not isinstance(chunks, list) or len(chunks) != math.ceil(spec.nbytes / chunk_bytes):
            raise ValueError(f"'{spec.path}' lists {len(chunks) if isinstance(chunks, list) else chunks!r} chunks; "
                             f"{spec.nbytes} bytes in chunks of {chunk_bytes} need {math.ceil(spec.nbytes / chunk_bytes)}")
        return cls(spec, digest, chunk_bytes, tuple(checksum_field(c, "chunk") for c in chunks))


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
        fmt = format_field(d)
        if d.get("checksum") != CHECKSUM:
            raise FormatVersionError(
                f"fragment of part {str(d.get('part'))[:64]!r} uses checksum {str(d.get('checksum'))[:40]!r}; this "
                f"ckptlib verifies {CHECKSUM!r}. It was written by another ckptlib version: read it with that version."
            )
        blobs = {checksum_field(k, "blob table key"): Blob.from_json(b) for k, b in d["blobs"].items()}
        leaves = tuple(Leaf.from_json(x) for x in d["leaves"])
        frag = cls(int_field(d["step"], "step", 0, 2**63), str(d["part"]), int_field(d["generation"], "generation", 0, 2**63),
                   d.get("config_hash"), d["skeleton"], leaves, blobs, checksum_field(d["digest"], "digest"),
                   int_field(d["logical_bytes"], "logical_bytes", 0, 2**63), int_field(d["bytes_written"], "bytes_written", 0, 2**63),
                   dict(d.get("stats", {})), meta_field(d.get("meta", {})), fmt,
                   int_field(d["chunk_bytes"], "chunk_bytes", 1) if d.get("chunk_bytes") is not None else None)
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
