"""JSON documents of the format: fragments (one part of a cut) and manifests (the commit point).

The manifest and its part entries live here; the fragment in ``ckptlib.fragment``, the version,
caps and field checks every document shares in ``ckptlib.docfields`` (both below this module and
below ``ckptlib.distributed.documents``, whose group fragments a manifest embeds), re-exported here.

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
import re
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash

from .distributed.documents import AnyFragment, GroupFragment, parse_any_fragment
from .docfields import (
    CHECKSUM,
    FORMAT_VERSION,
    MANIFEST_FIELDS_BYTES,
    MAX_CHAIN,
    MAX_FRAGMENT_BYTES,
    MAX_MANIFEST_BYTES,
    PART_REF_BYTES,
    READABLE_FORMATS,
    STORED_SLACK_BYTES,
    checksum_field,
    format_field,
    int_field,
    json_size,
    max_stored_bytes,
    meta_field,
    multi_part_cap,
    pack,
    parse_document,
)
from .errors import CorruptCheckpoint, UnsupportedState
from .fragment import Blob, Fragment, Leaf, fragment_key, part_digest

# The fragment and the field rules live below this module (a rank's and a group's fragment build on
# them, and a manifest embeds those); re-exported, as readers import the format from here.
__all__ = [
    "CHECKSUM", "FORMAT_VERSION", "MANIFEST_FIELDS_BYTES", "MAX_CHAIN", "MAX_FRAGMENT_BYTES", "MAX_MANIFEST_BYTES",
    "PART_REF_BYTES", "READABLE_FORMATS", "STORED_SLACK_BYTES", "Blob", "Fragment", "Leaf", "Manifest", "PartRef",
    "combined_digest", "document_cap", "document_checksum", "dumps", "fragment_key", "loads_fragment",
    "loads_manifest", "max_stored_bytes", "multi_part_cap", "part_digest",
]

_FRAGMENT_KEY = re.compile(r"^fragments/\d+/[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\.g\d+\.json$")


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
        # an embedded fragment may be a group's part (docs/format.md, "Group fragments")
        frag = parse_any_fragment(d["fragment"]) if "fragment" in d else None
        key = checksum = size = None
        if frag is None:
            key, checksum = d["key"], checksum_field(d["checksum"], "fragment checksum")
            if not isinstance(key, str) or not _FRAGMENT_KEY.match(key):
                raise ValueError(f"part {name!r} names fragment {str(key)[:80]!r}, not fragments/<step>/<part>.g<gen>.json")
            if d.get("size") is not None:
                size = int_field(d["size"], "fragment size", 2, MAX_FRAGMENT_BYTES)
        return cls(name, checksum_field(d["digest"], "part digest"), int_field(d["generation"], "generation", 0, 2**63),
                   int_field(d["logical_bytes"], "logical_bytes", 0, 2**63), int_field(d["bytes_written"], "bytes_written", 0, 2**63),
                   int_field(d["stored_bytes"], "stored_bytes", 0, 2**63), dict(d.get("stats", {})), d.get("config_hash"),
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
        fmt = format_field(d)
        raw_parts = d["parts"]
        if not isinstance(raw_parts, dict):
            raise ValueError("parts is not an object")
        if fmt == 1:
            parts = {name: PartRef.from_v1(name, f) for name, f in raw_parts.items()}
            sizes = {b.key: b.size for p in parts.values() if p.fragment is not None for b in p.fragment.blobs.values()}
            stored = sum(sizes.values())
        else:
            parts = {name: PartRef.from_json(name, p) for name, p in raw_parts.items()}
            stored = int_field(d["stored_bytes"], "stored_bytes", 0, 2**63)
        parent = d.get("parent")
        if parent is not None:
            int_field(parent, "parent", 0, 2**63)
        lineage = d.get("lineage")
        if lineage is not None and not (isinstance(lineage, dict) and isinstance(lineage.get("run"), str)
                                        and isinstance(lineage.get("step"), int)):
            raise ValueError("lineage is not {run, step}")
        m = cls(int_field(d["step"], "step", 0, 2**63), parent, str(d["created"]), checksum_field(d["digest"], "digest"),
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
    return pack(data)


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
    m = parse_document(Manifest, data, where, MAX_MANIFEST_BYTES)
    size = json_size(data)
    if size > document_cap(m):  # a multi-part manifest names its parts' fragments: O(parts)
        raise CorruptCheckpoint(f"{where} is {size} bytes of JSON, more than the {document_cap(m)} a manifest of "
                                f"{len(m.parts)} parts may hold: it was not written by ckptlib")
    try:
        meta_field(m.meta)  # after the cap of its shape, the tighter one for a multi-part manifest
    except ValueError as e:
        raise CorruptCheckpoint(f"{where} is not a valid manifest: {e}: it was damaged or written by something "
                                "else") from None
    return m


def loads_fragment(data: bytes, where: str) -> Fragment:
    frag = parse_document(Fragment, data, where, MAX_FRAGMENT_BYTES)
    return replace(frag, document_bytes=len(data))  # what a manifest committing it records


