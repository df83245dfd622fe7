"""JSON documents of the format: fragments (one part of a cut) and manifests (the commit point).

The JSON is the format; these frozen dataclasses are typed views of it. Nothing here is ever
pickled. A manifest embeds its fragments, so one object read is enough to restore or to mark what
a checkpoint needs (GC), and each fragment's blob table lists every stored object its chunks need,
delta bases included: a manifest is self-contained.

Layout of a fragment (``FORMAT_VERSION`` 1)::

    {"format": 1, "step": 10, "part": "state", "generation": 0, "config_hash": "...",
     "skeleton": <JSON with {"__leaf__": i} placeholders>,
     "leaves": [{"path", "kind", "dtype", "shape", "nbytes", "itemsize", "digest",
                 "chunk_bytes", "chunks": [<raw checksum>, ...]}],
     "blobs": {<raw checksum>: {"key", "size", "nbytes", "codecs": [...], "base": <raw checksum>|null,
                                "depth": 0..K-1}},
     "digest": <logical digest of the part>, "logical_bytes", "bytes_written", "stats", "meta"}

A manifest: ``{"format": 1, "step", "parent", "created", "digest", "single", "parts": {name: fragment},
"logical_bytes", "bytes_written", "meta"}``. ``single`` manifests come from ``Checkpointer.save``
and restore to the one part's state; multi-part manifests restore to ``{part: state}``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import CorruptCheckpoint, FormatVersionError
from .tree import LeafSpec

FORMAT_VERSION = 1
CHECKSUM = "xxh3-128"  # the hash of chunk checksums and leaf digests, recorded in every fragment


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
    def from_json(cls, d: dict[str, Any]) -> "Blob":
        return cls(d["key"], int(d["size"]), int(d["nbytes"]), tuple(d["codecs"]), d["base"], int(d["depth"]))


@dataclass(frozen=True)
class Leaf:
    spec: LeafSpec
    digest: str  # checksum of the leaf's whole raw bytes (chunking-independent)
    chunk_bytes: int
    chunks: tuple[str, ...]  # raw checksums, in order

    def to_json(self) -> dict[str, Any]:
        return {**self.spec.to_json(), "digest": self.digest, "chunk_bytes": self.chunk_bytes,
                "chunks": list(self.chunks)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Leaf":
        return cls(LeafSpec.from_json(d), d["digest"], int(d["chunk_bytes"]), tuple(d["chunks"]))


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

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "checksum": CHECKSUM, "step": self.step, "part": self.part,
                "generation": self.generation, "config_hash": self.config_hash,
                "skeleton": self.skeleton, "leaves": [leaf.to_json() for leaf in self.leaves],
                "blobs": {k: b.to_json() for k, b in self.blobs.items()}, "digest": self.digest,
                "logical_bytes": self.logical_bytes, "bytes_written": self.bytes_written,
                "stats": self.stats, "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Fragment":
        _check_format(d)
        if d.get("checksum") != CHECKSUM:
            raise FormatVersionError(
                f"fragment of part {d.get('part')!r} uses checksum {d.get('checksum')!r}; this ckptlib verifies "
                f"{CHECKSUM!r}. It was written by another ckptlib version: read it with that version."
            )
        return cls(int(d["step"]), d["part"], int(d["generation"]), d.get("config_hash"), d["skeleton"],
                   tuple(Leaf.from_json(x) for x in d["leaves"]),
                   {k: Blob.from_json(b) for k, b in d["blobs"].items()}, d["digest"],
                   int(d["logical_bytes"]), int(d["bytes_written"]), dict(d.get("stats", {})),
                   dict(d.get("meta", {})))

    @property
    def stored_bytes(self) -> int:
        return sum(b.size for b in self.blobs.values())


@dataclass(frozen=True)
class Manifest:
    step: int
    parent: int | None
    created: str
    digest: str
    single: bool
    parts: dict[str, Fragment]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def logical_bytes(self) -> int:
        return sum(f.logical_bytes for f in self.parts.values())

    @property
    def bytes_written(self) -> int:
        return sum(f.bytes_written for f in self.parts.values())

    @property
    def stored_bytes(self) -> int:
        """Bytes of every object this checkpoint needs (deduplicated across parts)."""
        return sum({b.key: b.size for f in self.parts.values() for b in f.blobs.values()}.values())

    @property
    def kind(self) -> str:
        """'keyframe' if nothing written for this checkpoint is a delta, else 'delta'."""
        return "delta" if any(f.stats.get("delta", 0) for f in self.parts.values()) else "keyframe"

    def blob_keys(self) -> set[str]:
        return {b.key for f in self.parts.values() for b in f.blobs.values()}

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "step": self.step, "parent": self.parent,
                "created": self.created, "digest": self.digest, "single": self.single,
                "logical_bytes": self.logical_bytes, "bytes_written": self.bytes_written,
                "parts": {k: f.to_json() for k, f in self.parts.items()}, "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Manifest":
        _check_format(d)
        return cls(int(d["step"]), d.get("parent"), d["created"], d["digest"], bool(d["single"]),
                   {k: Fragment.from_json(f) for k, f in d["parts"].items()}, dict(d.get("meta", {})))


def part_digest(skeleton: Any, leaves: list[Leaf]) -> str:
    """Logical digest: structure, names, dtypes, shapes and raw bytes; not chunking or encoding."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(skeleton, separators=(",", ":")).encode())
    for leaf in leaves:
        s = leaf.spec
        h.update(f"\0{s.path}\0{s.kind}\0{s.dtype}\0{list(s.shape)}\0{leaf.digest}".encode())
    return h.hexdigest()


def combined_digest(parts: dict[str, Fragment], single: bool) -> str:
    """The checkpoint's logical digest: the part's own for a single save, else a hash of all parts."""
    if single:
        (only,) = parts.values()
        return only.digest
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(parts):
        h.update(f"{name}\0{parts[name].digest}\0".encode())
    return h.hexdigest()


def dumps(doc: Fragment | Manifest) -> bytes:
    return json.dumps(doc.to_json(), separators=(",", ":")).encode()  # key order is part of a state


def loads_manifest(data: bytes, where: str) -> Manifest:
    return _parse(Manifest, data, where)


def loads_fragment(data: bytes, where: str) -> Fragment:
    return _parse(Fragment, data, where)


def _parse(cls: type, data: bytes, where: str) -> Any:
    try:
        return cls.from_json(json.loads(data))
    except FormatVersionError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpoint(
            f"{where} is not a valid {cls.__name__.lower()} ({type(e).__name__}: {e}). It was damaged or "
            "written by something else; restore an older step (ckpt ls shows them) and check the store."
        ) from None


def _check_format(d: Any) -> None:
    if not isinstance(d, dict) or "format" not in d:
        raise KeyError("format")
    if d["format"] != FORMAT_VERSION:
        raise FormatVersionError(
            f"checkpoint format version {d['format']!r} is not supported by this ckptlib (reads version "
            f"{FORMAT_VERSION}); install the ckptlib version that wrote it, or a newer one"
        )
