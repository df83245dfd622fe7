"""DCP's ``Metadata`` as JSON, and back, without pickle (docs/integrations.md, "DCP").

``to_json(metadata, where)`` writes the fields DCP's default planners fill; ``from_json(data,
step)`` rebuilds them from a closed set of types: dtypes, layouts and memory formats are looked up
by name among torch's own values, never imported by name from the data. Anything else is
``CorruptCheckpoint`` naming the field. ``Location`` is this backend's ``storage_data`` value: which
ckptlib part of which step holds an item, under which key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptCheckpoint

FORMAT = "ckptlib-dcp-metadata"
VERSION = 1
MAX_DIMS = 64

# the closed sets a name may map to: torch's own values of each kind, by their str()
_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_FORMATS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.memory_format)}


@dataclass(frozen=True)
class Location:
    """Where one DCP item is stored: ``key`` of part ``part`` of committed ``step``."""

    step: int
    part: str
    key: str


def item_key(index: MetadataIndex) -> str:
    """The key of a DCP item in its rank's part: the FQN with '%', '/' and '@' escaped (a '/' would
    be a path to ``restore(select=)``), then '@' and the chunk's offsets for a tensor. Injective:
    only a tensor's key holds a bare '@'."""
    name = index.fqn.replace("%", "%25").replace("/", "%2F").replace("@", "%40")
    return name if index.offset is None else f"{name}@{','.join(map(str, index.offset))}"


def to_json(metadata: Metadata, where: dict[MetadataIndex, Location]) -> bytes:
    """``metadata`` (and where each item went) as JSON bytes. Raises
    ValueError for what this backend cannot store (a planner's own ``planner_data``)."""
    items: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            items[fqn] = {"bytes": True}
            continue
        p = md.properties
        items[fqn] = {"tensor": {
            "dtype": str(p.dtype), "layout": str(p.layout), "requires_grad": bool(p.requires_grad),
            "memory_format": str(p.memory_format), "pin_memory": bool(p.pin_memory), "size": list(md.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}}
    parts: dict[str, list[Any]] = {}
    for index, loc in where.items():
        parts.setdefault(loc.part, []).append([index.fqn, None if index.offset is None else list(index.offset)])
    doc = {"format": FORMAT, "version": VERSION, "dcp_version": metadata.version, "state_dict_metadata": items,
           "planner_data": _planner_data_json(metadata.planner_data), "storage_data": parts,
           "modules": list(metadata.storage_meta.modules) if metadata.storage_meta else []}
    return json.dumps(doc, separators=(",", ":")).encode()


def _planner_data_json(data: Any) -> Any:
    """The default planners' ``planner_data``: None, or {fqn: path of str and int keys}."""
    if data is None:
        return None
    ok = isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, (tuple, list)) and all(type(x) in (str, int) for x in v)
        for k, v in data.items())
    if not ok:
        raise ValueError(f"ckptlib.dcp stores the planner_data of DCP's default planners ({{fqn: key path}}), "
                         f"not a {type(data).__name__} from a custom planner: save with the DefaultSavePlanner "
                         "or a subclass that keeps its planner_data")
    return {k: list(v) for k, v in data.items()}


