"""Save one part of a checkpoint: snapshot -> chunks -> keyframe/delta -> put_if_absent -> Fragment.

Called by ``Checkpointer`` (the only caller). Contract:

* ``take_snapshot`` is the only step that reads the caller's tensors; after it returns the caller
  may change them. It copies every leaf into host buffers, reusing spare buffers of a previous
  snapshot so steady-state saves allocate nothing.
* ``encode_part`` writes every chunk the part needs that is not already stored, with
  ``put_if_absent`` under a content-derived key: a retry or a concurrent identical save rewrites
  nothing and is safe. It writes no fragment and no manifest; publishing is ``commit``'s job.
* A chunk is ``unchanged`` (its raw checksum is already in the base's blob table: referenced, not
  written), a ``delta`` against the same chunk position in the base (when the base chunk's chain
  is shorter than ``keyframe_every``, the chain's deltas stay within ``delta_budget`` keyframes,
  and the delta pays), or a ``keyframe``.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import codecs
from .chunking import chunk_size_for, chunk_views
from .manifest import Blob, Fragment, Leaf, part_digest
from .store import Store
from .throttle import RateLimiter
from .tree import LeafSpec, copy_into, flatten

# A delta lengthens the chain a restore must decode, so it is kept only when it is at least this
# much smaller than a keyframe of the same chunk, and while the chain's deltas, it included, add up
# to at most ``delta_budget`` keyframes of the chunk as it is now. The keyframe is estimated by the
# size of the chain's own keyframe, and encoded only when the estimate says the delta may not do.
_DELTA_PAYS = 0.9
# Defaults of a Checkpointer (measured in docs/decisions.md, "Keyframes by budget"): a chunk's chain
# gets a new keyframe once its deltas add up to twice the keyframe's size, or after 32 links.
DEFAULT_KEYFRAME_EVERY = 32
DEFAULT_DELTA_BUDGET = 2.0
# Below this share of changed elements a sparse delta beats a dense one (measured on the tinylm,
# recsys, finetune and finetune-bf16 workloads: within 0.5% of always picking the smaller).
_SPARSE_BELOW = 0.3


@dataclass(frozen=True)
class WriteOptions:
    chunk_bytes: int
    keyframe_every: int  # longest delta chain + 1: restore reads at most this many objects per chunk
    zstd_level: int
    limiter: RateLimiter = field(default_factory=lambda: RateLimiter(None))  # upload bandwidth
    delta_budget: float | None = DEFAULT_DELTA_BUDGET  # a chain's deltas add up to at most this many keyframes


@dataclass
class Snapshot:
    """Host copies of a state's leaves, in flatten order."""

    skeleton: Any
    specs: list[LeafSpec]
    buffers: list[np.ndarray]
    seconds: float = 0.0


@dataclass
class Base:
    """The previous committed version of a part, held in memory: what deltas are taken against."""

    step: int
    leaves: dict[str, tuple[Leaf, np.ndarray]]  # path -> (leaf entry, raw bytes)
    blobs: dict[str, Blob] = field(default_factory=dict)

    @classmethod
    def of(cls, fragment: Fragment, buffers: list[np.ndarray]) -> "Base":
        leaves = {leaf.spec.path: (leaf, buf) for leaf, buf in zip(fragment.leaves, buffers)}
        return cls(fragment.step, leaves, dict(fragment.blobs))

    def raw_chunks(self) -> dict[str, np.ndarray]:
        """The raw bytes of every chunk this base holds, by checksum (views, not copies)."""
        out: dict[str, np.ndarray] = {}
        for leaf, buf in self.leaves.values():
            out.update(zip(leaf.chunks, chunk_views(buf, leaf.chunk_bytes)))
        return out

    def spare_buffers(self) -> dict[int, list[np.ndarray]]:
        spare: dict[int, list[np.ndarray]] = {}
        for _, buf in self.leaves.values():
            spare.setdefault(buf.nbytes, []).append(buf)
        return spare

    def fresh_buffers(self) -> dict[int, list[np.ndarray]]:
        """A second set of buffers shaped like this base, already faulted in, so that the next
        snapshot is a plain copy (page faults on fresh memory cost more than the copy itself)."""
        spare: dict[int, list[np.ndarray]] = {}
        for _, buf in self.leaves.values():
            fresh = _host_buffer(buf.nbytes, pinned=_is_pinned(buf))
            fresh.fill(0)
            spare.setdefault(buf.nbytes, []).append(fresh)
        return spare


