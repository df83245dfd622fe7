"""Where a shard attempt continues its round: the newest shard checkpoint its generation may use.

(Where a whole run starts, from which committed step, is ``trainrun.resume``'s: the resume rules.)

A shard checkpoint (``trainrun.shard_checkpoint``) is the sub-step fragment
``fragments/<round>/<part>.g<gen>.k<k>.json`` (``ckptlib.commit.substep_key``): the shard's complete
state after ``k`` steps of round ``round``, written by generation ``gen`` while it trained. An
attempt of generation G continues from

* the newest one generation G wrote itself: a Prefect retry, a task Dask ran again after its worker
  died, a resumed run. All of G's checkpoints are a live generation's;
* else the one the fence of G records (``Fence.resume``): a watchdog that fences generation G-1
  looks for G-1's newest checkpoint (``resume_point`` of G-1) *before* it creates the fence and
  records it there. What G-1 writes after that (a zombie that cannot see its fence) has a higher
  ``k`` and is never used;
* else none: the round's cut.

The attempt checks what it found against its round's cut and its spec before using it
(``trainrun.shard_checkpoint.load_checkpoint``). Torch-free: the watchdog calls ``resume_point``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ckptlib import commit
from ckptlib.documents import Document, DocumentError
from ckptlib.errors import StoreError
from ckptlib.store import Store

log = logging.getLogger("trainrun.resume_point")


@dataclass(frozen=True)
class ShardCheckpointRef(Document):
    """One shard checkpoint: ``part``'s state after ``round_step`` steps of round ``round``, written
    by generation ``generation`` under ``key``."""

    KIND = "shard checkpoint reference"

    part: str
    round: int
    generation: int
    round_step: int
    key: str

    def __post_init__(self) -> None:
        if self.key != commit.substep_key(self.round, self.part, self.generation, self.round_step):
            raise ValueError(f"key {self.key!r} is not the shard checkpoint's key")


def newest_of(store: Store, part: str, round_no: int, generation: int) -> ShardCheckpointRef | None:
    """The newest shard checkpoint generation ``generation`` of ``part`` wrote in round ``round_no``
    (one listing of ``fragments/<round>/``), or None."""
    keys = commit.substep_keys(store, round_no, part, generation)
    if not keys:
        return None
    k = max(keys)
    return ShardCheckpointRef(part, round_no, generation, k, keys[k])


def recorded_in_fence(store: Store, part: str, generation: int) -> ShardCheckpointRef | None:
    """The shard checkpoint the fence of ``generation`` records (what the fenced generation had
    written while it was live), or None (no fence, none recorded, or unreadable: logged)."""
    doc = commit.read_fence(store, part, generation) if generation > 0 else None
    if not doc or doc.get("resume") is None:
        return None
    try:
        return ShardCheckpointRef.from_dict(doc["resume"], commit.fence_key(part, generation))
    except DocumentError as e:
        log.warning("%s: the shard checkpoint its fence records is not used: %s", part, e)
        return None


def resume_point(store: Store, part: str, round_no: int, generation: int) -> ShardCheckpointRef | None:
    """Where an attempt of ``part``'s generation ``generation`` continues round ``round_no``
    (see the module docstring); None: from the round's cut. A store that cannot be read now
    gives None too (the cut is always a correct start, only a slower one)."""
    try:
        own = newest_of(store, part, round_no, generation)
        if own is not None:
            return own
        inherited = recorded_in_fence(store, part, generation)
    except StoreError as e:
        log.warning("%s round %d: cannot look for shard checkpoints (%s): starting from the cut", part, round_no, e)
        return None
    return inherited if inherited is not None and inherited.round == round_no else None
