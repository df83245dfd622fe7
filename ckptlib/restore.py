"""Restore one part of a checkpoint: fetch chunks in parallel, resolve delta chains, verify, rebuild.

Called by ``Checkpointer`` (restore, verify) and validation. Contract:

* Every chunk is decoded straight into the memory of the leaf it belongs to (a packed chunk into
  a small buffer, then copied into its leaves); a delta chain is resolved keyframe-first, and a
  chunk that several chains or leaves share is fetched and decoded once per restore.
* Nothing is returned unchecked: every decoded chunk is checked against its raw checksum, and
  every leaf against its digest (so chunks reordered, swapped between tensors or relabelled in a
  manifest are caught, not returned). A missing, truncated or altered object raises
  ``CorruptCheckpoint`` naming the step, part, tensor, chunk and object key.
* Declared sizes are checked before anything is allocated: a manifest cannot make a restore
  allocate more than its leaves' (checked) sizes and the chunks that serve them (``restore_bytes``;
  the fragment's parse checked every chunk against its leaves and every pack against the chunk
  size), nor more than this machine's memory; no object is read past the size the manifest records.
* Nothing is ever written to the store.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import codecs
from .bind import Alias, bind_into, fill_aliases
from .errors import CheckpointError, CorruptCheckpoint, Damaged, ObjectNotFound, ObjectTooLarge
from .leaves import empty_leaf, finish_leaf, raw_view
from .manifest import Blob, Fragment, Leaf
from .store import Store
from .tree import MISSING, leaf_indices, prune, unflatten
from .types import LeafSpec

log = logging.getLogger("ckptlib")


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


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def restore_bytes(fragment: Fragment, wanted: list[int], dests: Mapping[int, Any], tops: Mapping[str, list],
                  shared: set[str], keep: bool) -> int:
    """The most memory a restore of leaves ``wanted`` allocates, from the sizes the fragment declares
    (checked against memory before anything is allocated): the leaves it builds, a buffer per chunk
    not decoded in place (packs, chunks several leaves share), the chunks several chains share
    (kept while it runs), every chunk once more with ``keep``, and a chunk's worth per decoding core."""
    blobs = fragment.blobs
    leaves = sum(fragment.leaves[i].spec.nbytes for i in wanted if i not in dests)
    buffered = sum(blobs[d].nbytes for d, places in tops.items()
                   if len(places) > 1 or places[0][2] != 0 or places[0][3] != blobs[d].nbytes)
    largest = max((blobs[d].nbytes for d in tops), default=0)
    return (leaves + buffered + sum(blobs[d].nbytes for d in shared if d in blobs)
            + (sum(blobs[d].nbytes for d in tops) if keep else 0) + min(len(tops), os.cpu_count() or 2) * largest)


def check_fits(nbytes: int, what: str) -> None:
    """Refuse to allocate more than this machine has (a damaged or hostile manifest, or a
    checkpoint too large for this machine), before allocating anything."""
    memory = physical_memory()
    if memory is not None and nbytes > memory:
        raise CheckpointError(
            f"{what} needs {nbytes / 2**30:.1f} GiB, more than this machine's {memory / 2**30:.1f} GiB of memory; "
            "restore it on a larger machine, restore part of it (select=...), or check the manifest"
        )


