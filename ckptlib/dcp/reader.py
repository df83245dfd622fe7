"""``StorageReader``: ``torch.distributed.checkpoint.load`` from a ckptlib step (docs/integrations.md).

Every rank reads the step's Metadata (part ``dcp``, JSON); the coordinator's global plan stamps
its step into every rank's plan, so ranks that resolved "latest" to different steps fail instead of
mixing them. ``read_data`` restores, per rank part, only the keys its items name (checked against
their checksums like any restore): an item that is a whole saved chunk is decoded straight into the
planner's tensor (``restore(into=)``); of a true slice (resharding), the chunk is restored and the
slice copied in.
"""

from __future__ import annotations

import os
import uuid
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import StorageReader as _DCPReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .. import commit
from ..checkpointer import Checkpointer
from ..errors import CheckpointError, CorruptCheckpoint, NoCheckpoint
from ..manifest import Fragment
from .backend import Backend, step_of
from .metadata import Location, from_json
from .writer import METADATA_PART

MAX_METADATA_BYTES = 1 << 30  # checked before the metadata is read: a step's JSON, far above any real one


class StorageReader(_DCPReader):
    """``dcp.load(state, storage_reader=StorageReader(url, step=None))``: fill ``state`` from ckptlib
    step ``step`` of ``url`` (None: the latest committed), on any number of ranks, whatever the
    layout it was saved with. ``url``: a store URL or a ``Checkpointer``, as for StorageWriter."""

    def __init__(self, url: str | Checkpointer, step: int | None = None, *, storage_options: dict | None = None,
                 **options: Any):
        super().__init__()
        self._backend = Backend(url, storage_options, options)
        self.step = None if step is None else commit.check_step(step)
        self._read_step: int | None = None
        self._holding = ExitStack()  # the step held (Checkpointer.reading) from read_metadata to read_data's end
        self._where: dict[MetadataIndex, Location] = {}
        self._chunks: dict[MetadataIndex, tuple[tuple[int, ...], torch.dtype]] = {}  # saved chunk: sizes, dtype

    @property
    def checkpointer(self) -> Checkpointer:
        return self._backend.checkpointer

    def close(self) -> None:
        self._holding.close()
        self._backend.close()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._holding.close()
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    def read_metadata(self) -> Metadata:  # one global Metadata per step, no rank-local one
        ck = self.checkpointer
        self._holding.close()  # a step an earlier load of this reader held, if it failed before read_data's end
        try:  # one read lease and one manifest read for the whole load, not one per restore below
            step = self._holding.enter_context(ck.reading(self.step))
        except NoCheckpoint as e:
            if self.step is not None:
                raise
            raise NoCheckpoint(f"{e}: nothing to load; save one with "
                               "dcp.save(state, storage_writer=ckptlib.dcp.StorageWriter(url, step=N))") from None
        try:
            return self._metadata(ck, step)
        except BaseException:
            self._holding.close()
            raise

    def _metadata(self, ck: Checkpointer, step: int) -> Metadata:
        parts = ck.manifest(step).parts
        if METADATA_PART not in parts:
            raise NoCheckpoint(f"step {step} of {ck.url} was not saved through ckptlib.dcp (its parts: "
                               f"{', '.join(parts)}): read it with Checkpointer.restore, or load a step dcp.save wrote")
        where = f"step {step} of {ck.url}"
        frag = ck.fragment(step, METADATA_PART)
        if not isinstance(frag, Fragment):
            raise CorruptCheckpoint(f"part '{METADATA_PART}' of {where} is a group's part, not the DCP metadata")
        size = sum(leaf.spec.nbytes for leaf in frag.leaves)
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpoint(f"the DCP metadata of {where} claims {size} bytes, over the {MAX_METADATA_BYTES} "
                                    "this reader accepts: the checkpoint is corrupt or not ckptlib's")
        doc = ck.restore(step, part=METADATA_PART)
        if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), bytes):
            raise CorruptCheckpoint(f"part '{METADATA_PART}' of {where} holds no DCP metadata bytes")
        metadata = from_json(doc["metadata"], step, where)
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = uuid.uuid4().hex
        self._read_step = step
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        where = metadata.storage_data
        if not isinstance(where, dict) or not all(isinstance(v, Location) for v in where.values()):
            raise ValueError("this Metadata was not read by ckptlib.dcp.StorageReader: use the same reader for "
                             "read_metadata and the load")
        self._where = where
        self._chunks = {MetadataIndex(fqn, c.offsets): (tuple(c.sizes), md.properties.dtype)
                        for fqn, md in metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata) for c in md.chunks}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The coordinator's step, stamped into every rank's plan (checked in ``read_data``)."""
        return [replace(plan, storage_data=self._read_step) for plan in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Restore the items of ``plan``, one ``restore(select=)`` per rank part, into the planner."""
        with self._holding:  # the step read_metadata held: released once this rank's reads are done
            if plan.storage_data != self._read_step:
                raise CheckpointError(f"this rank read the metadata of step {self._read_step}, the coordinator of "
                                      f"step {plan.storage_data}: a step was committed as the load began; pass step= "
                                      "to StorageReader so every rank loads the same one")
            wanted: dict[tuple[int, str], list[tuple[ReadItem, Location]]] = {}
            for item in plan.items:
                loc = self._where.get(item.storage_index)
                if loc is None:
                    raise CorruptCheckpoint(f"step {self._read_step}'s DCP metadata does not say where "
                                            f"{item.storage_index} is stored")
                wanted.setdefault((loc.step, loc.part), []).append((item, loc))
            self._read_parts(self.checkpointer, wanted, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_parts(self, ck: Checkpointer, wanted: dict[tuple[int, str], list[tuple[ReadItem, Location]]],
                    planner: LoadPlanner) -> None:
        for (step, part), reqs in wanted.items():
            into, whole, rest = {}, [], []
            for item, loc in reqs:
                target = None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach()
                if target is not None and self._is_whole(item, target):
                    into[loc.key] = target
                    whole.append((item, target))
                else:
                    rest.append((item, loc, target))
            # whole saved tensors are decoded straight into the planner's tensors (checked first)
            values = ck.restore(step, part=part, select=sorted({loc.key for _, loc in reqs}), into=into or None)
            for item, target in whole:
                planner.commit_tensor(item, target)
            for item, loc, target in rest:
                _deliver(planner, item, target, values[loc.key],
                         f"'{loc.key}' of part '{part}' of step {step} of {ck.url}")

    def _is_whole(self, item: ReadItem, target: torch.Tensor) -> bool:
        """Whether ``item`` is a whole saved chunk and ``target`` has its shape and dtype: then the
        chunk is decoded straight into ``target``, else (a slice: resharding) restored and copied."""
        saved = self._chunks.get(item.storage_index)
        return saved is not None and not any(item.storage_offsets) and tuple(item.lengths) == saved[0] \
            and tuple(target.shape) == saved[0] and target.dtype == saved[1]


def _deliver(planner: LoadPlanner, item: ReadItem, target: torch.Tensor | None, value: Any, where: str) -> None:
    """Hand one restored item to the planner, as FileSystemReader does with the bytes it read:
    a value, or the item's slice of a saved tensor copied into ``target`` (its resolved tensor)."""
    if item.type == LoadItemType.BYTE_IO:
        _load_value(planner, item, value)
        return
    if not isinstance(value, torch.Tensor):
        raise CorruptCheckpoint(f"{where} is a {type(value).__name__}, where its DCP metadata says a tensor")
    assert target is not None  # resolved for every tensor item
    ends = [o + n for o, n in zip(item.storage_offsets, item.lengths)]
    if len(ends) != value.dim() or any(e > s for e, s in zip(ends, value.shape)):
        raise CorruptCheckpoint(f"{where} has shape {tuple(value.shape)}, which does not hold the slice at "
                                f"{list(item.storage_offsets)} of {list(item.lengths)} its DCP metadata names")
    piece = narrow_tensor_by_index(value, item.storage_offsets, item.lengths)
    if target.size() != piece.size():
        raise ValueError(f"the destination of {item.dest_index.fqn} has shape {tuple(target.size())}, the saved "
                         f"slice {tuple(piece.size())}: load into a state of the saved shapes")
    target.copy_(piece)
    planner.commit_tensor(item, target)


def _load_value(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """A non-tensor value into the planner, placed as ``DefaultLoadPlanner.load_bytes`` places it.
    That method unpickles (``torch.load(weights_only=False)``) what a BYTE_IO item read; here the
    value comes from ckptlib's closed grammar and no pickle is made or read, so a planner with a
    ``load_bytes`` of its own (which would want pickle bytes) is refused."""
    if type(planner).load_bytes is not DefaultLoadPlanner.load_bytes or not isinstance(planner, DefaultLoadPlanner):
        raise ValueError(f"ckptlib.dcp stores non-tensor values (such as {item.dest_index.fqn!r}) as values, not "
                         f"pickles, so it loads them only through DCP's DefaultLoadPlanner (or a subclass that keeps "
                         f"its load_bytes), not {type(planner).__name__}")
    fqn = item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value
