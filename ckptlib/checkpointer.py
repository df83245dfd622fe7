"""``Checkpointer``: the public face of the library. Save, restore, list, verify, fragments, commit.

Thread-safety: one Checkpointer serves one writer (a training loop, or one shard task). Its
methods may be called from one thread at a time; ``save_async`` runs the persisting half in a
background thread of its own. Several processes may read one store at any time, and several
writers may race on the same step: exactly one commit wins (see ``commit.publish``).

Errors are reported once, where they happen, and leave the Checkpointer usable: a failed
``save`` raises from that call; a failed ``save_async`` raises from its future's ``result()``,
or, if nobody asked the future, from the next call. A retry of the same step then works.

Memory: a Checkpointer holds one delta base per part, at most one copy of the state: after a
save, the bytes of what it saved (a background save's snapshot becomes the base, a synchronous
save copies into the previous base's buffers); after ``restore(keep_base=True)``, a copy of what
it restored. Restores allocate only the state they return (or nothing, with ``into=``) plus a few
chunks per thread.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from . import commit
from .bases import Base, DeltaBases, base_of
from .chunking import auto_chunk_bytes
from .encoding import DEFAULT_DELTA_BUDGET, DEFAULT_KEYFRAME_EVERY
from .errors import CheckpointError, CorruptCheckpoint, NoCheckpoint, ObjectNotFound, StoreError
from .gc import GcReport, collect_garbage
from .leases import Lease
from .manifest import Fragment, Manifest, loads_fragment
from .restore import Problem, inspect_part, restore_part
from .retention import RetentionPolicy
from .save import EncodedPart, Snapshot, WriteOptions, encode_part, secure_snapshot, take_snapshot
from .store import Store

log = logging.getLogger("ckptlib")
T = TypeVar("T")

SINGLE_PART = "state"
_FRAGMENTS_KEPT = 16  # fragments of recent multi-part manifests kept by a Checkpointer


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
    blocked_s: float  # time the caller was blocked (the snapshot; the whole save for save())
    durable_s: float  # from the call until the manifest was published

    @property
    def ratio(self) -> float:
        """Logical size over bytes written: how many times smaller than a full copy."""
        return self.logical_bytes / max(self.bytes_written, 1)


class SaveFuture(Future):
    """What ``save_async`` returns: ``result()`` gives the ``CommitInfo`` or raises the save's error.
    An error taken from here is not raised again by the Checkpointer's next call."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step
        self.observed = False

    def result(self, timeout: float | None = None) -> CommitInfo:
        try:
            value = super().result(timeout)
        except FutureTimeout:
            raise
        except BaseException:
            self.observed = True
            raise
        self.observed = True
        return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        e = super().exception(timeout)
        self.observed = True
        return e


def default_threads(store: Store) -> int:
    """Encode/IO threads: twice the cores (numpy, zstd and hashing release the GIL); at least 16
    for a remote store, where most of a thread's time is a request in flight."""
    cores = (os.cpu_count() or 2) * 2
    return min(32, cores) if store.capabilities.atomic_rename else min(64, max(16, cores))


