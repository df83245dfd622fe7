"""Restore one part of a checkpoint: fetch chunks in parallel, resolve delta chains, verify, rebuild.

Called by ``Checkpointer`` (restore, verify). Contract:

* Every chunk is decoded straight into the memory of the leaf it belongs to; a delta chain is
  resolved keyframe-first, and a chunk that several chains share (deduplicated content) is fetched
  and decoded once per restore.
* Every decoded chunk is checked against its raw checksum; a missing, truncated or altered object
  raises ``CorruptCheckpoint`` naming the step, part, tensor, chunk index and object key.
* Nothing is ever written to the store.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import codecs
from .chunking import chunk_ranges
from .errors import CorruptCheckpoint, ObjectNotFound
from .manifest import Blob, Fragment, part_digest
from .store import Store
from .tree import empty_leaf, finish_leaf, unflatten


@dataclass(frozen=True)
class Problem:
    """One integrity failure: where it is and why."""

    step: int
    part: str
    tensor: str
    chunk: int | None
    key: str | None
    reason: str

    def __str__(self) -> str:
        where = f"step {self.step}, part '{self.part}', tensor '{self.tensor}'"
        if self.chunk is not None:
            where += f", chunk {self.chunk}" + (f" (object {self.key})" if self.key else "")
        return f"{where}: {self.reason}"


class _Damaged(CorruptCheckpoint):
    """A stored object is missing or does not decode to its checksum; ``key`` names it."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"object {key} {reason}")
        self.key = key


class _ChainDecoder:
    """Decodes chunks by checksum into destination memory: the keyframe first, then every delta
    of the chain applied in place. Chunks that several chains share are kept after their first
    decode, so a shared base is fetched and decoded once per restore.

    Only the top of a chain is checked against its checksum (it covers every link below it);
    when it does not match, the chain is walked again link by link to name the damaged object.
    """

    def __init__(self, fragment: Fragment, store: Store, known: Mapping[str, np.ndarray] | None = None):
        self.fragment, self.store = fragment, store
        uses: Counter[str] = Counter()
        for leaf in fragment.leaves:
            for digest in leaf.chunks:
                d: str | None = digest
                while d is not None and d in fragment.blobs and uses[d] < 2:
                    uses[d] += 1
                    d = fragment.blobs[d].base
        self._shared = {d for d, n in uses.items() if n > 1}
        # raw bytes by checksum: chunks the caller already holds, then shared chunks as decoded
        self._cache: dict[str, np.ndarray] = dict(known or {})
        self._lock = threading.Lock()

    def _blob(self, digest: str) -> Blob:
        blob = self.fragment.blobs.get(digest)
        if blob is None:
            raise CorruptCheckpoint(f"chunk {digest} is not in the blob table")
        return blob

    def _payload(self, blob: Blob) -> np.ndarray:
        try:
            payload = np.frombuffer(self.store.get(blob.key), dtype=np.uint8)
        except ObjectNotFound:
            raise _Damaged(blob.key, "is missing from the store") from None
        if payload.nbytes != blob.size:
            raise _Damaged(blob.key, f"has {payload.nbytes} bytes, the manifest says {blob.size} (truncated?)")
        return payload

    def _apply(self, blob: Blob, out: np.ndarray) -> None:
        """Decode ``blob`` into ``out`` (which holds its base's bytes when it is a delta)."""
        payload = self._payload(blob)
        if blob.nbytes != out.nbytes:
            raise _Damaged(blob.key, f"decodes to {blob.nbytes} bytes, the chunk has {out.nbytes}")
        try:
            codecs.decode_into(payload, codecs.from_configs(list(blob.codecs)), out)
        except CorruptCheckpoint as e:
            raise _Damaged(blob.key, f"does not decode: {e}") from None

    def fill(self, digest: str, out: np.ndarray) -> None:
        """Write the raw bytes of chunk ``digest`` into ``out``, checked against the digest."""
        chain: list[tuple[str, Blob]] = []  # top first, down to a keyframe or a chunk decoded before
        d: str | None = digest
        while d is not None and d not in self._cache:
            chain.append((d, self._blob(d)))
            d = chain[-1][1].base
        if d is not None:
            start = self._cache[d]
            if start.nbytes != out.nbytes:
                raise CorruptCheckpoint(f"chunk {d} holds {start.nbytes} bytes where {out.nbytes} are expected")
            out[:] = start
        for link, blob in reversed(chain):
            self._apply(blob, out)
            if link in self._shared and link not in self._cache:
                with self._lock:
                    self._cache[link] = out.copy()
        if codecs.checksum(out) != digest:
            self._locate(digest, out.nbytes)

    def _locate(self, digest: str, nbytes: int) -> None:
        chain: list[tuple[str, Blob]] = []
        d: str | None = digest
        while d is not None:
            chain.append((d, self._blob(d)))
            d = chain[-1][1].base
        work = np.empty(nbytes, dtype=np.uint8)
        for d, blob in reversed(chain):
            self._apply(blob, work)
            if codecs.checksum(work) != d:
                raise _Damaged(blob.key, "decodes to bytes whose checksum does not match")
        raise CorruptCheckpoint(f"chunk {digest} does not match its checksum")  # not reproducible: flaky storage