class _ChainDecoder:
    """Decodes chunks by checksum into destination memory: the keyframe first, then every delta
    of the chain applied in place. Chunks that several chains share are kept after their first
    decode, so a shared base is fetched and decoded once per restore.

    Only the top of a chain is checked against its checksum (it covers every link below it);
    when it does not match, the chain is walked again link by link to name the damaged object.

    ``shortcuts``: keyframes of some chunks kept beside their chains (``compaction``), by raw
    checksum. A chunk with a chain of two links or more is decoded from its shortcut instead; a
    shortcut that is missing, damaged or decodes to other bytes is passed over for the chain (one
    warning per decoder).
    """

    def __init__(self, fragment: Fragment, store: Store, tops: list[str], known: Mapping[str, np.ndarray] | None = None,
                 decode_slots: int | None = None, shortcuts: Mapping[str, Blob] | None = None):
        self.fragment, self.store = fragment, store
        self._shortcuts = dict(shortcuts or {})
        self._warned = False
        # Fetching runs on every thread of the pool (remote stores need many requests in flight);
        # decoding is CPU work whose buffers are chunk-sized: only as many chains decode at once as
        # there are cores, which bounds a restore's memory beside the state it fills.
        self._slots = threading.Semaphore(decode_slots or os.cpu_count() or 2)
        uses: Counter[str] = Counter()
        for digest in tops:
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
            raise Damaged(None, f"chunk {digest} is not in the blob table")
        return blob

    def _payload(self, blob: Blob) -> np.ndarray:
        try:  # never more than the manifest says: an object replaced by a huge one is refused unread
            payload = np.frombuffer(self.store.get(blob.key, max_bytes=blob.size), dtype=np.uint8)
        except ObjectNotFound:
            raise Damaged(blob.key, "is missing from the store (deleted, or never uploaded)") from None
        except ObjectTooLarge as e:
            raise Damaged(blob.key, f"has {e.size or 'more'} bytes, the manifest says {blob.size} (replaced?)") from None
        if payload.nbytes != blob.size:
            raise Damaged(blob.key, f"has {payload.nbytes} bytes, the manifest says {blob.size} (truncated?)")
        return payload

    def _codecs(self, blob: Blob, nbytes: int) -> list:
        if blob.nbytes != nbytes:
            raise Damaged(blob.key, f"decodes to {blob.nbytes} bytes, the chunk has {nbytes}")
        try:
            chain = codecs.from_configs(list(blob.codecs))
        except CorruptCheckpoint as e:
            raise Damaged(blob.key, str(e)) from None
        if chain[0].uses_base != (blob.base is not None):
            raise Damaged(blob.key, "its codecs and its base disagree on whether it is a delta")
        return chain

    @contextmanager
    def _decoding(self, blob: Blob) -> Iterator[None]:
        try:
            yield
        except Damaged:
            raise
        except CorruptCheckpoint as e:
            raise Damaged(blob.key, f"does not decode: {e}") from None
        except (ValueError, TypeError, IndexError, OverflowError, MemoryError) as e:
            raise Damaged(blob.key, f"does not decode: {type(e).__name__}: {e}") from None

    def _apply(self, blob: Blob, out: np.ndarray, payload: np.ndarray | None = None) -> None:
        """Decode ``blob`` into ``out`` (which holds its base's bytes when it is a delta)."""
        chain = self._codecs(blob, out.nbytes)
        if payload is None:
            payload = self._payload(blob)
        with self._decoding(blob):
            codecs.decode_into(payload, chain, out)

    def _apply_summed(self, deltas: list[Blob], out: np.ndarray, fetched: dict[str, np.ndarray]) -> bool:
        """Apply a run of integer deltas at once when that is cheaper: their differences add up in
        the ordered-integer domain, so they are summed into one accumulator and written back in one
        pass over the chunk, instead of a gather/map/scatter per link. Worth it when the links
        together touch a good share of the chunk (judged by their sizes: a sparse delta costs a
        byte or two per change); a few small sparse deltas are cheaper applied one by one. False
        (nothing done) when the run is not worth summing or not additive in one way."""
        chains = [self._codecs(blob, out.nbytes) for blob in deltas]
        kinds = {codecs.additive(c) for c in chains}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind is None:
            return False
        itemsize, ordered_float = kind
        dense = any(not isinstance(c[0], codecs.SparseDelta) for c in chains)
        if out.nbytes % itemsize or not (dense or sum(b.size for b in deltas) * 2 * itemsize >= out.nbytes):
            return False
        acc = codecs.to_ordered(out, itemsize, ordered_float)
        for blob, chain in zip(deltas, chains):
            payload = fetched.pop(blob.key, None)
            if payload is None:
                payload = self._payload(blob)
            with self._decoding(blob):
                codecs.add_delta(payload, chain, acc)
            del payload
        codecs.from_ordered(acc, ordered_float, out)
        return True

    def fill(self, digest: str, out: np.ndarray) -> None:
        """Write the raw bytes of chunk ``digest`` into ``out``, checked against the digest."""
        chain: list[tuple[str, Blob]] = []  # top first, down to a keyframe or a chunk decoded before
        d: str | None = digest
        while d is not None and d not in self._cache:
            chain.append((d, self._blob(d)))
            d = chain[-1][1].base
        shortcut = self._shortcuts.get(digest) if len(chain) > 1 else None
        if shortcut is not None and self._fill_from(shortcut, digest, out):
            return
        links = chain[::-1]  # bottom first
        # The first object is fetched before taking a decode slot (the I/O of many chains overlaps);
        # the others inside it, one at a time, so a decoding thread holds one payload, not a chain's.
        fetched = {links[0][1].key: self._payload(links[0][1])} if links else {}
        with self._slots:
            self._decode(links, d, out, fetched)
        if codecs.checksum(out) != digest:
            self._locate(digest, out.nbytes)

    def _fill_from(self, shortcut: Blob, digest: str, out: np.ndarray) -> bool:
        """Decode chunk ``digest`` from its compacted keyframe into ``out``; False (said once) when
        that object is unusable: the caller then decodes the chain."""
        try:
            payload = self._payload(shortcut)
            with self._slots:
                self._apply(shortcut, out, payload)
            if codecs.checksum(out) == digest:
                if digest in self._shared:
                    with self._lock:
                        self._cache.setdefault(digest, out.copy())
                return True
            why = "decodes to bytes whose checksum does not match"
        except Damaged as e:
            why = e.reason
        with self._lock:
            warned, self._warned = self._warned, True
        if not warned:
            log.warning("step %d, part '%s': the compacted copy of chunk %s (object %s) %s; restoring it from its "
                        "delta chain (and so any other such chunk of this restore)", self.fragment.step,
                        self.fragment.part, digest, shortcut.key, why)
        return False

    def _decode(self, links: list[tuple[str, Blob]], start_digest: str | None, out: np.ndarray,
                fetched: dict[str, np.ndarray]) -> None:
        """Apply a chain (bottom first) onto ``out``: from a chunk held already, or its keyframe."""
        if start_digest is not None:
            start = self._cache[start_digest]
            if start.nbytes != out.nbytes:
                raise Damaged(None, f"chunk {start_digest} holds {start.nbytes} bytes where {out.nbytes} are expected")
            out[:] = start
        elif links:
            self._apply(links[0][1], out, fetched.pop(links[0][1].key, None))  # the keyframe
            if links[0][0] in self._shared:
                with self._lock:
                    self._cache.setdefault(links[0][0], out.copy())
            links = links[1:]
        # Several deltas above the start whose intermediate results no other chain shares: sum them.
        middle_shared = any(link in self._shared for link, _ in links[:-1])
        if len(links) < 2 or middle_shared or not self._apply_summed([b for _, b in links], out, fetched):
            for link, blob in links:
                self._apply(blob, out, fetched.pop(blob.key, None))
                if link in self._shared and link not in self._cache:
                    with self._lock:
                        self._cache[link] = out.copy()
        elif links[-1][0] in self._shared:
            with self._lock:
                self._cache.setdefault(links[-1][0], out.copy())

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
                raise Damaged(blob.key, "decodes to bytes whose checksum does not match")
        raise Damaged(None, f"chunk {digest} does not match its checksum")  # not reproducible: flaky storage