def from_json(data: bytes, step: int, where: str) -> Metadata:
    """The ``Metadata`` that ``to_json`` wrote, its ``storage_data`` as {index: Location} of
    ``step``. ``where`` names the source in errors. CorruptCheckpoint for anything malformed."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"the DCP metadata of {where} is not JSON ({e})") from None
    r = _Reader(where)
    r.check(isinstance(doc, dict) and doc.get("format") == FORMAT, "format", "is not ckptlib's DCP metadata")
    r.check(doc.get("version") == VERSION, "version",
            f"is {doc.get('version')!r}; this ckptlib reads version {VERSION}: upgrade ckptlib")
    state = {fqn: r.storage(fqn, md) for fqn, md in r.mapping(doc.get("state_dict_metadata"), "state_dict_metadata")}
    planner = doc.get("planner_data")
    if planner is not None:
        planner = {k: tuple(r.keys(v, f"planner_data[{k!r}]")) for k, v in r.mapping(planner, "planner_data")}
    storage: dict[MetadataIndex, Location] = {}
    for part, items in r.mapping(doc.get("storage_data"), "storage_data"):
        for item in r.seq(items, f"storage_data[{part!r}]"):
            r.check(isinstance(item, list) and len(item) == 2 and isinstance(item[0], str), "storage_data",
                    f"holds {item!r}, not [fqn, offsets or null]")
            offset = None if item[1] is None else r.ints(item[1], f"storage_data {item[0]!r}")
            index = MetadataIndex(item[0], offset)
            storage[index] = Location(step, part, item_key(index))
    modules = [m for m in r.seq(doc.get("modules", []), "modules") if r.check(isinstance(m, str), "modules", "")]
    version = doc.get("dcp_version")
    r.check(version is None or isinstance(version, str), "dcp_version", f"is {version!r}")
    return Metadata(state, planner_data=planner, storage_data=storage, storage_meta=StorageMeta(modules=modules),
                    version=version)


class _Reader:
    """Checks of one document's fields; each failure is a CorruptCheckpoint naming the field."""

    def __init__(self, where: str):
        self.where = where

    def check(self, ok: bool, field: str, problem: str) -> bool:
        if not ok:
            raise CorruptCheckpoint(f"the DCP metadata of {self.where} is malformed: {field} {problem}")
        return True

    def mapping(self, value: Any, field: str) -> list[tuple[str, Any]]:
        self.check(isinstance(value, dict), field, "is not an object")
        return list(value.items())

    def seq(self, value: Any, field: str) -> list[Any]:
        self.check(isinstance(value, list), field, "is not a list")
        return value

    def ints(self, value: Any, field: str) -> list[int]:
        self.check(isinstance(value, list) and len(value) <= MAX_DIMS and all(
            type(x) is int and 0 <= x < 2**63 for x in value), field, f"is {value!r}, not a list of sizes")
        return value

    def keys(self, value: Any, field: str) -> list[str | int]:
        self.check(isinstance(value, list) and all(type(x) in (str, int) for x in value), field,
                   "is not a list of keys")
        return value

    def named(self, table: dict[str, Any], value: Any, field: str) -> Any:
        self.check(isinstance(value, str) and value in table, field, f"is {value!r}, which torch does not know")
        return table[value]

    def storage(self, fqn: str, md: Any) -> TensorStorageMetadata | BytesStorageMetadata:
        field = f"state_dict_metadata[{fqn!r}]"
        self.check(isinstance(md, dict) and len(md) == 1 and ("bytes" in md or "tensor" in md), field,
                   "is neither bytes nor a tensor")
        if "bytes" in md:
            return BytesStorageMetadata()
        t = md["tensor"]
        self.check(isinstance(t, dict), field, "is not an object")
        props = TensorProperties(
            dtype=self.named(_DTYPES, t.get("dtype"), f"{field}.dtype"),
            layout=self.named(_LAYOUTS, t.get("layout"), f"{field}.layout"),
            requires_grad=t.get("requires_grad") is True,
            memory_format=self.named(_FORMATS, t.get("memory_format"), f"{field}.memory_format"),
            pin_memory=t.get("pin_memory") is True)
        size = self.ints(t.get("size"), f"{field}.size")
        chunks = []
        for c in self.seq(t.get("chunks"), f"{field}.chunks"):
            self.check(isinstance(c, list) and len(c) == 2, f"{field}.chunks", f"holds {c!r}")
            offsets, sizes = self.ints(c[0], f"{field}.chunks"), self.ints(c[1], f"{field}.chunks")
            self.check(len(offsets) == len(sizes) == len(size) and all(
                o + s <= n for o, s, n in zip(offsets, sizes, size)), f"{field}.chunks",
                f"holds a chunk {c!r} outside the tensor's size {size}")
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        return TensorStorageMetadata(props, torch.Size(size), chunks)
