"""Typed JSON documents: frozen dataclasses whose annotated fields are the schema, written once.

A document class is a frozen dataclass that also derives from ``Document``::

    @dataclass(frozen=True)
    class Beat(Document):
        KIND = "heartbeat"            # the name errors use
        FORMAT = 1                    # written as "format" and checked on read (None: no format field)
        part: str
        time: float
        loss: float | None = None

    Beat("shard-0", 12.5).to_json()   # b'{"format": 1, "part": "shard-0", "time": 12.5, "loss": null}'
    Beat.from_json(data, where="s3://b/run/heartbeats/shard-0.json")
    Beat.read(store, "heartbeats/shard-0.json")   # a bounded read of the store, then from_json
    Beat.json_schema()                # JSON Schema of the same fields

Guarantees
----------
* Parsing is strict: bytes that are not JSON, a missing field without a default, a value of the
  wrong type or another format raise ``DocumentError`` naming the document, where it was read, the
  field and what was found. Never a KeyError or a TypeError from deep inside a caller.
* Unknown fields are ignored: a newer writer may add some. A change of meaning bumps ``FORMAT``.
* Bounded: a kind's ``MAX_BYTES`` (1 MiB unless it says otherwise) caps what ``from_json`` parses,
  and ``read`` refuses a larger stored document before reading it whole (``Store.get(key,
  max_bytes=)``): ``DocumentError`` naming the object, its size and the cap.
* ``to_json`` then ``from_json`` gives an equal object (tuples stay tuples).

Field types understood: ``bool``, ``int``, ``float`` (an int is accepted), ``str``, ``None``,
``Literal[...]``, unions (``X | None``), ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``, ``Any`` (any
JSON value), other ``Document`` classes, and pydantic models (validated with ``model_validate``).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, ClassVar, Literal, TypeVar, Union

from .errors import CorruptCheckpoint

D = TypeVar("D", bound="Document")

__all__ = ["Document", "DocumentError"]


class DocumentError(CorruptCheckpoint, ValueError):
    """A JSON document is malformed: not JSON, a field missing, a value of the wrong type, another format."""


class Document:
    """Mixin of frozen dataclasses that are JSON documents (see the module docstring)."""

    KIND: ClassVar[str] = "document"
    FORMAT: ClassVar[int | None] = None
    MAX_BYTES: ClassVar[int] = 1 << 20  # the largest document of this kind a reader accepts

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.FORMAT is None else {"format": self.FORMAT}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = _dump(getattr(self, f.name))
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_dict(cls: type[D], data: Any, where: str = "") -> D:
        at = f" at {where}" if where else ""
        if not isinstance(data, dict):
            raise DocumentError(f"{cls.KIND} document{at} must be a JSON object, got {_show(data)}")
        if cls.FORMAT is not None and data.get("format") != cls.FORMAT:
            raise DocumentError(f"{cls.KIND} document{at} has format {data.get('format')!r}; this version reads "
                                f"format {cls.FORMAT}: it was written by another version of the writer")
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name in data:
                values[f.name] = _parse(hints[f.name], data[f.name], f"{cls.KIND} document{at}", f.name)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise DocumentError(f"{cls.KIND} document{at} lacks the field '{f.name}'")
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:  # a __post_init__ that refuses the values
            raise DocumentError(f"{cls.KIND} document{at} is inconsistent: {e}") from None

    @classmethod
    def read(cls: type[D], store: Any, key: str) -> D:
        """The document under ``key`` of ``store`` (a ``ckptlib.store.Store``), read with this kind's
        cap. ObjectNotFound when there is none; DocumentError when it is larger or malformed."""
        from .errors import ObjectTooLarge

        try:
            data = store.get(key, max_bytes=cls.MAX_BYTES)
        except ObjectTooLarge as e:
            raise DocumentError(f"{cls.KIND} document {e}") from None
        return cls.from_json(data, f"{store.url}/{key}")

    @classmethod
    def from_json(cls: type[D], data: bytes | str, where: str = "") -> D:
        if len(data) > cls.MAX_BYTES:
            at = f" at {where}" if where else ""
            raise DocumentError(f"{cls.KIND} document{at} is {len(data)} bytes, more than the {cls.MAX_BYTES} a reader "
                                "accepts: it was not written by ckptlib")
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            at = f" at {where}" if where else ""
            raise DocumentError(f"{cls.KIND} document{at} is not JSON ({type(e).__name__}: {e})") from None
        return cls.from_dict(doc, where)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        hints = _hints(cls)
        props: dict[str, Any] = {} if cls.FORMAT is None else {"format": {"const": cls.FORMAT}}
        required = [] if cls.FORMAT is None else ["format"]
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            props[f.name] = _schema(hints[f.name])
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
        return {"title": cls.__name__, "type": "object", "properties": props, "required": required}


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _dump(v: Any) -> Any:
    if isinstance(v, Document):
        return v.to_dict()
    if hasattr(v, "model_dump") and not isinstance(v, type):
        return v.model_dump(mode="json")
    if isinstance(v, (list, tuple)):
        return [_dump(x) for x in v]
    if isinstance(v, dict):
        return {k: _dump(x) for k, x in v.items()}
    return v


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


class _Mismatch(Exception):
    pass


def _parse(tp: Any, v: Any, doc: str, path: str) -> Any:
    try:
        return _convert(tp, v, path)
    except _Mismatch as e:
        field, expected, got = e.args
        raise DocumentError(f"{doc}: field '{field}' must be {expected}, got {_show(got)}") from None


def _convert(tp: Any, v: Any, path: str) -> Any:  # noqa: C901 - one branch per kind of type
    if tp is Any:
        return v
    if tp is type(None) or tp is None:
        if v is not None:
            raise _Mismatch(path, "null", v)
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        arms = [a for a in args if a is not type(None)]
        if v is None and len(arms) < len(args):
            return None
        if len(arms) == 1:  # X | None holding a value: X's own message says what is wrong inside it
            return _convert(arms[0], v, path)
        for arm in arms:
            try:
                return _convert(arm, v, path)
            except _Mismatch:
                continue
        raise _Mismatch(path, _describe(tp), v)
    if origin is Literal:
        if not any(type(v) is type(a) and v == a for a in args):
            raise _Mismatch(path, _describe(tp), v)
        return v
    if tp is bool:
        if not isinstance(v, bool):
            raise _Mismatch(path, "true or false", v)
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Mismatch(path, "an integer", v)
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Mismatch(path, "a number", v)
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise _Mismatch(path, "a string", v)
        return v
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(v, (list, tuple)):
            raise _Mismatch(path, _describe(tp), v)
        item = args[0] if args else Any
        out = [_convert(item, x, f"{path}[{i}]") for i, x in enumerate(v)]
        return tuple(out) if (origin or tp) is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise _Mismatch(path, _describe(tp), v)
        item = args[1] if len(args) == 2 else Any
        return {k: _convert(item, x, f"{path}.{k}") for k, x in v.items()}
    if isinstance(tp, type) and issubclass(tp, Document):
        if not isinstance(v, dict):
            raise _Mismatch(path, f"an object ({tp.KIND})", v)
        try:
            return tp.from_dict(v)
        except DocumentError as e:
            raise _Mismatch(path, f"a valid {tp.KIND} ({e})", v) from None
    if isinstance(tp, type) and hasattr(tp, "model_validate"):  # a pydantic model
        try:
            return tp.model_validate(v)
        except ValueError as e:
            first = str(e).splitlines()
            raise _Mismatch(path, f"a valid {tp.__name__} ({'; '.join(first[1:3]) or e})", v) from None
    raise TypeError(f"field '{path}': a document cannot hold type {tp!r}")  # a bug in the class, not the data


def _describe(tp: Any) -> str:
    if _is_union(tp):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if tp in names:
        return names[tp]
    origin = typing.get_origin(tp) or tp
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "an object"
    return getattr(tp, "__name__", str(tp))


def _schema(tp: Any) -> dict[str, Any]:  # noqa: C901
    if tp is Any:
        return {}
    if tp is type(None):
        return {"type": "null"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(tp):
        return {"anyOf": [_schema(a) for a in args]}
    if origin is Literal:
        return {"enum": list(args)}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    if origin in (list, tuple) or tp in (list, tuple):
        return {"type": "array", "items": _schema(args[0]) if args else {}}
    if origin is dict or tp is dict:
        return {"type": "object", "additionalProperties": _schema(args[1]) if len(args) == 2 else {}}
    if isinstance(tp, type) and issubclass(tp, Document):
        return tp.json_schema()
    if isinstance(tp, type) and hasattr(tp, "model_json_schema"):
        return tp.model_json_schema()
    raise TypeError(f"a document cannot hold type {tp!r}")
