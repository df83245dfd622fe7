"""What one attempt at one shard's round is (``ShardAttempt``), the shard's own generators
(``ShardRNG``) and the process's thread count (``apply_threads``): what every step of an attempt
(``trainrun.attempt``, which runs it) and its shard checkpoints (``trainrun.shard_checkpoint``)
take. Loads torch (the generators)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .layout import shard_part

if TYPE_CHECKING:
    from ckptlib import Checkpointer

    from .chaos import Chaos
    from .documents import Cut
    from .spec import RunSpec


def apply_threads(spec: RunSpec) -> None:
    """``torch.set_num_threads`` is process-wide: every task of a run sets the same value."""
    if torch.get_num_threads() != spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)


class ShardRNG:
    """A shard's own generators (torch, numpy, python), seeded from (seed, shard, round).

    Shards run as threads of one process by default, so global RNGs would be shared: nothing in a
    run uses them. The built-in workloads draw their batches from generators of (seed, shard,
    position) and need none of these; they are kept (and saved, as the run layout asks) for
    workloads or augmentations that want per-shard randomness.
    """

    def __init__(self, seed: int, shard: int, round_no: int):
        from workloads.common import derive_seed

        s = derive_seed("shard-rng", seed, shard, round_no)
        self.torch = torch.Generator().manual_seed(s)
        self.numpy = np.random.RandomState(s % 2**32)
        self.python = random.Random(s)

    def state(self) -> dict[str, Any]:
        return {"torch": self.torch.get_state(), "numpy": self.numpy.get_state(), "python": self.python.getstate()}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (what ``state()`` returned, e.g. in a shard checkpoint)."""
        self.torch.set_state(state["torch"])
        self.numpy.set_state(state["numpy"])
        self.python.setstate(state["python"])


@dataclass(frozen=True)
class ShardAttempt:
    """One attempt at one shard's round: what each step of it needs. ``generation`` is the shard's
    live generation when the attempt started: its beats, fence checks and fragment are that one's."""

    ck: Checkpointer
    spec: RunSpec  # the trajectory
    shard: int
    round_no: int
    cut: Cut
    generation: int
    attempt: int = 1
    chaos: Sequence[Chaos] = ()

    @property
    def part(self) -> str:
        return shard_part(self.shard)
