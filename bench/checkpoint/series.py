"""The states every system saves: a workload trained for real, deterministically (seed 0, its own
data stream), with a deep copy of its checkpoint state taken every ``steps_between`` optimizer steps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .config import BenchConfig
from .trees import map_tensors


@dataclass
class Series:
    """The captured states of one workload."""

    workload: str
    steps: list[int]
    states: list[Any]
    state_bytes: int
    train_s: float
    losses: list[float] = field(default_factory=list)


def published_state(name: str, wl: Any) -> Any:
    """What the series saves: the checkpoint state, except for finetune-bf16, whose stream is the bf16
    copy of the weights published after every step (to evaluators or inference workers)."""
    state = wl.checkpoint_state()
    return state["weights_bf16"] if name == "finetune-bf16" else state


def capture_states(name: str, cfg: BenchConfig) -> Series:
    """Train ``name`` for real and copy its checkpoint state every ``steps_between`` steps."""
    from workloads.base import WorkloadConfig, build_workload, clone_state, state_nbytes

    wl = build_workload(WorkloadConfig(name=name, seed=cfg.seed, size=cfg.size, extra=dict(cfg.extra)))
    steps, states, losses = [], [], []
    train_s = 0.0
    for _ in range(cfg.saves):
        t0 = time.perf_counter()
        for _ in range(cfg.steps_for(name)):
            loss = wl.train_step()
        train_s += time.perf_counter() - t0
        state = clone_state(published_state(name, wl))
        if cfg.device != "cpu":
            state = map_tensors(state, lambda t: t.to(cfg.device))
        steps.append(wl.data_position)
        states.append(state)
        losses.append(loss)
    del wl
    return Series(name, steps, states, state_nbytes(states[-1]), train_s, losses)