class Checkpointer:
    """Incremental, content-addressed checkpoints of nested tensor states under one URL.

    ``url``: a plain path, ``file:///abs/path``, ``memory://name`` or ``s3://bucket/prefix``;
    ``storage_options`` go to fsspec/s3fs (endpoint_url, key, secret, ...).
    Options: ``chunk_bytes`` (default: what the part was saved with before, else about 1/32 of the
    state between 256 KiB and 4 MiB; smaller tensors are packed together up to it),
    ``keyframe_every`` K (restore reads at most K objects per chunk; 1 = keyframes only; default
    32), ``delta_budget`` B (a chunk gets a new keyframe once its chain's deltas add up to B times
    its keyframe's size, so a restore reads at most 1 + B keyframes' worth of bytes per chunk;
    default 2; None = only K bounds chains), ``zstd_level``, ``threads`` (encode/IO pool size),
    ``max_upload_bytes_per_s`` (upload bandwidth limit; None = unlimited), ``reuse_buffers``
    (keep a background save's staging buffers for the next one: faster snapshots, one more copy of
    the state in memory; default: only for GPU states, whose pinned buffers are slow to allocate).
    """

    def __init__(self, url: str | Store, storage_options: dict | None = None, *,
                 chunk_bytes: int | None = None, keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
                 delta_budget: float | None = DEFAULT_DELTA_BUDGET, zstd_level: int = 3,
                 threads: int | None = None, max_upload_bytes_per_s: float | None = None,
                 reuse_buffers: bool | None = None):
        self.options = WriteOptions.checked(chunk_bytes, keyframe_every, delta_budget, zstd_level,
                                            max_upload_bytes_per_s)
        self.store = url if isinstance(url, Store) else Store.from_url(url, storage_options)
        self.reuse_buffers = reuse_buffers
        self._pool = ThreadPoolExecutor(max_workers=threads or default_threads(self.store), thread_name_prefix="ckpt-io")
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-persist")
        self._bases = DeltaBases(self._committed_base)
        # Manifests are read afresh by every call: GC (maybe another process's) drops steps, and a
        # step dropped may be committed again with another state. Fragments a manifest names are
        # immutable by their checksum, so the last few are kept.
        self._fragments: OrderedDict[tuple, Fragment] = OrderedDict()
        self._inflight: SaveFuture | None = None
        self._marked = False
        self._closed = False
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.store.url

    # --- saving ----------------------------------------------------------------------------------

    def save(self, step: int, state: Any, *, meta: dict | None = None) -> CommitInfo:
        """Encode, upload and commit ``state`` as ``step``; returns when it is durable.

        CPU tensors are encoded in place from their own memory (no copy of the state), so the state
        must not change until this returns; use ``save_async`` to go on training meanwhile."""
        commit.check_step(step)
        self._check_open()
        t0 = time.perf_counter()
        self._drain()
        snap = take_snapshot(state, self._pool, self._chunk_size(SINGLE_PART), copy=False,
                             buffers=self._bases.buffers(SINGLE_PART).take)
        return self._persist(step, snap, meta, t0, blocked=None)

    def save_async(self, step: int, state: Any, *, meta: dict | None = None) -> SaveFuture:
        """Return once ``state`` is copied; the caller may then change it. At most one save is in
        flight: this first waits for the previous one (and raises its error if nobody took it
        from its future)."""
        commit.check_step(step)
        self._check_open()
        t0 = time.perf_counter()
        self._drain()
        buffers = self._bases.buffers(SINGLE_PART).take
        snap = take_snapshot(state, self._pool, self._chunk_size(SINGLE_PART), copy=False, buffers=buffers)
        secure_snapshot(snap, self._bases.held(SINGLE_PART), self._pool, buffers)  # no copy of the caller's memory kept
        fut = SaveFuture(step)

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(self._persist(step, snap, meta, t0, blocked=snap.seconds))
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                fut.set_exception(e)

        with self._lock:
            self._inflight = fut
        self._background.submit(run)
        return fut

    def wait(self) -> None:
        """Block until no save is in flight; raise the error of a failed background save that
        nobody took from its future."""
        self._drain()

    def _drain(self) -> None:
        with self._lock:
            fut, self._inflight = self._inflight, None
        if fut is None:
            return
        try:
            super(SaveFuture, fut).result()  # wait without marking it observed
        except BaseException as e:  # noqa: BLE001
            if not fut.observed:
                fut.observed = True
                raise CheckpointError(f"the background save of step {fut.step} failed: {e}") from e

    def _committed_base(self, part: str) -> Base | None:
        """The delta base of a part this writer has neither saved nor restored yet: the blob table of
        the latest committed checkpoint, so its unchanged chunks are referenced instead of re-encoded
        (deltas need the base bytes, which only a save or a restore brings)."""
        latest = self.latest_step()
        if latest is None:
            return None
        m = self._read_manifest(latest)
        if part not in m.parts:
            return None
        return base_of(self._fragment(m, part), self.options.chunk_bytes)

    def _chunk_size(self, part: str) -> int | Any:
        """The chunk size of ``part``'s next save: the option, else its base's (so deltas line up),
        else one chosen from the state's size."""
        if self.options.chunk_bytes is not None:
            return self.options.chunk_bytes
        base = self._bases.get(part)
        if base is not None and base.chunk_bytes:
            return base.chunk_bytes
        return auto_chunk_bytes

    def _ensure_marker(self) -> None:
        if not self._marked:
            commit.ensure_marker(self.store)
            self._marked = True

    def _save_part(self, snap: Snapshot, part: str, step: int, publish: Callable[[EncodedPart], T],
                   **kw: Any) -> T:
        """The one save path of a part: under a save lease, encode ``snap`` against the part's base,
        make sure what it needs survived a GC that ran beside it, then ``publish(encoded)`` (commit a
        manifest, or write a fragment). Only once that succeeded does the result become the part's
        next base; a failure forgets the base's bytes (a save that read the caller's memory in place
        may have written over them)."""
        base = self._bases.get(part)
        with Lease(self.store, "save", base.step if base else None) as lease:
            self._ensure_marker()  # under the lease: a GC running beside it leaves its temp file alone
            try:
                enc = encode_part(snap, base, self.store, self._pool, self.options, step=step, part=part,
                                  lease=lease, retain=True, **kw)
                missing = lease.before_publish([b.key for b in enc.fragment.blobs.values()], enc.reused)
                if missing:
                    # A GC that held the lock as this save began swept objects it wrote or built on
                    # (docs/format.md, "Garbage collection"): encode again, keyframes only. That GC
                    # has ended, and every later one sees this lease.
                    log.warning("a garbage collection beside this save of step %d swept %d objects it needs (e.g. "
                                "%s): writing part '%s' again as keyframes", step, len(missing), missing[0], part)
                    enc = encode_part(snap, None, self.store, self._pool, self.options, step=step, part=part,
                                      lease=lease, retain=True, **kw)
                    missing = lease.before_publish([b.key for b in enc.fragment.blobs.values()], {})
                    if missing:
                        raise StoreError(f"{len(missing)} objects of step {step} (e.g. {self.url}/{missing[0]}) "
                                         "vanished as they were written: is another program deleting in this store?")
                result = publish(enc)
            except BaseException:
                self._bases.forget_bytes(part)
                raise
        keep_spare = self.reuse_buffers if self.reuse_buffers is not None else _pinned(snap)
        self._bases.adopt(part, enc.next_base, base, keep_spare)  # type: ignore[arg-type]
        return result

    def _persist(self, step: int, snap: Snapshot, meta: dict | None, t0: float, blocked: float | None) -> CommitInfo:
        def publish(enc: EncodedPart) -> tuple[Manifest, bool]:
            base = self._bases.held(SINGLE_PART)
            return commit.commit_step(self.store, step, {SINGLE_PART: (enc.fragment, None)},
                                      parent=base.step if base else None, single=True, meta=meta)

        manifest, created = self._save_part(snap, SINGLE_PART, step, publish)
        if not created:
            log.info("step %d was already committed with the same digest: nothing new published", step)
        durable = time.perf_counter() - t0
        return self._info(manifest, created, durable if blocked is None else blocked, durable)

    @staticmethod
    def _info(m: Manifest, created: bool, blocked: float, durable: float) -> CommitInfo:
        return CommitInfo(m.step, m.digest, m.bytes_written, m.logical_bytes,
                          m.stored_bytes, m.kind, m.stats, created, blocked, durable)

    # --- reading ---------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return commit.committed_steps(self.store)

    def latest_step(self, *, healthy: bool = False) -> int | None:
        """The newest committed step (``healthy``: the newest whose validation passed), or None.
        One listing of the manifests; ``healthy`` then reads verdicts from the newest step back
        until one passed (not every step's, as ``healthy_steps`` does)."""
        steps = self.steps()
        if not healthy:
            return steps[-1] if steps else None
        return next((step for step in reversed(steps) if self._healthy(step)), None)

    def manifest(self, step: int | None = None) -> Manifest:
        return self._read_manifest(self._resolve(step, healthy=False))

    def fragment(self, step: int, part: str) -> Fragment:
        """The fragment of one part of committed ``step`` (checked against its manifest)."""
        return self._fragment(self._read_manifest(commit.check_step(step)), part)

    def restore(self, step: int | None = None, *, healthy: bool = False, part: str | None = None,
                device: Any = "cpu", into: Any = None, select: list[str] | None = None,
                keep_base: bool = False) -> Any:
        """The state of ``step`` (None = the latest committed; ``healthy=True``: the latest that
        passed validation), bit-exact and checked against the manifest's digests. Tensors land on
        ``device`` (CPU by default).

        ``into``: a state of the same structure (e.g. ``{"model": model.state_dict(),
        "optimizer": opt.state_dict()}``) whose tensors and arrays are filled in place, CPU or GPU;
        names, shapes and dtypes are checked first and every mismatch is listed in one ValueError
        before anything changes. The returned state holds those same tensors, with every other
        value (step counters, hyperparameters) from the checkpoint: pass it to
        ``optimizer.load_state_dict``. Values the destination lacks (a fresh optimizer's moments)
        are allocated. ``select``: restore only these top-level keys or '/'-paths (e.g.
        ``["model"]`` for evaluation): only their objects are read.

        A single-writer checkpoint returns its state; a multi-part one returns ``{part: state}``,
        or one part's state when ``part`` is given. ``keep_base=True`` also keeps a copy of what was
        restored as the delta base of this Checkpointer's next save (one more copy of the state in
        memory; without it, the next save writes changed chunks as keyframes). Chunks this
        Checkpointer holds already (its base) are copied, not fetched: a follower that restores
        every new step with ``keep_base=True`` decodes one link per changed chunk.
        """
        self._check_open()
        self._drain()
        lease = None
        if step is not None and step != self.latest_step():
            # GC never drops the newest step; an older one may be dropped while it is read: a read lease
            lease = Lease(self.store, "read", commit.check_step(step)).try_acquire()
        try:
            m = self._read_manifest(self._resolve(step, healthy=healthy))
            names = [part] if part is not None else list(m.parts)
            if into is not None and part is None and not m.single:
                into_parts = into
            else:
                into_parts = {names[0]: into} if into is not None else {}
            out = {}
            for name in names:
                frag = self._fragment(m, name)
                held = self._bases.held(name)
                state, raw = restore_part(frag, self.store, self._pool, device=device, into=into_parts.get(name),
                                          select=select, keep=keep_base,
                                          known=held.raw if held is not None else None)
                if raw is not None:
                    self._bases.set(name, base_of(frag, self.options.chunk_bytes, raw))
                out[name] = state
        finally:
            if lease is not None:
                lease.release()
        if part is not None:
            return out[part]
        return out[SINGLE_PART] if m.single else out

    def verify(self, step: int | None = None) -> list[Problem]:
        """Decode every chunk of ``step`` and check every checksum, digest, the skeleton and the
        parts the manifest commits; [] when it is intact."""
        self._check_open()
        m = self._read_manifest(self._resolve(step, healthy=False))
        problems = []
        for name in m.parts:
            try:
                frag = self._fragment(m, name)
            except CorruptCheckpoint as e:
                problems.append(Problem(m.step, name, "/", None, None, str(e)))
                continue
            problems += inspect_part(frag, self.store, self._pool)[1]
        return problems

    def export(self, step: int | None, path: str, *, part: str | None = None, force: bool = False) -> int:
        """Write ``step`` (None = the latest) as a ``.pt`` or ``.safetensors`` file (ckptlib.export);
        returns its size. Refuses to overwrite ``path`` without ``force``."""
        from .export import format_of, write_export

        format_of(path)
        m = self.manifest(step)
        state = self.restore(m.step, part=part)
        return write_export(state, path, info={"url": self.url, "step": m.step, "digest": m.digest}, force=force)

    def _read_manifest(self, step: int) -> Manifest:
        """The committed manifest of ``step``, as the store has it now."""
        return commit.read_manifest(self.store, step)

    def _fragment(self, m: Manifest, part: str) -> Fragment:
        ref = m.parts.get(part)
        if ref is None or ref.fragment is not None:
            return commit.load_part(self.store, m, part)  # embedded (or a clear error)
        key = (m.step, part, ref.key, ref.checksum)
        if key in self._fragments:
            self._fragments.move_to_end(key)
        else:
            self._fragments[key] = commit.load_part(self.store, m, part)
            while len(self._fragments) > _FRAGMENTS_KEPT:
                self._fragments.popitem(last=False)
        return self._fragments[key]

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
        """The validation verdict of ``step``; None if there is none or it is not a valid verdict
        document (then the step counts as not validated, and a warning names the object)."""
        try:
            doc = json.loads(self.store.get(commit.validation_key(step)))
        except ObjectNotFound:
            return None
        except (ValueError, RecursionError):
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("passed"), bool):
            log.warning("%s/%s is not a valid verdict: step %d counts as not validated", self.url,
                        commit.validation_key(step), step)
            return None
        return doc

    def healthy_steps(self) -> list[int]:
        """Committed steps whose validation passed, ascending. Failed ones are skipped (logged)."""
        return [step for step in self.steps() if self._healthy(step)]

    def _healthy(self, step: int) -> bool:
        """Whether ``step``'s validation passed. A failed one is logged: it is being skipped."""
        v = self.verdict(step)
        if v is not None and v["passed"] is True:
            return True
        if v is not None:
            failed = v.get("failed")
            failed = failed if isinstance(failed, list) else []
            log.warning("skipping checkpoint step %d of %s: its validation failed (%s)", step, self.url,
                        ", ".join(map(str, failed)) or f"see validations/{step}.json")
        return False

    # --- multi-writer: fragments and the coordinator's commit ------------------------------------

    def write_fragment(self, step: int, part: str, state: Any, *, generation: int = 0,
                       config_hash: str | None = None, meta: dict | None = None) -> Fragment:
        """Save ``state`` as ``part`` of the cut at ``step`` (chunks, then the fragment), as
        generation ``generation``. Raises FencedError if that generation is no longer live."""
        commit.check_step(step)
        commit.check_part_name(part)
        self._check_open()
        commit.check_live(self.store, part, generation)
        snap = take_snapshot(state, self._pool, self._chunk_size(part), copy=False, buffers=self._bases.buffers(part).take)

        def publish(enc: EncodedPart) -> Fragment:
            commit.check_live(self.store, part, generation)  # fenced while encoding: do not publish it
            commit.put_fragment(self.store, enc.fragment)
            return enc.fragment

        return self._save_part(snap, part, step, publish, generation=generation, config_hash=config_hash, meta=meta)

    def read_fragment(self, step: int, part: str, *, generation: int | None = None,
                      device: Any = "cpu", adopt: bool = False, select: list[str] | None = None,
                      fragment: Fragment | None = None) -> Any:
        """The state in a (possibly not yet committed) fragment; generation None = the live one.
        Used by a coordinator to combine the shards of a cut before it commits it. ``adopt=True``
        makes the fragment the delta base of this Checkpointer's next write of ``part`` (as
        ``restore(keep_base=True)`` does). ``select``: only these top-level keys or '/'-paths
        (as in ``restore``). ``fragment``: that fragment, already read (e.g. by ``commit.gather``):
        it is not read again."""
        gen = self.live_generation(part) if generation is None else generation
        key = commit.fragment_key(commit.check_step(step), commit.check_part_name(part), gen)
        frag = fragment
        if frag is None:
            try:
                data = self.store.get(key)
            except ObjectNotFound:
                raise NoCheckpoint(f"no fragment {key} in {self.url}: part '{part}' generation {gen} has not "
                                   f"written step {step} yet") from None
            frag = loads_fragment(data, f"{self.url}/{key}")
        if (frag.step, frag.part, frag.generation) != (step, part, gen):
            raise CorruptCheckpoint(f"{self.url}/{key} describes step {frag.step}, part '{frag.part}', generation "
                                    f"{frag.generation}")
        if adopt and select is not None:
            raise ValueError("adopt=True needs the whole part (it becomes the delta base): drop select")
        state, raw = restore_part(frag, self.store, self._pool, device=device, keep=adopt, select=select)
        if raw is not None:
            self._bases.set(part, base_of(frag, self.options.chunk_bytes, raw))
        return state

    def gather(self, step: int, parts: list[str], *, timeout: float = 600.0) -> dict[str, tuple[Fragment, str]]:
        """Coordinator: wait until every part has a fragment of its live generation for ``step``;
        {part: (fragment, checksum of its stored bytes)} (``commit.gather``), what ``commit(fragments=)``
        then commits exactly."""
        return commit.gather(self.store, commit.check_step(step), [commit.check_part_name(p) for p in parts],
                             timeout=timeout)

    def commit(self, step: int, parts: list[str], *, timeout: float = 600.0, meta: dict | None = None,
               parent: int | None = None, lineage: dict | None = None,
               fragments: dict[str, tuple[Fragment, str]] | None = None) -> CommitInfo:
        """Coordinator: wait for a fragment of the live generation of every part, then publish the
        cut. The manifest names each part's fragment object (it stays O(parts) in size).

        ``fragments``: parts already gathered (``commit.gather``: fragment and the checksum of its
        stored bytes), committed exactly as given: a coordinator that combined those very fragments
        commits them, not a generation fenced in since. Only the other parts are waited for."""
        t0 = time.perf_counter()
        given = dict(fragments or {})
        missing = [p for p in parts if p not in given]
        found = self.gather(step, missing, timeout=timeout) if missing else {}
        if parent is None:
            prior = [s for s in self.steps() if s < step]
            parent = prior[-1] if prior else None
        manifest, created = commit.commit_step(self.store, step, {p: (given.get(p) or found[p]) for p in parts},
                                               parent=parent, meta=meta, lineage=lineage)
        return self._info(manifest, created, 0.0, time.perf_counter() - t0)

    def fence(self, part: str, generation: int, reason: str = "", by: str = "",
              details: dict | None = None) -> bool:
        return commit.fence(self.store, commit.check_part_name(part), generation, reason, by, details)

    def live_generation(self, part: str) -> int:
        return commit.live_generation(self.store, part)

    # --- retention -------------------------------------------------------------------------------

    def gc(self, policy: RetentionPolicy, *, grace_s: float = 600.0, dry_run: bool = False) -> GcReport:
        """Drop checkpoints the policy does not keep and sweep unreferenced objects (see ckptlib.gc)."""
        self._check_open()
        self._drain()
        self._fragments.clear()
        return collect_garbage(self.store, policy, grace_s=grace_s, dry_run=dry_run)

    # --- lifetime --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this Checkpointer of {self.url} is closed; create a new one")

    def close(self) -> None:
        """Wait for a save in flight (raising its error if nobody took it), then free threads and
        memory. Idempotent."""
        if self._closed:
            return
        try:
            self._drain()
        finally:
            self._closed = True
            self._background.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self._bases.clear()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _pinned(snap: Snapshot) -> bool:
    """Whether a snapshot's buffers are pinned host memory (a GPU state's)."""
    if not snap.unit_data or "torch" not in sys.modules:
        return False
    import torch

    return torch.cuda.is_available() and torch.from_numpy(snap.unit_data[0]).is_pinned()