def _decode_into(fragment: Fragment, store: Store, pool: Executor, raws: list[np.ndarray],
                 copies: list[np.ndarray] | None = None, known: Mapping[str, np.ndarray] | None = None) -> list[Problem]:
    """Fill every leaf's raw memory (and ``copies``, chunk by chunk while the bytes are in cache);
    return the problems met (empty when all is intact)."""
    decoder = _ChainDecoder(fragment, store, known)
    jobs = [(li, ci, a, b) for li, leaf in enumerate(fragment.leaves)
            for ci, (a, b) in enumerate(chunk_ranges(leaf.spec.nbytes, leaf.chunk_bytes))]

    def fill(job) -> Problem | None:
        li, ci, start, stop = job
        leaf = fragment.leaves[li]
        digest = leaf.chunks[ci] if ci < len(leaf.chunks) else None
        try:
            if digest is None:
                raise CorruptCheckpoint(f"the chunk list has {len(leaf.chunks)} entries, the tensor needs more")
            decoder.fill(digest, raws[li][start:stop])
            if copies is not None:
                copies[li][start:stop] = raws[li][start:stop]
        except CorruptCheckpoint as e:
            blob = fragment.blobs.get(digest) if digest else None
            key = getattr(e, "key", None) or (blob.key if blob else None)
            reason = str(e).removeprefix(f"object {key} ") if key else str(e)
            return Problem(fragment.step, fragment.part, leaf.spec.path, ci, key, reason)
        return None

    return [p for p in pool.map(fill, jobs) if p is not None]


def _decode_all(fragment: Fragment, store: Store, pool: Executor, copies: list[np.ndarray] | None = None,
                known: Mapping[str, np.ndarray] | None = None) -> tuple[list[Any], list[np.ndarray], list[Problem]]:
    """New leaf objects for every leaf, filled from the store: (objects, their raw views, problems)."""
    objects, raws = [], []
    for leaf in fragment.leaves:
        obj, raw = empty_leaf(leaf.spec)
        objects.append(obj)
        raws.append(raw)
    return objects, raws, _decode_into(fragment, store, pool, raws, copies, known)


def restore_part(
    fragment: Fragment, store: Store, pool: Executor, *, device: str | torch.device = "cpu", copy: bool = False,
    known: Mapping[str, np.ndarray] | None = None,
) -> tuple[Any, list[np.ndarray] | None]:
    """(state, None), or with ``copy`` (state, a private copy of every leaf's raw bytes in flatten
    order: the delta base of a writer that continues from this state). Raises CorruptCheckpoint.

    ``known``: raw chunks the caller already holds, by checksum (e.g. the previous step it
    restored): a chain stops there, so following a stream of checkpoints decodes one link per
    changed chunk instead of whole chains. They are trusted as given (the result is still checked)."""
    copies = [np.empty(leaf.spec.nbytes, dtype=np.uint8) for leaf in fragment.leaves] if copy else None
    objects, _, problems = _decode_all(fragment, store, pool, copies, known)
    if problems:
        more = f" (and {len(problems) - 1} more problems; run `ckpt verify` for all)" if len(problems) > 1 else ""
        raise CorruptCheckpoint(f"{problems[0]}{more}")
    leaves = [finish_leaf(obj, leaf.spec, device) for obj, leaf in zip(objects, fragment.leaves)]
    return unflatten(fragment.skeleton, leaves), copies


def verify_part(fragment: Fragment, store: Store, pool: Executor) -> list[Problem]:
    """Decode everything and check every checksum and digest; report all problems, raise none."""
    return inspect_part(fragment, store, pool)[1]


def inspect_part(fragment: Fragment, store: Store, pool: Executor) -> tuple[list[Any], list[Problem]]:
    """``verify_part`` that also keeps what it decoded, for validation: one pass over the chunks.

    Returns (leaves, problems): the finished CPU leaf object of every intact leaf in flatten order
    (None for a leaf with a problem) and every problem found. Raises none for corruption.
    """
    objects, raws, problems = _decode_all(fragment, store, pool)
    bad_tensors = {p.tensor for p in problems}
    for leaf, raw in zip(fragment.leaves, raws):
        if leaf.spec.path not in bad_tensors and codecs.checksum(raw) != leaf.digest:
            problems.append(Problem(fragment.step, fragment.part, leaf.spec.path, None, None,
                                    "tensor digest does not match the manifest"))
    if not problems and part_digest(fragment.skeleton, list(fragment.leaves)) != fragment.digest:
        problems.append(Problem(fragment.step, fragment.part, "/", None, None,
                                "logical digest does not match the manifest"))
    bad_tensors = {p.tensor for p in problems}
    leaves = [None if leaf.spec.path in bad_tensors else finish_leaf(obj, leaf.spec, "cpu")
              for obj, leaf in zip(objects, fragment.leaves)]
    return leaves, problems