@dataclass
class _Target:
    """Where one leaf's bytes go: ``raw``, host memory in stored order. That is the destination's
    own memory, or, when the destination cannot be written as raw host bytes (another device,
    another layout), the memory of a host copy ``staged`` that is copied into ``obj`` at the end."""

    obj: Any
    raw: np.ndarray
    staged: Any = None


def _target(leaf: Leaf, dest: Any) -> _Target:
    if dest is not None:
        raw = raw_view(dest, leaf.spec)
        if raw is not None:
            return _Target(dest, raw)
        tmp, staging = empty_leaf(leaf.spec)
        return _Target(dest, staging, tmp)
    obj, raw = empty_leaf(leaf.spec)
    return _Target(obj, raw)


def _finish_staged(t: _Target, leaf: Leaf) -> None:
    """Copy a staged leaf into its destination (a GPU tensor, or another memory layout)."""
    if leaf.spec.kind == "torch":
        t.obj.detach().copy_(t.staged)
    else:
        np.copyto(t.obj, t.staged)


def decode_leaves(fragment: Fragment, store: Store, pool: Executor, wanted: list[int], *,
                  dests: Mapping[int, Any] | None = None, known: Mapping[str, np.ndarray] | None = None,
                  keep: bool = False, shortcuts: Mapping[str, Blob] | None = None,
                  ) -> tuple[dict[int, Any], list[Problem], dict[str, np.ndarray] | None]:
    """Decode the leaves ``wanted`` (indices) into new objects, or into ``dests`` in place.

    Returns (objects by leaf index: the filled object of every intact leaf, problems, and with
    ``keep`` a private copy of every chunk decoded, by checksum: a writer's next delta base).
    ``known``: raw chunks the caller already holds, by checksum (a chain stops there).
    ``shortcuts``: compacted keyframes of delta-coded chunks (``_ChainDecoder``)."""
    dests = dests or {}
    leaves = fragment.leaves
    # chunk checksum -> [(leaf, start in leaf, start in chunk, length)]
    placements: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
    index_of: dict[tuple[int, str], int] = {}
    for i in wanted:
        for n, (digest, start, at, length) in enumerate(leaves[i].segments()):
            placements[digest].append((i, start, at, length))
            index_of[(i, digest)] = n
    decoder = _ChainDecoder(fragment, store, list(placements), known, shortcuts=shortcuts)
    check_fits(restore_bytes(fragment, wanted, dests, placements, decoder._shared, keep),
               f"step {fragment.step}, part '{fragment.part}'")
    targets = {i: _target(leaves[i], dests.get(i)) for i in wanted}
    kept: dict[str, np.ndarray] | None = {} if keep else None
    kept_lock = threading.Lock()
    problems: list[Problem] = []

    def fill(digest: str) -> list[Problem]:
        places = placements[digest]
        blob = fragment.blobs[digest]
        i0, start0, at0, length0 = places[0]
        in_place = len(places) == 1 and at0 == 0 and length0 == blob.nbytes
        out = targets[i0].raw[start0:start0 + length0] if in_place else np.empty(blob.nbytes, dtype=np.uint8)
        try:
            decoder.fill(digest, out)
        except CorruptCheckpoint as e:
            key = e.key if isinstance(e, Damaged) else None
            reason = e.reason if isinstance(e, Damaged) else str(e)
            return [Problem(fragment.step, fragment.part, leaves[i].spec.path, index_of[(i, digest)],
                            key or blob.key, reason) for i, *_ in places]
        if not in_place:
            for i, start, at, length in places:
                targets[i].raw[start:start + length] = out[at:at + length]
        if kept is not None:
            copy = out if not in_place else out.copy()
            with kept_lock:
                kept[digest] = copy
        return []

    for found in pool.map(fill, list(placements)):
        problems += found
    bad = {p.tensor for p in problems}

    def check_leaf(i: int) -> Problem | None:
        leaf = leaves[i]
        if leaf.spec.path in bad:
            return None
        segments = leaf.segments()
        whole_chunk = len(segments) == 1 and leaf.pack is None
        # a leaf of one chunk is covered by that chunk's check; others are hashed whole
        actual = segments[0][0] if whole_chunk else codecs.checksum(targets[i].raw)
        if not segments:
            actual = codecs.checksum(b"")
        if actual != leaf.digest:
            return Problem(fragment.step, fragment.part, leaf.spec.path, None, None,
                           "tensor digest does not match the manifest (chunks reordered, swapped or relabelled)")
        return None

    problems += [p for p in pool.map(check_leaf, wanted) if p is not None]
    bad = {p.tensor for p in problems}
    objects = {}
    for i in wanted:
        if leaves[i].spec.path in bad:
            continue
        t = targets[i]
        if t.staged is not None:
            _finish_staged(t, leaves[i])
        objects[i] = t.obj
    return objects, problems, kept


