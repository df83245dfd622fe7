"""The checkpointer's messages between ranks, as JSON: a closed set of types, nothing executed.

What travels (``Collective``): None, bools, numbers, strings, tuples of these, and the types of
``_TYPES``: ``RemoteError`` and ``Outcome`` (defined here), a save's ``plan.Summary``, the leader's
``Manifest`` or ``GroupFragment``. Each is ``{"type": <its name>, "value": <its to_json()>}``; a
value of any other type is refused when sent (TypeError: a bug of ckptlib, not of a peer).

A message received is parsed by ``json.loads`` and rebuilt by the strict parsers of the types in
the table, looked up by name; an error's class comes from a fixed table too (``error_classes``),
never imported by a name a peer sent. Anything else (not JSON, an unknown type, a field of the
wrong type, nesting deeper than ``MAX_DEPTH``) is ``BadMessage``, naming what was wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..errors import CheckpointError
from ..manifest import MAX_MANIFEST_BYTES, Manifest
from .documents import GroupFragment
from .plan import Summary

__all__ = ["MAX_MESSAGE_BYTES", "BadMessage", "GroupFailed", "Outcome", "RemoteError", "decode", "encode",
           "error_classes"]

# the largest message: a save's outcome carries the leader's manifest, which embeds the group fragment
MAX_MESSAGE_BYTES = MAX_MANIFEST_BYTES + (1 << 20)
MAX_DEPTH = 8  # an Outcome holding a tuple holding a Manifest is 3 deep
_SCALARS = (bool, int, float, str)
_BUILTIN_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError}


class BadMessage(CheckpointError, ValueError):
    """A message that is not one of the checkpointer's (its cause named); ``Collective`` raises it as
    ``GroupFailed``."""


# Defined here, not in `collective` (which raises it and re-exports it), because it crosses ranks as
# itself (`error_classes`): the channel imports its messages, never the other way round.
class GroupFailed(CheckpointError):
    """A rank of the checkpoint's process group died, hung or left during a collective call."""


def error_classes() -> dict[str, type[CheckpointError]]:
    """The error classes that cross ranks as themselves: ckptlib.errors', DocumentError, GroupFailed."""
    from ..documents import DocumentError

    found = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, CheckpointError)]
    return {c.__name__: c for c in [*found, DocumentError, GroupFailed]}


@dataclass(frozen=True)
class RemoteError:
    """An error one rank met, as it travels to the others: its class name, message, rank and, for a
    ckptlib error, its constructor's fields (``CheckpointError.fields``)."""

    rank: int
    kind: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, rank: int, e: BaseException) -> RemoteError:
        return cls(rank, type(e).__name__, str(e), e.fields() if isinstance(e, CheckpointError) else {})

    def exception(self) -> BaseException:
        """The error to raise on every rank: the same class with the same fields when it is one of
        ``error_classes`` (the message prefixed by the rank), else CheckpointError naming the class;
        ValueError/TypeError/KeyError (a state that does not match) stay what they are."""
        text = f"rank {self.rank}: {self.message}"
        cls = error_classes().get(self.kind)
        if cls is not None:
            try:
                return cls.rebuild(text, self.fields)
            except (KeyError, TypeError) as e:  # a peer of another ckptlib version
                return CheckpointError(f"{text} ({self.kind}, whose fields {str(self.fields)[:200]} do not fit it: {e})")
        if self.kind in _BUILTIN_ERRORS:
            return _BUILTIN_ERRORS[self.kind](text)
        return CheckpointError(f"{text} ({self.kind})")

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "kind": self.kind, "message": self.message, "fields": self.fields}

    @classmethod
    def from_json(cls, d: Any) -> RemoteError:
        fields = d["fields"]
        if not (isinstance(fields, dict) and all(v is None or isinstance(v, _SCALARS) for v in fields.values())):
            raise TypeError("an error's fields must be an object of JSON scalars")
        return cls(_of(d["rank"], int), _of(d["kind"], str), _of(d["message"], str), fields)


@dataclass(frozen=True)
class Outcome:
    """What one exchange gives every rank: a value, or the error of the first rank that failed."""

    value: Any = None
    error: RemoteError | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error.exception()
        return self.value

    def to_json(self) -> dict[str, Any]:
        return {"value": _dump(self.value), "error": None if self.error is None else self.error.to_json()}

    @classmethod
    def from_json(cls, d: Any, depth: int = 0) -> Outcome:
        error = d["error"]
        return cls(_load(d["value"], depth + 1), None if error is None else RemoteError.from_json(error))


_TYPES: dict[str, Any] = {c.__name__: c for c in (RemoteError, Outcome, Summary, Manifest, GroupFragment)}


def encode(value: Any) -> bytes:
    """The message's bytes (TypeError for a value outside the closed set)."""
    return json.dumps(_dump(value), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The message ``data`` held; BadMessage when it is not one of ours."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"it is {len(data)} bytes, more than the {MAX_MESSAGE_BYTES} of any message")
    try:
        return _load(json.loads(data), 0)
    except BadMessage:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
        # ValueError includes a JSON or UTF-8 error and a document's own refusal (CorruptCheckpoint is not one)
        raise BadMessage(f"{type(e).__name__}: {str(e)[:200]}") from None
    except CheckpointError as e:  # a manifest or group fragment that does not parse
        raise BadMessage(f"{type(e).__name__}: {str(e)[:200]}") from None


def _dump(v: Any) -> Any:
    if v is None or isinstance(v, _SCALARS):
        return v
    if isinstance(v, tuple):
        return {"type": "tuple", "value": [_dump(x) for x in v]}
    cls = _TYPES.get(type(v).__name__)
    if cls is not type(v):
        raise TypeError(f"a {type(v).__name__} cannot travel between ranks (ckptlib.distributed.wire lists what can)")
    return {"type": cls.__name__, "value": v.to_json()}


def _load(v: Any, depth: int) -> Any:
    if v is None or isinstance(v, _SCALARS):
        return v
    if depth >= MAX_DEPTH:
        raise BadMessage(f"it nests deeper than {MAX_DEPTH} values")
    if not (isinstance(v, dict) and set(v) == {"type", "value"} and isinstance(v["type"], str)):
        raise BadMessage(f"a {type(v).__name__} where a value or {{type, value}} was expected")
    kind, value = v["type"], v["value"]
    if kind == "tuple":
        return tuple(_load(x, depth + 1) for x in _of(value, list))
    cls = _TYPES.get(kind)
    if cls is None:
        raise BadMessage(f"unknown type {kind[:40]!r}")
    if not isinstance(value, dict):
        raise BadMessage(f"a {kind} that is not an object")
    return cls.from_json(value, depth) if cls is Outcome else cls.from_json(value)


def _of(v: Any, kind: type) -> Any:
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise TypeError(f"{type(v).__name__} where {kind.__name__} was expected")
    return v
