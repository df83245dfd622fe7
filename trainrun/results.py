"""What the runtime hands back to the tasks and flows: typed, small, never tensors.

    RunPlan      where_to_start: where the run starts (the resume rules), and why
    ShardResult  train_shard_round: one shard's round (or what became of its task: fenced, replaced)
    CutResult    cut_round and write_step_zero: one cut, committed or not

Each is a frozen ``Document``: it travels between processes as is (Dask pickles it; the work-pool
runner rebuilds a ``ShardResult`` from the shard's fragment), and ``to_dict`` is its JSON form
(Prefect states, artifacts). ``flows/summary.py`` turns them into the run's summary; ``seconds``
maps each phase of the task's body to wall seconds (``trainrun.timing``), ``total`` included.
Importing this module loads neither torch nor Prefect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ckptlib.documents import Document

from .documents import Cut


@dataclass(frozen=True)
class Reshard(Document):
    """A resume with another shard count: from committed ``step``, ``shards`` = (old, new)."""

    KIND = "reshard"

    step: int
    shards: tuple[int, ...]


@dataclass(frozen=True)
class RunPlan(Document):
    """Where a run starts: ``start_step`` None = from scratch (write step 0 first); ``committed``
    steps so far, the ``latest`` of them; ``note`` says why, for people; ``config`` the trajectory
    (a ``RunSpec`` as JSON) it trains on: a resume's comes from the run itself."""

    KIND = "run plan"

    start_step: int | None
    committed: int
    latest: int | None
    note: str
    reshard: Reshard | None = None
    seconds: float = 0.0
    config: dict[str, Any] | None = None


# finished: its fragment of the round is written; fenced: a watchdog fenced it before it wrote;
# replaced: the flow stopped waiting for it (the live generation wrote the fragment); superseded:
# it finished, but a newer generation owns the shard (a zombie that believed it was live).
ShardStatus = Literal["finished", "fenced", "replaced", "superseded"]


@dataclass(frozen=True)
class ShardResult(Document):
    """One shard's round as its task ended. Sizes, loss and timings are those of a ``finished``
    attempt (None otherwise); ``live_generation`` and ``error`` say why one was not."""

    KIND = "shard result"

    shard: int
    round: int
    part: str
    status: ShardStatus
    generation: int
    attempt: int | None = None
    loss: float | None = None
    data_position: int | None = None
    bytes_written: int | None = None
    logical_bytes: int | None = None
    chunks: dict[str, int] = field(default_factory=dict)
    digest: str | None = None
    live_generation: int | None = None
    error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    resumed_at_step: int | None = None  # the round step it started from: 0 the cut, k a shard checkpoint
    start_source: str | None = None  # cut | store | local (a shard checkpoint's local copy)
    shard_checkpoints: int = 0  # shard checkpoints it wrote in the round, and their bytes
    shard_checkpoint_bytes: int = 0
    started_at: float | None = None  # wall times: the attempt started, it trained (loaded and built)
    training_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.status == "finished"


@dataclass(frozen=True)
class CutResult(Document):
    """One cut: the coordinator's fragment of ``step`` written (and, when ``committed``, the
    manifest published; ``created`` when this call published it, not an identical earlier one).
    ``bytes_written`` is what this task wrote (the cut: the coordinator's fragment; step 0: every
    part); ``logical_bytes`` the cut's full size; ``generations`` the fragments it combined."""

    KIND = "cut result"

    step: int
    committed: bool
    created: bool
    loss: float | None
    eval_loss: float | None
    generations: dict[str, int]
    bytes_written: int
    logical_bytes: int
    digest: str | None = None  # of the manifest: only when committed
    stored_bytes: int | None = None
    kind: str | None = None
    chunks: dict[str, int] | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def next_cut(self) -> Cut:
        """The cut the next round starts from."""
        return Cut(self.step, self.committed, dict(self.generations))