def _raise(problems: list[Problem]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problems; run `ckpt verify` for all)" if len(problems) > 1 else ""
        raise CorruptCheckpoint(f"{problems[0]}{more}")


def restore_part(
    fragment: Fragment, store: Store, pool: Executor, *, device: Any = "cpu", into: Any = None,
    select: list[str] | None = None, keep: bool = False, known: Mapping[str, np.ndarray] | None = None,
    shortcuts: Mapping[str, Blob] | None = None,
) -> tuple[Any, dict[str, np.ndarray] | None]:
    """(state, with ``keep`` a private copy of the raw chunks decoded, by checksum). Raises
    CorruptCheckpoint, or ValueError listing every mismatch between ``into`` and the checkpoint.

    ``into``: a state of the same structure whose tensors and arrays are filled in place (checked
    first: names, shapes, dtypes); the returned state holds those objects, with every other value
    from the checkpoint. ``select``: restore only these top-level keys (or '/'-paths).
    ``known``: raw chunks the caller already holds, by checksum (e.g. the previous step it
    restored): a chain stops there, so following a stream of checkpoints decodes one link per
    changed chunk instead of whole chains. They are trusted as given (the result is still checked).
    ``shortcuts``: compacted keyframes of delta-coded chunks (``compaction.read_table``)."""
    b = bind_selection(fragment.skeleton, [leaf.spec for leaf in fragment.leaves], fragment.step, fragment.part,
                       into=into, select=select)
    objects, problems, kept = decode_leaves(fragment, store, pool, b.wanted, dests=b.dests, known=known, keep=keep,
                                            shortcuts=shortcuts)
    _raise(problems)
    return assemble(b, objects, device), kept


