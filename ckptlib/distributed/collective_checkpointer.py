"""``CollectiveCheckpointer``: a ``Checkpointer`` whose saves, restores and fragment writes are
collective across the ranks of a process group (docs/distributed.md).

Every rank constructs one (``Checkpointer(url, process_group=pg)`` makes it) and calls ``save``,
``save_async``, ``restore``, ``write_fragment`` and ``write_fragment_async`` at the same point with
its own state. Each rank writes its own fragment through its ``PartWriter`` (``saving``); the
leader checks them together and commits the group's part; every rank gets the same outcome. The
gloo group the ranks talk over is the checkpointer's own (``Collective``). Everything else (listing,
verify, reading one rank's part, GC) is the single reader's, inherited: no collective call.

What it uses of ``Checkpointer`` is the writer (``writer``: ``PartWriter``'s public calls) and the
hooks a subclass builds on: the lifecycle (``_check_open``, ``_drain``, ``_in_background``), the
reads of a step (``_resolve``, ``_read_lease``, ``_read_manifest``, ``_fragment``) and the restore
it replaces (``_restore_plain``); none of its state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .. import commit, stateful
from ..bases import base_of
from ..checkpointer import SINGLE_PART, Checkpointer, CommitInfo, SaveFuture, check_substep, register_collective
from ..encoding import DEFAULT_DELTA_BUDGET, DEFAULT_KEYFRAME_EVERY
from ..export import Exported
from ..manifest import Manifest
from ..store import Store
from . import saving
from .collective import Collective, Outcome, RemoteError
from .documents import GroupFragment
from .restoring import check_restore, load_group, restore_group, source_rank


class CollectiveCheckpointer(Checkpointer):
    """A ``Checkpointer`` over ``process_group``'s ranks; the options are the single writer's (see
    ``Checkpointer``), except ``compact`` (refused). ``group_timeout_s``: how long a rank waits for
    the others (a hung rank fails the call then). ``rank``: this process's rank in the group."""

    def __init__(self, url: str | Store, storage_options: dict | None = None, *,
                 chunk_bytes: int | None = None, keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
                 delta_budget: float | None = DEFAULT_DELTA_BUDGET, zstd_level: int = 3,
                 threads: int | None = None, max_upload_bytes_per_s: float | None = None,
                 reuse_buffers: bool | None = None, process_group: Any = None, group_timeout_s: float = 600.0,
                 compact: bool = False):
        if compact:
            raise ValueError("compact=True is for a single writer; a collective Checkpointer does not compact (yet)")
        if process_group is None:
            raise ValueError("a CollectiveCheckpointer needs the process group of its ranks: pass process_group= "
                             "(e.g. torch.distributed.group.WORLD)")
        super().__init__(url, storage_options, chunk_bytes=chunk_bytes, keyframe_every=keyframe_every,
                         delta_budget=delta_budget, zstd_level=zstd_level, threads=threads,
                         max_upload_bytes_per_s=max_upload_bytes_per_s, reuse_buffers=reuse_buffers)
        self._collective = Collective(process_group, group_timeout_s)
        self.rank = self._collective.rank

    # --- saving: every rank calls these at the same point ----------------------------------------

    def save(self, step: int, state: Any, *, meta: dict | None = None) -> CommitInfo:
        """``Checkpointer.save``, collective: one checkpoint holds every rank's state, or none does."""
        commit.check_step(step)
        self._check_open()
        t0 = time.perf_counter()
        self._drain()
        state, _ = stateful.expand(state)
        return self._group_persist(self._group_begin(step, state, meta, copy=False), t0, blocked=None)

    def save_async(self, step: int, state: Any, *, meta: dict | None = None) -> SaveFuture[CommitInfo]:
        """``Checkpointer.save_async``, collective: the plan and this rank's snapshot now, its
        fragment and the leader's commit in the background."""
        commit.check_step(step)
        self._check_open()
        t0 = time.perf_counter()
        self._drain()
        state, _ = stateful.expand(state)
        pending = self._group_begin(step, state, meta, copy=True)
        blocked = time.perf_counter() - t0
        fut: SaveFuture[CommitInfo] = SaveFuture(step)
        self._in_background(fut, lambda: self._group_persist(pending, t0, blocked))
        return fut

    def write_fragment(self, step: int, part: str, state: Any, *, generation: int = 0,
                       config_hash: str | None = None, meta: dict | None = None) -> GroupFragment:
        """``Checkpointer.write_fragment``, collective: each rank writes its rank fragment, the leader
        the part's group fragment; every rank returns that ``GroupFragment`` (or raises the same error)."""
        commit.check_step(step)
        commit.check_part_name(part)
        self._check_open()
        self._drain()
        target = saving.Target(part, generation, config_hash, commit=False)
        out = saving.persist(self.writer, self._collective,
                             self._group_begin(step, state, meta, copy=False, target=target))
        assert isinstance(out, GroupFragment)
        return out

    def write_fragment_async(self, step: int, part: str, state: Any, *, generation: int = 0,
                             substep: int | None = None, config_hash: str | None = None, meta: dict | None = None,
                             on_written: Callable[[Any, Mapping[str, np.ndarray]], None] | None = None,
                             compress: bool = True) -> SaveFuture[Any]:
        """``Checkpointer.write_fragment_async``, collective: the plan and this rank's snapshot now,
        its rank fragment and the leader's group fragment in the background; the future's result is
        the ``GroupFragment`` (or the group's error). ``on_written``: on every rank, with the group's
        fragment and the units this rank stored."""
        commit.check_step(step)
        commit.check_part_name(part)
        check_substep(substep)
        self._check_open()
        self._drain()
        if substep is not None:
            meta = {**(meta or {}), "substep": substep}
        target = saving.Target(part, generation, config_hash, commit=False, substep=substep, compress=compress)
        pending = self._group_begin(step, state, meta, copy=True, target=target)
        fut: SaveFuture[Any] = SaveFuture(step, f"write of part '{part}'")

        def work() -> Any:
            group = saving.persist(self.writer, self._collective, pending)
            units = self.writer.unit_bytes(pending.snap, target.base_key(self.rank))
            if on_written is not None and units is not None:  # by the raw checksums its new base names
                on_written(group, units)
            return group

        self._in_background(fut, work)
        return fut

    def _group_begin(self, step: int, state: Any, meta: dict | None, *, copy: bool,
                     target: saving.Target | None = None) -> saving.Pending:
        """A collective save's foreground half (``saving.begin``)."""
        return saving.begin(self.writer, self._collective, step, state, target or saving.Target(SINGLE_PART), meta,
                            copy=copy)

    def _group_persist(self, pending: saving.Pending, t0: float, blocked: float | None) -> CommitInfo:
        """A collective save's background half: this rank's fragment, the leader's commit."""
        out = saving.persist(self.writer, self._collective, pending)
        assert isinstance(out, tuple)
        manifest, created = out
        durable = time.perf_counter() - t0
        return CommitInfo.of(manifest, created, durable if blocked is None else blocked, durable)

    # --- restoring: collective too ------------------------------------------------------------------

    def _restore_plain(self, step: int | None, healthy: bool, part: str | None, device: Any, into: Any,
                       select: list[str] | None, keep_base: bool, rank: int | None, fallback: bool) -> Any:
        """``restore``, collective: the leader picks the step, every rank checks its destination (all
        raise if one cannot be filled: nothing changes), then fills it."""
        if fallback:
            raise ValueError("restore(fallback=True) restores the latest step of a single writer's checkpoint: "
                             "give no step, and no process_group")
        self._check_open()
        self._drain()
        coll = self._collective
        if step is None:  # the latest (healthy) step: the leader's choice, so that every rank restores the same
            chosen = None
            if coll.leader:
                try:
                    chosen = Outcome(self._resolve(None, healthy=healthy))
                except Exception as e:  # noqa: BLE001 - delivered to every rank
                    chosen = Outcome(error=RemoteError.of(coll.rank, e))
            resolved = coll.broadcast(chosen, "choosing the step to restore").result()
        else:
            resolved = commit.check_step(step)
        lease = self._read_lease(resolved)  # every rank's own (see Checkpointer._leased_manifest)
        try:
            error: BaseException | None = None
            try:
                m = self._read_manifest(resolved)
                name = part if part is not None else _only_part(m)
                group = load_group(self.store, self.writer.pool, self._fragment(m, name))
                source = source_rank(group, coll.rank, coll.world, rank, select)
                check_restore(group, source, into, select)
            except Exception as e:  # noqa: BLE001 - every rank learns of it
                error = e
            coll.agree(error, "checking the restore")
            try:
                state, raw = restore_group(group, self.store, self.writer.pool, rank=source, into=into, select=select,
                                           device=device, keep=keep_base and source == coll.rank)
                if raw is not None:
                    self.writer.bases.set(saving.rank_base_key(name, coll.rank),
                                          base_of(group.fragments[source], self.options.chunk_bytes, raw))
            except Exception as e:  # noqa: BLE001
                error = e
            coll.agree(error, "restoring")
        finally:
            lease.release()
        return state

    def export(self, step: int | None, path: str, *, part: str | None = None, force: bool = False,
               convert: bool = False, select: list[str] | None = None) -> Exported:
        """``Checkpointer.export`` by this process alone: never a collective restore."""
        from ..export import format_of

        format_of(path)
        m = self.manifest(step)
        with Checkpointer(self.store) as reader:
            return reader.export(m.step, path, part=part, force=force, convert=convert, select=select)

    def close(self) -> None:
        """``Checkpointer.close``, then this rank's end of the gloo group. Idempotent."""
        try:
            super().close()
        finally:
            self._collective.close()


def _only_part(m: Manifest) -> str:
    """The one part a collective restore of ``m`` restores when none is named."""
    if m.single or len(m.parts) == 1:
        return next(iter(m.parts))
    raise ValueError(f"step {m.step} has parts {sorted(m.parts)}: pass part= to restore one of them")


register_collective(CollectiveCheckpointer)
