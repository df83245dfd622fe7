"""``Checkpointer``: the public face of the library. Save, restore, list, verify, fragments, commit.

Thread-safety: one Checkpointer serves one writer (a training loop, or one shard task). Its
methods may be called from one thread at a time; ``save_async`` runs the persisting half in a
background thread of its own. Several processes may read one store at any time, and several
writers may race on the same step: exactly one commit wins (see ``commit.publish``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from . import commit
from .chunking import DEFAULT_CHUNK_BYTES
from .errors import CheckpointError, NoCheckpoint, ObjectNotFound
from .gc import GcReport, collect_garbage
from .manifest import Fragment, Manifest, loads_fragment
from .reader import Problem, restore_part, verify_part
from .retention import RetentionPolicy
from .store import Store
from .throttle import RateLimiter
from .writer import (DEFAULT_DELTA_BUDGET, DEFAULT_KEYFRAME_EVERY, Base, Snapshot, WriteOptions, encode_part,
                     take_snapshot)

log = logging.getLogger("ckptlib")

SINGLE_PART = "state"


@dataclass(frozen=True)
class CommitInfo:
    """What one save did. ``committed`` is False when the same state was already committed."""

    step: int
    digest: str
    bytes_written: int  # new object bytes this save stored
    logical_bytes: int  # raw size of the state
    stored_bytes: int  # size of every object the checkpoint needs
    kind: str  # "keyframe" | "delta"
    chunks: dict[str, int]  # {"keyframe": n, "delta": n, "unchanged": n}
    committed: bool
    blocked_s: float  # time the caller was blocked (the snapshot)
    durable_s: float  # from the call until the manifest was published

    @property
    def ratio(self) -> float:
        """Logical size over bytes written: how many times smaller than a full copy."""
        return self.logical_bytes / max(self.bytes_written, 1)


class Checkpointer:
    """Incremental, content-addressed checkpoints of nested tensor states under one URL.

    ``url``: a plain path, ``file:///abs/path``, ``memory://name`` or ``s3://bucket/prefix``;
    ``storage_options`` go to fsspec/s3fs (endpoint_url, key, secret, ...).
    Options: ``chunk_bytes`` (default 4 MiB), ``keyframe_every`` K (restore reads at most K objects
    per chunk; 1 = keyframes only; default 32), ``delta_budget`` B (a chunk gets a new keyframe
    once its chain's deltas add up to B times its keyframe's size, so a restore reads at most 1 + B
    keyframes' worth of bytes per chunk; default 2; None = only K bounds chains), ``zstd_level``,
    ``threads`` (encode/IO pool size),
    ``max_upload_bytes_per_s`` (upload bandwidth limit; None = unlimited).
    """

    def __init__(self, url: str | Store, storage_options: dict | None = None, *,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
                 delta_budget: float | None = DEFAULT_DELTA_BUDGET, zstd_level: int = 3,
                 threads: int | None = None, max_upload_bytes_per_s: float | None = None):
        if keyframe_every < 1:
            raise ValueError(f"keyframe_every must be >= 1, got {keyframe_every}")
        if delta_budget is not None and not delta_budget > 0:
            raise ValueError(f"delta_budget must be > 0 (or None for no limit), got {delta_budget}")
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {chunk_bytes}; about 1-4 MiB suits most stores")
        self.store = url if isinstance(url, Store) else Store.from_url(url, storage_options)
        self.options = WriteOptions(chunk_bytes, keyframe_every, zstd_level, RateLimiter(max_upload_bytes_per_s),
                                    delta_budget)
        self._pool = ThreadPoolExecutor(max_workers=threads or min(32, (os.cpu_count() or 2) * 2),
                                        thread_name_prefix="ckpt-io")
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-persist")
        self._bases: dict[str, Base] = {}
        self._spare: dict[str, dict] = {}  # per part: buffers of the replaced base, reused by the next snapshot
        # Committed manifests are write-once, so each is read once; only a deletion (GC, possibly by
        # another process) can make an entry stale, and a restore of it then fails on missing chunks.
        self._manifests: dict[int, Manifest] = {}
        self._inflight: Future | None = None
        self._inflight_step: int | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.store.url

    # --- saving ----------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, meta: dict | None = None) -> CommitInfo:
        """Snapshot, encode, upload and commit ``state`` as ``step``; returns when it is durable."""
        return self.save_async(step, state, meta=meta).result()

    def save_async(self, step: int, state: Any, *, meta: dict | None = None) -> "Future[CommitInfo]":
        """Return once ``state`` is snapshotted; the caller may then change it. At most one save is
        in flight: this first waits for the previous one, and raises its error if it failed."""
        commit.check_step(step)
        t0 = time.perf_counter()
        self._drain()
        snap = self._snapshot(SINGLE_PART, state)
        with self._lock:
            fut = self._background.submit(self._persist, step, snap, meta, t0)
            self._inflight, self._inflight_step = fut, step
        return fut

    def wait(self) -> None:
        """Block until no save is in flight; raise the error of a failed background save."""
        self._drain()

    def _drain(self) -> None:
        with self._lock:
            fut, step = self._inflight, self._inflight_step
            self._inflight = self._inflight_step = None
        if fut is not None:
            try:
                fut.result()
            except Exception as e:
                raise CheckpointError(f"the previous background save (step {step}) failed: {e}") from e

    def _snapshot(self, part: str, state: Any) -> Snapshot:
        return take_snapshot(state, self._pool, spare=self._spare.pop(part, None))

    def _base(self, part: str) -> Base | None:
        """The delta base of ``part``. A writer that has neither saved nor restored yet starts from
        the blob table of the latest committed checkpoint: its unchanged chunks are then referenced
        instead of re-encoded (deltas need the base bytes, which only a restore brings)."""
        if part not in self._bases:
            latest = self.latest_step()
            if latest is None:
                return None
            frag = self._read_manifest(latest).parts.get(part)
            if frag is None:
                return None
            self._bases[part] = Base(frag.step, {}, dict(frag.blobs))
        return self._bases[part]

    def _persist(self, step: int, snap: Snapshot, meta: dict | None, t0: float) -> CommitInfo:
        base = self._base(SINGLE_PART)
        fragment = encode_part(snap, base, self.store, self._pool, self.options, step=step, part=SINGLE_PART)
        manifest = commit.build_manifest(step, base.step if base else None, {SINGLE_PART: fragment},
                                         single=True, meta=meta)
        created = commit.publish(self.store, manifest)
        self._adopt(SINGLE_PART, fragment, snap.buffers)
        if not created:
            log.info("step %d was already committed with the same digest: nothing new published", step)
        return self._info(manifest, created, snap.seconds, time.perf_counter() - t0)

    def _adopt(self, part: str, fragment: Fragment, buffers, *, prepare_spare: bool = True) -> None:
        """Make a committed fragment the delta base of ``part``; keep the old buffers for reuse."""
        old = self._bases.get(part)
        self._bases[part] = new = Base.of(fragment, buffers)
        # Old buffers are reused by the next snapshot; after the first save there are none yet, so
        # make them now (this runs in the background half of a save, not while the caller waits).
        if old is not None and old.leaves:
            self._spare[part] = old.spare_buffers()
        elif prepare_spare:
            self._spare[part] = new.fresh_buffers()

    @staticmethod
    def _info(m: Manifest, created: bool, blocked: float, durable: float) -> CommitInfo:
        stats: dict[str, int] = {}
        for f in m.parts.values():
            for k, v in f.stats.items():
                stats[k] = stats.get(k, 0) + v
        return CommitInfo(m.step, m.digest, m.bytes_written, m.logical_bytes,
                          m.stored_bytes, m.kind, stats, created, blocked, durable)

    # --- reading ---------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return commit.committed_steps(self.store)

    def latest_step(self, *, healthy: bool = False) -> int | None:
        steps = self.healthy_steps() if healthy else self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int | None = None) -> Manifest:
        return self._read_manifest(self._resolve(step, healthy=False))

    def restore(self, step: int | None = None, *, healthy: bool = False, part: str | None = None,
                device: str | torch.device = "cpu", keep_base: bool = True) -> Any:
        """The state of ``step`` (None = the latest committed; ``healthy=True``: the latest that
        passed validation). Tensors land on ``device`` (CPU by default), bit-exact.

        A single-writer checkpoint returns its state; a multi-part one returns ``{part: state}``,
        or one part's state when ``part`` is given. With ``keep_base`` (default) the restored parts
        are also copied to become the delta bases of this Checkpointer's next saves; readers that
        will not save pass False and skip that copy.

        Chunks this Checkpointer holds already (its delta base: the last step it saved, or restored
        with ``keep_base``) are copied, not fetched and decoded: a follower that restores every new
        step (an evaluator, an inference worker) decodes one link per changed chunk.
        """
        self._drain()
        m = self._read_manifest(self._resolve(step, healthy=healthy))
        names = [part] if part is not None else list(m.parts)
        out = {}
        for name in names:
            if name not in m.parts:
                raise NoCheckpoint(f"step {m.step} has no part '{name}'; it has {sorted(m.parts)}")
            frag = m.parts[name]
            # the caller owns (and will mutate) the restored tensors: a base is a copy of them.
            # Chunks of the base held now (the last step saved or restored) need not be decoded again.
            held = self._bases.get(name)
            state, copies = restore_part(frag, self.store, self._pool, device=device, copy=keep_base,
                                         known=held.raw_chunks() if held is not None else None)
            if copies is not None:
                self._adopt(name, frag, copies, prepare_spare=False)
            out[name] = state
        if part is not None:
            return out[part]
        return out[SINGLE_PART] if m.single else out

    def verify(self, step: int | None = None) -> list[Problem]:
        """Decode every chunk of ``step`` and check all checksums and digests; [] when intact."""
        m = self._read_manifest(self._resolve(step, healthy=False))
        return [p for frag in m.parts.values() for p in verify_part(frag, self.store, self._pool)]

    def _read_manifest(self, step: int) -> Manifest:
        """The committed manifest of ``step``, read once per Checkpointer (restoring several parts
        of one cut, as every shard task does, reads it once)."""
        if step not in self._manifests:
            self._manifests[step] = commit.read_manifest(self.store, step)
        return self._manifests[step]

    def _resolve(self, step: int | None, *, healthy: bool) -> int:
        if step is not None:
            return commit.check_step(step)
        latest = self.latest_step(healthy=healthy)
        if latest is None:
            what = "healthy (committed and validated) checkpoint" if healthy else "committed checkpoint"
            raise NoCheckpoint(f"no {what} in {self.url}")
        return latest

    # --- health (validation verdicts) ------------------------------------------------------------

    def verdict(self, step: int) -> dict | None:
        try:
            return json.loads(self.store.get(commit.validation_key(step)))
        except ObjectNotFound:
            return None

    def healthy_steps(self) -> list[int]:
        """Committed steps whose validation passed, ascending. Failed ones are skipped (logged)."""
        healthy = []
        for step in self.steps():
            v = self.verdict(step)
            if v is not None and v.get("passed") is True:
                healthy.append(step)
            elif v is not None:
                log.warning("skipping checkpoint step %d of %s: its validation failed (%s)", step, self.url,
                            ", ".join(v.get("failed", [])) or "see validations/%d.json" % step)
        return healthy

    # --- multi-writer: fragments and the coordinator's commit ------------------------------------

    def write_fragment(self, step: int, part: str, state: Any, *, generation: int = 0,
                       config_hash: str | None = None, meta: dict | None = None) -> Fragment:
        """Save ``state`` as ``part`` of the cut at ``step`` (chunks, then the fragment), as
        generation ``generation``. Raises FencedError if that generation is no longer live."""
        commit.check_step(step)
        commit.check_part_name(part)
        commit.check_live(self.store, part, generation)
        snap = self._snapshot(part, state)
        frag = encode_part(snap, self._base(part), self.store, self._pool, self.options, step=step,
                           part=part, generation=generation, config_hash=config_hash, meta=meta)
        commit.check_live(self.store, part, generation)  # fenced while encoding: do not publish it
        commit.put_fragment(self.store, frag)
        return frag

    def read_fragment(self, step: int, part: str, *, generation: int | None = None,
                      device: str | torch.device = "cpu", adopt: bool = False) -> Any:
        """The state in a (possibly not yet committed) fragment; generation None = the live one.
        Used by a coordinator to combine the shards of a cut before it commits it. ``adopt=True``
        makes the fragment the delta base of this Checkpointer's next write of ``part`` (as
        ``restore`` does): a writer that continues from an uncommitted fragment then writes deltas."""
        gen = self.live_generation(part) if generation is None else generation
        key = commit.fragment_key(commit.check_step(step), commit.check_part_name(part), gen)
        try:
            data = self.store.get(key)
        except ObjectNotFound:
            raise NoCheckpoint(f"no fragment {key} in {self.url}: part '{part}' generation {gen} has not "
                               f"written step {step} yet") from None
        frag = loads_fragment(data, f"{self.url}/{key}")
        state, copies = restore_part(frag, self.store, self._pool, device=device, copy=adopt)
        if copies is not None:
            self._adopt(part, frag, copies, prepare_spare=False)
        return state

    def commit(self, step: int, parts: list[str], *, timeout: float = 600.0, meta: dict | None = None,
               parent: int | None = None) -> CommitInfo:
        """Coordinator: wait for a fragment of the live generation of every part, then publish the cut."""
        t0 = time.perf_counter()
        frags = commit.gather(self.store, commit.check_step(step), [commit.check_part_name(p) for p in parts],
                              timeout=timeout)
        if parent is None:
            prior = [s for s in self.steps() if s < step]
            parent = prior[-1] if prior else None
        manifest = commit.build_manifest(step, parent, frags, single=False, meta=meta)
        created = commit.publish(self.store, manifest)
        return self._info(manifest, created, 0.0, time.perf_counter() - t0)

    def fence(self, part: str, generation: int, reason: str = "", by: str = "",
              details: dict | None = None) -> bool:
        return commit.fence(self.store, commit.check_part_name(part), generation, reason, by, details)

    def live_generation(self, part: str) -> int:
        return commit.live_generation(self.store, part)

    # --- retention -------------------------------------------------------------------------------

    def gc(self, policy: RetentionPolicy, *, grace_s: float = 600.0, dry_run: bool = False) -> GcReport:
        """Drop checkpoints the policy does not keep and sweep unreferenced objects (see ckptlib.gc)."""
        self._drain()
        self._manifests.clear()  # GC uncommits steps
        return collect_garbage(self.store, policy, grace_s=grace_s, dry_run=dry_run)

    # --- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        try:
            self._drain()
        finally:
            self._background.shutdown(wait=True)
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