@dataclass
class Binding:
    """What a restore reads and where it goes: the (pruned, bound) skeleton, the leaves' specs, the
    leaves wanted, their destinations in ``into`` and the tied leaves whose destinations are distinct
    objects (``bind.bind_into``)."""

    skeleton: Any
    specs: list[LeafSpec]
    wanted: list[int]
    dests: dict[int, Any]
    aliases: list[Alias]


def bind_selection(skeleton: Any, specs: list[LeafSpec], step: int, part: str, *, into: Any = None,
                   select: list[str] | None = None, detail: str = "") -> Binding:
    """``skeleton`` pruned to ``select`` (KeyError naming a path the state lacks) and bound to ``into``
    (ValueError listing every mismatch, before anything is read). ``detail``: said after the part."""
    if select is not None:
        try:
            skeleton = prune(skeleton, list(select))
        except KeyError as e:
            raise KeyError(f"step {step}, part '{part}': {e.args[0]}") from None
    wanted = sorted(i for i in leaf_indices(skeleton) if 0 <= i < len(specs))
    dests: dict[int, Any] = {}
    aliases: list[Alias] = []
    if into is not None:
        skeleton, dests, aliases, mismatches = bind_into(skeleton, specs, into)
        if mismatches:
            listing = "\n  ".join(mismatches[:50]) + (f"\n  ... and {len(mismatches) - 50} more" if len(mismatches) > 50 else "")
            raise ValueError(f"cannot restore step {step} (part '{part}'{detail}) into the given state: "
                             f"{len(mismatches)} mismatch(es); nothing was changed:\n  {listing}")
    return Binding(skeleton, specs, wanted, dests, aliases)


def assemble(b: Binding, objects: Mapping[int, Any], device: Any = "cpu") -> Any:
    """The restored state: the filled destinations as they are, new leaves finished (on ``device``, a
    Parameter again, ...), tied leaves copied into their distinct destinations."""
    leaves: list[Any] = [MISSING] * (len(b.specs) + len(b.aliases))
    for i, obj in objects.items():
        leaves[i] = obj if i in b.dests else finish_leaf(obj, b.specs[i], device)
    fill_aliases(b.aliases, objects, b.specs, leaves)
    return unflatten(b.skeleton, leaves, b.specs)


def inspect_part(fragment: Fragment, store: Store, pool: Executor) -> tuple[list[Any], list[Problem]]:
    """Decode everything and check every checksum, leaf digest and the skeleton; raise nothing
    for corruption. Returns (the CPU object of every intact leaf in flatten order, None for a
    damaged one; every problem found). What ``ckpt verify`` and validation run: it decodes all
    that ``restore`` decodes, so it never calls intact a checkpoint ``restore`` cannot read."""
    objects, problems, _ = decode_leaves(fragment, store, pool, list(range(len(fragment.leaves))))
    leaves = [finish_leaf(objects[i], leaf.spec, "cpu") if i in objects else None
              for i, leaf in enumerate(fragment.leaves)]
    if not problems:
        try:
            unflatten(fragment.skeleton, leaves, [leaf.spec for leaf in fragment.leaves])
        except CorruptCheckpoint as e:
            problems.append(Problem(fragment.step, fragment.part, "/", None, None, str(e)))
    return leaves, problems


