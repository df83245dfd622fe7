"""Compaction of the newest step: a copy of each of its delta-coded chunks, kept beside the stream.

A chunk whose blob is a delta restores through its chain (up to ``keyframe_every`` objects, each
fetched and applied). A writer made with ``Checkpointer(compact=True)`` writes, once a save has
committed and off the training path, a keyframe (raw bytes: a restore copies them) of every such
chunk of the new step from the raw bytes it holds anyway (its delta base), and a table that says,
per raw checksum, which object holds it. A restore of that step then reads one object per chunk
(docs/decisions.md 58).

The chain stays the truth, the table only a shortcut:

* the table says how to decode a chunk, nothing else: leaves, skeleton and checksums stay the
  committed fragment's, and a decoded chunk is checked against its checksum as any chunk is;
* a table is used only when all of it is well formed and it names the committed fragment (its
  digest); an entry only when its chunk is a delta-coded chunk of that fragment, its key has the
  pattern of a compaction object, its size is within the bound of its chunk and its codecs parse
  and need no base;
* anything missing, damaged or mismatching makes that chunk restore from its chain, with one
  warning per restore: a compaction can cost time, never data. ``verify`` reads the chains.

Store layout (docs/format.md, "Compaction"): ``compact/<step>/<part>.json`` (the table),
``compact/objects/<h2>/<h>`` (keyframes, content-addressed as blobs are: a chunk that did not change
since the last compaction is named again, not written again). A writer deletes the table it wrote
before, and the objects only that table named, once its next table is written; GC deletes tables
of steps it does not keep and tables a newer one of the same part supersedes, and objects no
remaining table names (``gc``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import codecs
from .errors import CorruptCheckpoint, ObjectNotFound, ObjectTooLarge, StoreError
from .manifest import Blob, Fragment, max_stored_bytes
from .store import Store
from .throttle import RateLimiter

log = logging.getLogger("ckptlib")

PREFIX = "compact"
OBJECT_KEY = re.compile(r"^compact/objects/([0-9a-f]{2})/\1[0-9a-f]{30}$")
TABLE_KEY = re.compile(r"^compact/(\d+)/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})\.json$")
FORMAT = 1
# a table's entry is about 250 bytes of JSON: a larger table than this is refused unread
_TABLE_BYTES_PER_CHUNK = 1024
_TABLE_SLACK = 4096


def table_key(step: int, part: str) -> str:
    return f"{PREFIX}/{step}/{part}.json"


def object_key(raw_digest: str, codec_configs: list[dict[str, Any]]) -> str:
    """Content-derived: the same chunk compacted the same way always lands on the same key."""
    ident = json.dumps(["compact", raw_digest, codec_configs], sort_keys=True, separators=(",", ":"))
    h = hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()
    return f"{PREFIX}/objects/{h[:2]}/{h}"


def delta_tops(fragment: Fragment) -> set[str]:
    """The raw checksums of the chunks of ``fragment`` that its leaves read and whose blobs are deltas."""
    return {digest for leaf in fragment.leaves for digest, *_ in leaf.segments()
            if (blob := fragment.blobs.get(digest)) is not None and blob.base is not None}


@dataclass(frozen=True)
class Table:
    """Which compaction object holds each compacted chunk of the fragment ``fragment`` (its digest)
    of ``part`` at ``step``. ``chunks``: raw checksum -> a keyframe blob (no base)."""

    step: int
    part: str
    fragment: str
    chunks: dict[str, Blob]

    @property
    def key(self) -> str:
        return table_key(self.step, self.part)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.step, "part": self.part, "fragment": self.fragment,
                "chunks": {d: {"key": b.key, "size": b.size, "codecs": list(b.codecs)} for d, b in self.chunks.items()}}

    @classmethod
    def parse(cls, doc: Any, fragment: Fragment, tops: set[str]) -> Table:
        """A table read from the store, checked against ``fragment`` (whose ``delta_tops`` are
        ``tops``) whole: ValueError naming what is wrong. One of another fragment of the same step
        and part (the step was dropped and committed again) is refused too."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"it is not a compaction table of format {FORMAT}")
        if doc.get("step") != fragment.step or doc.get("part") != fragment.part:
            raise ValueError(f"it names step {str(doc.get('step'))[:20]}, part {str(doc.get('part'))[:70]!r}")
        if doc.get("fragment") != fragment.digest:
            raise ValueError("it was written for another fragment of this step (committed again since?)")
        entries = doc.get("chunks")
        if not isinstance(entries, dict):
            raise ValueError("it has no chunk table")
        chunks = {digest: _entry(digest, entry, fragment, tops) for digest, entry in entries.items()}
        return cls(fragment.step, fragment.part, fragment.digest, chunks)


