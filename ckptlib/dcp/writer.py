"""``StorageWriter``: ``torch.distributed.checkpoint.save`` into a ckptlib store (docs/integrations.md).

Each rank's ``write_data`` writes its items as one ckptlib part fragment (``dcp-r<rank>``: {item key:
tensor or value}) through a Checkpointer of its own, delta-coded against what that Checkpointer
wrote before; the coordinator's ``finish``, which DCP runs once every rank's writes are gathered,
writes DCP's Metadata as JSON (part ``dcp``) and commits the step naming all of them. No
collective of its own: DCP's plan and write gathers are the only ones.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import StorageWriter as _DCPWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import commit
from ..checkpointer import Checkpointer, CommitInfo
from .backend import Backend, step_of
from .metadata import Location, item_key, to_json

METADATA_PART = "dcp"
DCP_VERSION = "1.0.0"  # the Metadata version DCP 2.13's FileSystemWriter writes


@dataclass(frozen=True)
class RankTarget:
    """What the coordinator's global plan tells one rank: the step, and the part its items go to."""

    step: int
    part: str


def rank_part(rank: int) -> str:
    """The part that holds rank ``rank``'s items."""
    return f"dcp-r{rank}"


class StorageWriter(_DCPWriter):
    """``dcp.save(state, storage_writer=StorageWriter(url, step=N))``: the state lands as ckptlib
    step ``N`` of ``url``, committed atomically once every rank's part is written.

    ``url``: a store URL (``storage_options`` and Checkpointer ``**options`` such as
    ``chunk_bytes`` apply), or a ``Checkpointer`` to write through. Keep one writer per rank for
    the whole run and name each save's step with ``dcp.save(..., checkpoint_id=N)`` (or set
    ``.step``): its Checkpointer then holds the last save's bytes and writes changed chunks as
    deltas. A writer built afresh for a save still references every unchanged chunk of the latest
    committed step, but writes changed ones whole. ``last_commit``: the coordinator's CommitInfo of
    its latest save. ``close()`` frees what it holds."""

    def __init__(self, url: str | Checkpointer, step: int | None = None, *, storage_options: dict | None = None,
                 commit_timeout_s: float = 600.0, **options: Any):
        super().__init__()
        self._backend = Backend(url, storage_options, options)
        self.step = None if step is None else commit.check_step(step)
        self.commit_timeout_s = commit_timeout_s
        self.last_commit: CommitInfo | None = None
        self._lock = threading.Lock()  # dcp.async_save runs saves in threads: one uses the Checkpointer at a time

    @property
    def checkpointer(self) -> Checkpointer:
        return self._backend.checkpointer

    def close(self) -> None:
        with self._lock:
            self._backend.close()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never picked by DCP on its own: a step number is no store

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise ValueError("ckptlib.dcp.StorageWriter has no step to save: build it with step=N, set .step, or "
                             "call dcp.save(..., checkpoint_id=N)")
        if not kwargs.get("use_collectives", True) and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("ckptlib.dcp commits one step once every rank's part is written, which needs DCP's "
                             "collectives: call dcp.save with use_collectives=True (the default)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Rank ``i``'s plan names its part and the coordinator's step: every rank writes the same
        step (whatever its own writer was told), and ``write_data`` needs no rank of its own."""
        assert self.step is not None  # set_up_storage_writer checked
        return [replace(plan, storage_data=RankTarget(self.step, rank_part(i))) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items as one fragment of its part; returns when it is stored."""
        target = plan.storage_data
        if not isinstance(target, RankTarget):
            raise ValueError(f"this SavePlan was not prepared by ckptlib.dcp.StorageWriter (storage_data "
                             f"{target!r}): pass a ckptlib.dcp.StorageWriter to dcp.save on every rank")
        state: dict[str, Any] = {}
        results = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                value, size = _value_of(planner, item.index), 0
            else:
                data = planner.resolve_data(item)
                if not isinstance(data, torch.Tensor):
                    raise ValueError(f"the planner resolved tensor item {item.index.fqn!r} to a {type(data).__name__}")
                value = _standalone(data)
                size = value.nbytes
            key = item_key(item.index)
            state[key] = value
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data=Location(target.step, target.part, key)))
        with self._lock:
            self.checkpointer.write_fragment(target.step, target.part, state)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank's ``write_data`` returned: store ``metadata`` as JSON and
        commit the step naming every rank's part and it."""
        parts = [rank_part(i) for i in range(len(results))]
        where: dict[MetadataIndex, Location] = {wr.index: wr.storage_data for rank in results for wr in rank}
        steps = {loc.step for loc in where.values()}
        if len(steps) > 1 or not {loc.part for loc in where.values()} <= set(parts):
            raise ValueError(f"the write results of this save name steps {sorted(steps)} and parts "
                             f"{sorted({loc.part for loc in where.values()})}: every rank must save through a "
                             "ckptlib.dcp.StorageWriter in the same dcp.save call")
        step = steps.pop() if steps else self.step  # no item at all: the step this writer was told
        assert step is not None
        metadata.version = metadata.version or DCP_VERSION
        with self._lock:
            ck = self.checkpointer
            ck.write_fragment(step, METADATA_PART, {"metadata": to_json(metadata, where)})
            self.last_commit = ck.commit(step, [*parts, METADATA_PART], timeout=self.commit_timeout_s,
                                         meta={"dcp": {"ranks": len(parts), "version": metadata.version}})
        metadata.storage_data = where


def _value_of(planner: SavePlanner, index: MetadataIndex) -> Any:
    """A non-tensor item's value itself: stored in ckptlib's JSON grammar, where DCP would pickle it."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise ValueError(f"ckptlib.dcp stores non-tensor values (such as {index.fqn!r}) as values, not pickles: it "
                         f"needs a planner with lookup_object (DCP's DefaultSavePlanner), not {type(planner).__name__}")
    return lookup(index)


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a dense CPU tensor of its own: a shard's view would otherwise be stored with
    the whole storage it views."""
    t = tensor.detach()
    if t.device.type != "cpu":
        return t.to("cpu")
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)
