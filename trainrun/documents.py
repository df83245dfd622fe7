"""The documents of a training run that its processes exchange through the store (and Prefect).

* ``Cut``: the cut a round starts from, a task parameter and a part of every beat's meta;
* ``ShardInfo``: the ``meta`` of a shard attempt's beat (``heartbeats/shard-<i>.json``);
* ``CoordinatorInfo``: the ``meta`` of the coordinator's beat (``heartbeats/coordinator.json``),
  with the coordinator's ``Phase``.

``BeatMeta.of_beat`` is the one parser of a beat's meta: a meta that does not parse reads as None
(unknown), never as an error in the reader. Importing this module loads neither torch nor Prefect:
the watchdog and ``ckpt status`` read these documents and nothing else of a run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar, Literal, TypeVar

from ckptlib.documents import Document, DocumentError
from ckptlib.heartbeat import Beat

from .spec import RunSettings, RunSpec

log = logging.getLogger("trainrun.documents")

M = TypeVar("M", bound="BeatMeta")

# What the coordinator is doing: starting, waiting for its shards, cutting, waiting for the last
# validations, done. The watchdog reads it (``missing`` shards are judged only in ``shards``).
Phase = Literal["setup", "shards", "cut", "validations", "done"]


@dataclass(frozen=True)
class Cut(Document):
    """The cut a round starts from: committed step ``step``, or (between published checkpoints,
    ``committed`` false) the fragments of round ``step`` the coordinator combined, by generation."""

    KIND = "cut"

    step: int
    committed: bool = True
    generations: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of_step(cls, step: int) -> Cut:
        """The committed checkpoint ``step``."""
        return cls(step, True, {})


class BeatMeta(Document):
    """A document carried as a beat's ``meta``."""

    # How loudly a meta that does not parse is logged: a shard's is one of many and only disables
    # a rerun from its beat; the coordinator's carries the run's spec and phase.
    UNREADABLE_LOG_LEVEL: ClassVar[int] = logging.DEBUG

    @classmethod
    def of_beat(cls: type[M], beat: Beat) -> M | None:
        """``beat``'s meta as this document, or None (logged) when it has none that parses."""
        try:
            return cls.from_dict(beat.meta, f"heartbeats/{beat.part}.json meta")
        except DocumentError as e:
            log.log(cls.UNREADABLE_LOG_LEVEL, "%s", e)
            return None


@dataclass(frozen=True)
class ShardInfo(BeatMeta):
    """The ``meta`` of a shard attempt's beat: the cut its round starts from, its spec's hash, so a
    watchdog can rerun the round even when no coordinator beats."""

    KIND = "shard heartbeat meta"

    cut: Cut
    config_hash: str
    checkpoint_step: int | None = None  # the round step of its newest shard checkpoint written


@dataclass(frozen=True)
class CoordinatorInfo(BeatMeta):
    """The ``meta`` of the coordinator's beat: what a watchdog needs to rerun a shard or restart
    the run (the spec and settings, the round's phase and cut, the Prefect flow run and deployment)."""

    KIND = "coordinator heartbeat meta"
    UNREADABLE_LOG_LEVEL = logging.WARNING

    run_id: str = ""
    spec: RunSpec | None = None
    settings: RunSettings = field(default_factory=RunSettings)
    phase: Phase = "setup"
    phase_time: float = 0.0
    cut: Cut | None = None
    flow_run_id: str | None = None
    deployment_id: str | None = None
