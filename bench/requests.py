"""Counting store requests: ``RecordingStore`` wraps any store and counts what passes through it.

Every operation of a ``WrapperStore`` passes through ``_forward(op, key, *args)``; this one counts
it by operation and by the key's top folder (``chunks``, ``fragments``, ``manifests``, ...), with
the bytes written and read. A listing counts as the S3 requests it costs: one per page of 1,000
keys (``LIST_PAGE``), at least one. Thread-safe; children (``store.child(...)``) count into the
same tally. ``RequestCounts`` is a plain snapshot that pickles (a Dask task returns its own).

    rec = RecordingStore(Store.from_url(url))
    ck = Checkpointer(rec)
    ...
    print(rec.counts.total, rec.counts.by_op)
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptlib.store import ObjectInfo, Store, WrapperStore

LIST_PAGE = 1000  # keys per S3 ListObjectsV2 page
S3_VERB = {"get": "GET", "put": "PUT", "put_if_absent": "PUT", "exists": "HEAD", "modified": "HEAD",
           "delete": "DELETE", "scan": "LIST", "list": "LIST", "list_dirs": "LIST"}


@dataclass
class RequestCounts:
    """Requests by operation, by S3 verb and by top folder; bytes put (new objects only for
    put_if_absent) and got; objects created."""

    by_op: Counter = field(default_factory=Counter)
    by_verb: Counter = field(default_factory=Counter)
    by_folder: Counter = field(default_factory=Counter)
    bytes_put: int = 0
    bytes_got: int = 0
    created: Counter = field(default_factory=Counter)  # new objects by top folder

    @property
    def total(self) -> int:
        return sum(self.by_verb.values())

    def __add__(self, other: RequestCounts) -> RequestCounts:
        return RequestCounts(self.by_op + other.by_op, self.by_verb + other.by_verb,
                             self.by_folder + other.by_folder, self.bytes_put + other.bytes_put,
                             self.bytes_got + other.bytes_got, self.created + other.created)

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "by_verb": dict(self.by_verb), "by_op": dict(self.by_op),
                "by_folder": dict(self.by_folder), "bytes_put": self.bytes_put, "bytes_got": self.bytes_got,
                "created": dict(self.created)}


def folder_of(key: str) -> str:
    return key.split("/", 1)[0] if key else "(root)"


class _Tally:
    """The counts a store and its children share."""

    def __init__(self) -> None:
        self.counts = RequestCounts()
        self.lock = threading.Lock()


class RecordingStore(WrapperStore):
    """A view of ``inner`` that counts every request (see the module docstring)."""

    def __init__(self, inner: Store, *, _tally: _Tally | None = None):
        super().__init__(inner)
        self._tally = _tally or _Tally()

    @property
    def counts(self) -> RequestCounts:
        """A snapshot of the counts so far."""
        with self._tally.lock:
            return RequestCounts() + self._tally.counts

    def reset(self) -> RequestCounts:
        """The counts so far; the tally starts again from zero."""
        with self._tally.lock:
            snap, self._tally.counts = self._tally.counts, RequestCounts()
        return snap

    def _count(self, op: str, key: str, requests: int = 1, put: int = 0, got: int = 0, created: bool = False) -> None:
        with self._tally.lock:
            c = self._tally.counts
            c.by_op[op] += 1
            c.by_verb[S3_VERB[op]] += requests
            c.by_folder[folder_of(key)] += requests
            c.bytes_put += put
            c.bytes_got += got
            if created:
                c.created[folder_of(key)] += 1

    def _forward(self, op: str, key: str, *args: Any) -> Any:
        out = getattr(self.inner, op)(key, *args)
        if op in ("list", "list_dirs"):
            self._count(op, key, max(1, math.ceil(len(out) / LIST_PAGE)))
        elif op == "get":
            self._count(op, key, got=len(out))
        elif op == "put":
            self._count(op, key, put=len(args[0]), created=True)
        elif op == "put_if_absent":
            self._count(op, key, put=len(args[0]) if out else 0, created=bool(out))
        elif op != "scan":
            self._count(op, key)
        return out

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        n = 0
        try:
            for info in self.inner.scan(prefix):
                n += 1
                yield info
        finally:
            self._count("scan", prefix, max(1, math.ceil(n / LIST_PAGE)))

    def copy_from(self, source: Store, key: str) -> bool:
        return self.put_if_absent(key, source.get(key))

    def _wrap_child(self, inner_child: Store) -> Store:
        return RecordingStore(inner_child, _tally=self._tally)
