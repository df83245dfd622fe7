"""Every error ckptlib raises on purpose. Each message names the cause and the fix."""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class: anything ckptlib refuses or cannot do.

    An error crosses ranks (``ckptlib.distributed.wire``) as its class name, its message and its
    ``fields()``: JSON values that ``rebuild`` turns back into the same class with the same fields."""

    def fields(self) -> dict[str, Any]:
        """The constructor's arguments beyond the message (JSON values)."""
        return {}

    @classmethod
    def rebuild(cls, message: str, fields: dict[str, Any]) -> CheckpointError:
        """The error ``fields()`` described, saying ``message``; TypeError/KeyError for fields that do not fit."""
        return cls(message)


class StoreError(CheckpointError):
    """The storage backend cannot be reached or used (URL, bucket, credentials, network)."""


class ObjectNotFound(StoreError, KeyError):
    """A key that should exist in the store does not."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "object not found"


class CorruptCheckpoint(CheckpointError):
    """Stored bytes fail a checksum, do not decode, or a manifest is malformed."""


class Damaged(CorruptCheckpoint):
    """A stored object is missing or does not decode to its checksum (``key``: which object)."""

    def __init__(self, key: str | None, reason: str):
        super().__init__(f"object {key} {reason}" if key else reason)
        self.key, self.reason = key, reason

    def __reduce__(self) -> tuple:  # pickles (across processes, e.g. a task's error) with its fields
        return type(self), (self.key, self.reason)

    def fields(self) -> dict[str, Any]:
        return {"key": self.key, "reason": self.reason}

    @classmethod
    def rebuild(cls, message: str, fields: dict[str, Any]) -> Damaged:
        e = cls(_typed(fields, "key", str, None), _typed(fields, "reason", str))
        e.args = (message,)
        return e


class DamagedStep(CorruptCheckpoint):
    """A committed step whose manifest (or a fragment it names) cannot be read: ``step``, and
    ``reason``, what is wrong (the message adds what to do)."""

    def __init__(self, message: str, step: int, reason: str):
        super().__init__(message)
        self.step, self.reason = step, reason

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.step, self.reason)

    def fields(self) -> dict[str, Any]:
        return {"step": self.step, "reason": self.reason}

    @classmethod
    def rebuild(cls, message: str, fields: dict[str, Any]) -> DamagedStep:
        return cls(message, _typed(fields, "step", int), _typed(fields, "reason", str))


class ObjectTooLarge(CorruptCheckpoint):
    """A stored object is larger than any its kind ckptlib writes (``Store.get(key, max_bytes=)``):
    refused before it is read whole (``size``: its size when the store could tell, else None)."""

    def __init__(self, where: str, size: int | None, cap: int):
        shown = f"{size} bytes" if size is not None else f"more than {cap} bytes"
        super().__init__(f"{where} is {shown}, more than the {cap} bytes a reader of it accepts: it was not "
                         "written by ckptlib (a damaged or planted object); it was refused unread")
        self.where, self.size, self.cap = where, size, cap

    def __reduce__(self) -> tuple:
        return type(self), (self.where, self.size, self.cap)

    def fields(self) -> dict[str, Any]:
        return {"where": self.where, "size": self.size, "cap": self.cap}

    @classmethod
    def rebuild(cls, message: str, fields: dict[str, Any]) -> ObjectTooLarge:
        e = cls(_typed(fields, "where", str), _typed(fields, "size", int, None), _typed(fields, "cap", int))
        e.args = (message,)
        return e


class FormatVersionError(CheckpointError):
    """A manifest written by a format this version cannot read."""


class UnsupportedState(CheckpointError, TypeError):
    """The state handed to save() holds a value the format cannot represent."""


class CommitConflict(CheckpointError):
    """The step is already committed with a different digest."""


class FencedError(CheckpointError):
    """This writer's generation is no longer live: a newer attempt owns the shard."""


class NoCheckpoint(CheckpointError, LookupError):
    """No committed (or healthy) checkpoint matches the request."""


def _typed(fields: dict[str, Any], name: str, *kinds: type | None) -> Any:
    """``fields[name]``, checked to be one of ``kinds`` (None: null); KeyError/TypeError otherwise."""
    value = fields[name]
    if not any(value is None if k is None else isinstance(value, k) and not isinstance(value, bool) for k in kinds):
        raise TypeError(f"field {name!r} is {type(value).__name__}, not {' or '.join(k.__name__ if k else 'null' for k in kinds)}")
    return value