def take_snapshot(state: Any, pool: Executor, spare: dict[int, list[np.ndarray]] | None = None) -> Snapshot:
    """Copy every leaf of ``state`` into host memory (the blocking part of a save).

    With tensors on a GPU, the host buffers are pinned (page-locked): device-to-host copies into
    pinned memory run at full bus speed and asynchronously, and the buffers are reused by later
    snapshots, so pinning is paid once.
    """
    t0 = time.perf_counter()
    skeleton, leaves = flatten(state)
    on_gpu = any(isinstance(obj, torch.Tensor) and obj.is_cuda for _, obj in leaves)
    spare = spare or {}
    buffers = []
    for spec, _ in leaves:
        reuse = spare.get(spec.nbytes)
        buffers.append(reuse.pop() if reuse else _host_buffer(spec.nbytes, pinned=on_gpu))
    # torch.copy_ and numpy copies release the GIL: copy in parallel, in a few groups of about equal
    # bytes (one task per leaf would cost more in dispatch than copying a small tensor).
    def copy_group(indices: list[int]) -> None:
        for i in indices:
            copy_into(leaves[i][1], leaves[i][0], buffers[i], non_blocking=on_gpu)

    list(pool.map(copy_group, _balanced_groups([spec.nbytes for spec, _ in leaves], _SNAPSHOT_GROUPS)))
    if on_gpu:
        torch.cuda.synchronize()  # the asynchronous copies must land before the caller moves on
    return Snapshot(skeleton, [spec for spec, _ in leaves], buffers, time.perf_counter() - t0)


_SNAPSHOT_GROUPS = 8


def _balanced_groups(sizes: list[int], n: int) -> list[list[int]]:
    """Indices split into at most n groups of about equal total size (largest first, greedy)."""
    groups: list[list[int]] = [[] for _ in range(min(n, len(sizes)))]
    totals = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        g = totals.index(min(totals))
        groups[g].append(i)
        totals[g] += sizes[i]
    return [g for g in groups if g]


def _is_pinned(buf: np.ndarray) -> bool:
    return torch.cuda.is_available() and torch.from_numpy(buf).is_pinned()


def _host_buffer(nbytes: int, pinned: bool) -> np.ndarray:
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.empty(nbytes, dtype=np.uint8)