def _entry(digest: str, entry: Any, fragment: Fragment, tops: set[str]) -> Blob:
    if digest not in tops:
        raise ValueError(f"chunk {str(digest)[:40]} is not a delta-coded chunk of the fragment")
    if not isinstance(entry, dict) or set(entry) != {"key", "size", "codecs"}:
        raise ValueError(f"the entry of chunk {digest} is not {{key, size, codecs}}")
    key, size, configs = entry["key"], entry["size"], entry["codecs"]
    nbytes = fragment.blobs[digest].nbytes
    if not isinstance(key, str) or not OBJECT_KEY.match(key):
        raise ValueError(f"the object of chunk {digest}, {str(key)[:80]!r}, is not compact/objects/<h2>/<hash>")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= max_stored_bytes(nbytes):
        raise ValueError(f"the object of chunk {digest} has a size of {str(size)[:20]} for {nbytes} raw bytes")
    if not isinstance(configs, list) or not configs or not all(isinstance(c, dict) for c in configs):
        raise ValueError(f"the object of chunk {digest} has no codec list")
    try:
        chain = codecs.from_configs(configs)
    except CorruptCheckpoint as e:
        raise ValueError(f"the object of chunk {digest}: {e}") from None
    if any(c.uses_base for c in chain):
        raise ValueError(f"the object of chunk {digest} is coded as a delta; a compaction object is a keyframe")
    return Blob(key, size, nbytes, tuple(configs), None, 0)


def read_table(store: Store, fragment: Fragment) -> dict[str, Blob]:
    """The compacted chunks of ``fragment`` (raw checksum -> keyframe blob); {} when it has no
    delta-coded chunk, no table, or a table that is not usable whole (said in one warning)."""
    tops = delta_tops(fragment)
    if not tops:
        return {}
    key = table_key(fragment.step, fragment.part)
    try:
        data = store.get(key, max_bytes=_TABLE_BYTES_PER_CHUNK * len(tops) + _TABLE_SLACK)
        return Table.parse(json.loads(data), fragment, tops).chunks
    except ObjectNotFound:
        return {}
    except (ObjectTooLarge, StoreError, ValueError, UnicodeDecodeError, RecursionError) as e:
        # json.JSONDecodeError is a ValueError
        log.warning("ignoring the compaction table %s/%s (%s): restoring step %d from its delta chains",
                    store.url, key, e, fragment.step)
        return {}


def objects_named(store: Store, key: str) -> set[str]:
    """The compaction objects the table at ``key`` names (GC: what to keep). An unreadable or
    malformed table protects nothing; its own fragment is not read, only the keys' pattern checked."""
    try:
        doc = json.loads(store.get(key, max_bytes=64 << 20))
        entries = doc["chunks"] if isinstance(doc, dict) else {}
        return {e["key"] for e in entries.values()
                if isinstance(e, dict) and isinstance(e.get("key"), str) and OBJECT_KEY.match(e["key"])}
    except (ObjectNotFound, ObjectTooLarge, StoreError, ValueError, KeyError, TypeError, AttributeError,
            UnicodeDecodeError, RecursionError):
        return set()


class Compactor:
    """A writer's compactions of one part: ``run`` writes the new step's table, reusing what the
    last one wrote, then deletes what only the last one named. One run at a time (the writer's
    persisting thread); ``stop`` ends a run between two chunks (the next save is about to write
    over the raw bytes it reads). The copies are raw: a restore copies them (docs/decisions.md 58)."""

    def __init__(self, store: Store, pool: Executor, limiter: RateLimiter):
        self.store, self.pool, self.limiter = store, pool, limiter
        self.stop = threading.Event()
        self.bytes_written = 0  # objects and tables written, over this writer's life
        self.seconds = 0.0  # spent in runs, over this writer's life
        self._last: Table | None = None  # the table this writer wrote last (in the store)
        self._unnamed: dict[str, Blob] = {}  # objects a stopped run wrote that no table names yet

    def run(self, fragment: Fragment, raw: Mapping[str, np.ndarray]) -> Table | None:
        """Compact ``fragment`` (committed) from ``raw`` (raw chunk bytes by checksum; a chunk it
        lacks, or whose bytes do not match their checksum, is left to its chain). Returns the table
        written, or None when stopped or when there was nothing to compact."""
        t0 = time.perf_counter()
        try:
            return self._run(fragment, raw)
        finally:
            self.seconds += time.perf_counter() - t0

    def _run(self, fragment: Fragment, raw: Mapping[str, np.ndarray]) -> Table | None:
        tops = delta_tops(fragment)
        written = {**self._unnamed, **(self._last.chunks if self._last is not None else {})}

        def one(digest: str) -> tuple[str, Blob] | None:
            if self.stop.is_set():
                return None
            if digest in written:
                return digest, written[digest]
            data = raw.get(digest)
            if data is None or data.nbytes != fragment.blobs[digest].nbytes or codecs.checksum(data) != digest:
                return None
            configs = [codecs.Raw().to_config()]
            blob = Blob(object_key(digest, configs), data.nbytes, data.nbytes, tuple(configs), None, 0)
            self.limiter.acquire(data.nbytes)
            self.store.put(blob.key, np.ascontiguousarray(data).data)
            return digest, blob

        done = dict(r for r in self.pool.map(one, tops) if r is not None)
        fresh = {d: b for d, b in done.items() if d not in written}
        self.bytes_written += sum(b.size for b in fresh.values())
        if self.stop.is_set():
            self._unnamed.update(fresh)
            return None
        if not done:
            return None
        table = Table(fragment.step, fragment.part, fragment.digest, done)
        doc = json.dumps(table.to_json(), separators=(",", ":")).encode()
        self.store.put(table.key, doc)
        self.bytes_written += len(doc)
        named = {b.key for b in done.values()}
        old, self._last, self._unnamed = self._last, table, {}
        if old is not None and old.key != table.key:
            self.store.delete(old.key)
        for key in {b.key for b in written.values()} - named:
            self.store.delete(key)
        return table