# --- byte ranges of leaves (a rank's shard of a saved piece: ckptlib.distributed) -------------------

@dataclass(frozen=True)
class ByteRange:
    """Bytes ``start``..``stop`` of leaf ``leaf`` of a fragment, to be written into ``out`` (uint8,
    ``stop - start`` bytes)."""

    leaf: int
    start: int
    stop: int
    out: np.ndarray


def _damage(fragment: Fragment, digest: str, e: CorruptCheckpoint, tensors: list[str]) -> list[Problem]:
    """The problems of chunk ``digest``, which did not decode, for each tensor it was read for."""
    key = (e.key if isinstance(e, Damaged) else None) or fragment.blobs[digest].key
    return [Problem(fragment.step, fragment.part, t, None, key, e.reason if isinstance(e, Damaged) else str(e))
            for t in tensors]


def decode_ranges(fragment: Fragment, store: Store, pool: Executor, ranges: list[ByteRange], *,
                  known: Mapping[str, np.ndarray] | None = None) -> list[Problem]:
    """Fill each range's ``out`` with those bytes of its leaf, reading only the chunks that cover
    them: a chunk inside a range is decoded in place, one at a range's edge is decoded whole and the
    part needed copied (rows of a dim-0 shard are contiguous: the chunks of those rows only). A chunk
    several ranges need is fetched and decoded once. Every chunk is checked against its raw checksum,
    and a range that is its whole leaf against the leaf's digest; problems are returned, not raised."""
    leaves = fragment.leaves
    # chunk checksum -> [(range, start in chunk, length, start in out)]
    placements: dict[str, list[tuple[int, int, int, int]]] = defaultdict(list)
    for r, rng in enumerate(ranges):
        if rng.out.nbytes != rng.stop - rng.start or not 0 <= rng.start <= rng.stop <= leaves[rng.leaf].spec.nbytes:
            raise ValueError(f"byte range {rng.start}..{rng.stop} of '{leaves[rng.leaf].spec.path}' is not in the leaf "
                             f"or does not fit its buffer of {rng.out.nbytes} bytes")
        for digest, leaf_start, at, length in leaves[rng.leaf].segments():
            lo, hi = max(rng.start, leaf_start), min(rng.stop, leaf_start + length)
            if lo < hi:
                placements[digest].append((r, at + lo - leaf_start, hi - lo, lo - rng.start))
    decoder = _ChainDecoder(fragment, store, list(placements), known)

    def fill(digest: str) -> list[Problem]:
        places = placements[digest]
        size = fragment.blobs[digest].nbytes
        whole = places[0] if len(places) == 1 and places[0][1] == 0 and places[0][2] == size else None
        # a chunk inside one range is decoded into it; any other into a buffer, then the parts copied
        buf = ranges[whole[0]].out[whole[3]:whole[3] + size] if whole else np.empty(size, dtype=np.uint8)
        try:
            decoder.fill(digest, buf)
        except CorruptCheckpoint as e:
            return _damage(fragment, digest, e, [leaves[ranges[r].leaf].spec.path for r, *_ in places])
        for r, at, length, pos in places if whole is None else ():
            ranges[r].out[pos:pos + length] = buf[at:at + length]
        return []

    problems = [p for found in pool.map(fill, list(placements)) for p in found]
    bad = {p.tensor for p in problems}
    for rng in ranges:
        leaf = leaves[rng.leaf]
        whole = rng.start == 0 and rng.stop == leaf.spec.nbytes
        if whole and leaf.spec.path not in bad and codecs.checksum(rng.out) != leaf.digest:
            problems.append(Problem(fragment.step, fragment.part, leaf.spec.path, None, None,
                                    "tensor digest does not match the manifest (chunks reordered, swapped or relabelled)"))
    return problems