def _delta_codecs(view: np.ndarray, base_view: np.ndarray, spec: LeafSpec, level: int) -> list:
    """Sparse or dense integer deltas for 1/2/4/8-byte elements, XOR for anything else."""
    if not codecs.integer_deltas_apply(spec.itemsize):
        return codecs.delta_codecs(spec.itemsize, level)
    uint = np.dtype(f"u{spec.itemsize}")
    changed = np.count_nonzero(view.view(uint) != base_view.view(uint))
    if changed < _SPARSE_BELOW * (view.nbytes // spec.itemsize):
        return codecs.sparse_codecs(spec.itemsize, level, spec.is_float)
    return codecs.arith_codecs(spec.itemsize, level, spec.is_float)


def _chain_sizes(blob: Blob, known: dict[str, Blob]) -> tuple[int, int]:
    """(encoded size of the keyframe at the root of ``blob``'s delta chain, or its raw size if
    unknown; encoded bytes of the chain's deltas up to and including ``blob``)."""
    deltas = 0
    while blob.base is not None and blob.base in known:
        deltas += blob.size
        blob = known[blob.base]
    if blob.base is not None:
        return blob.nbytes, deltas + blob.size
    return blob.size, deltas


def _keyframe_better(delta: int, chain_deltas: int, keyframe: int, budget: float | None) -> bool:
    """Whether a keyframe of ``keyframe`` bytes beats a delta of ``delta`` bytes that would bring its
    chain's deltas to ``chain_deltas`` bytes: the delta does not pay, or the chain is over budget."""
    return delta >= _DELTA_PAYS * keyframe or (budget is not None and chain_deltas > budget * keyframe)


def _chain_cap(keyframe_every: int, position: int) -> int:
    """The chain bound of the chunk at ``position`` in the part: ``keyframe_every``, lowered by up to
    a quarter for some positions. Chunks whose chains all started at one save (the first, say) would
    otherwise all reach the bound at the same save, and that save would upload the whole state
    again; staggered, the keyframes spread over a quarter of the cycle. Never above the bound."""
    spread = keyframe_every // 4
    return keyframe_every - position % spread if spread > 1 else keyframe_every


def blob_key(raw_digest: str, base: str | None, codec_configs: list[dict[str, Any]]) -> str:
    """Content-derived object key: the same chunk encoded the same way always lands on the same key."""
    ident = json.dumps([raw_digest, base, codec_configs], sort_keys=True, separators=(",", ":"))
    h = hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()
    return f"chunks/{h[:2]}/{h}"


def encode_part(
    snap: Snapshot,
    base: Base | None,
    store: Store,
    pool: Executor,
    opts: WriteOptions,
    *,
    step: int,
    part: str,
    generation: int = 0,
    config_hash: str | None = None,
    meta: dict[str, Any] | None = None,
) -> Fragment:
    known = base.blobs if base else {}
    jobs = []  # (leaf index, chunk view, base chunk view | None, base raw digest | None, chain bound)
    sizes = []
    for i, spec in enumerate(snap.specs):
        size = chunk_size_for(spec.itemsize, opts.chunk_bytes)
        sizes.append(size)
        views = chunk_views(snap.buffers[i], size)
        prev = base.leaves.get(spec.path) if base else None
        prev_ok = prev is not None and prev[0].spec.nbytes == spec.nbytes and prev[0].chunk_bytes == size
        prev_views = chunk_views(prev[1], size) if prev_ok else [None] * len(views)
        for j, view in enumerate(views):
            jobs.append((i, view, prev_views[j], prev[0].chunks[j] if prev_ok else None,
                         _chain_cap(opts.keyframe_every, len(jobs))))

    def encode_chunk(job):
        i, view, base_view, base_digest, cap = job
        digest = codecs.checksum(view)
        if digest in known:
            return digest, None, False, "unchanged"
        itemsize = snap.specs[i].itemsize
        chosen, kind, base_ref, depth = None, "keyframe", None, 0
        base_blob = known.get(base_digest) if base_digest else None
        if base_blob is not None and base_blob.depth + 1 < cap:
            chosen = _delta_codecs(view, base_view, snap.specs[i], opts.zstd_level)
            payload = codecs.encode(view, chosen, base_view)
            kind, base_ref, depth = "delta", base_digest, base_blob.depth + 1
            key_estimate, chain_deltas = _chain_sizes(base_blob, known)
            chain_deltas += payload.nbytes
            # The chain's own keyframe estimates this chunk's; only when the estimate says a
            # keyframe may be better is one encoded to decide on its real size.
            if _keyframe_better(payload.nbytes, chain_deltas, key_estimate, opts.delta_budget):
                key_codecs = codecs.keyframe_codecs(itemsize, opts.zstd_level)
                key_payload = codecs.encode(view, key_codecs)
                if _keyframe_better(payload.nbytes, chain_deltas, key_payload.nbytes, opts.delta_budget):
                    chosen, payload, kind, base_ref, depth = key_codecs, key_payload, "keyframe", None, 0
        else:
            chosen = codecs.keyframe_codecs(itemsize, opts.zstd_level)
            payload = codecs.encode(view, chosen)
        configs = [c.to_config() for c in chosen]
        key = blob_key(digest, base_ref, configs)
        opts.limiter.acquire(payload.nbytes)
        wrote = store.put_if_absent(key, payload.tobytes())
        return digest, Blob(key, payload.nbytes, view.nbytes, tuple(configs), base_ref, depth), wrote, kind

    # A leaf's digest is the checksum of all its bytes; for a one-chunk leaf that is the chunk's.
    multi = [i for i, spec in enumerate(snap.specs) if spec.nbytes > sizes[i]]
    multi_digests = pool.map(lambda i: codecs.checksum(snap.buffers[i]), multi)
    results = list(pool.map(encode_chunk, jobs))
    leaf_digests = dict(zip(multi, multi_digests))

    chunk_lists: list[list[str]] = [[] for _ in snap.specs]
    new_blobs: dict[str, Blob] = {}
    stats = {"keyframe": 0, "delta": 0, "unchanged": 0}
    bytes_written = 0
    for (i, *_), (digest, blob, wrote, kind) in zip(jobs, results):
        chunk_lists[i].append(digest)
        stats[kind] += 1
        if blob is not None:
            new_blobs.setdefault(digest, blob)
            bytes_written += blob.size if wrote else 0

    # The blob table holds every object the chunks need: new blobs plus the delta chains of both
    # new and unchanged chunks, so the fragment restores on its own.
    table: dict[str, Blob] = {}
    pending = [d for chunks in chunk_lists for d in chunks]
    while pending:
        d = pending.pop()
        if d in table:
            continue
        blob = new_blobs.get(d) or known[d]
        table[d] = blob
        if blob.base is not None:
            pending.append(blob.base)

    empty = codecs.checksum(b"")
    leaves = [Leaf(spec, leaf_digests.get(i) or (chunk_lists[i][0] if chunk_lists[i] else empty), sizes[i],
                   tuple(chunk_lists[i])) for i, spec in enumerate(snap.specs)]
    return Fragment(
        step=step, part=part, generation=generation, config_hash=config_hash, skeleton=snap.skeleton,
        leaves=tuple(leaves), blobs=table, digest=part_digest(snap.skeleton, leaves),
        logical_bytes=sum(s.nbytes for s in snap.specs), bytes_written=bytes_written, stats=stats,
        meta=dict(meta or {}),
    )
