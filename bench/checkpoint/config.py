"""What one benchmark run measures: workloads, series length, systems, device (``BenchConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .contenders import SYSTEMS

DEFAULT_WORKLOADS = ("tinylm", "recsys", "finetune", "finetune-bf16", "dense-lm")
# Training steps between two saves: finetune-bf16 is a publish stream (a bf16 copy of the weights
# after every step, for inference workers); the others checkpoint every 10 steps.
STEPS_BETWEEN = {"finetune-bf16": 1}
DEFAULT_STEPS_BETWEEN = 10


@dataclass(frozen=True)
class BenchConfig:
    """One run. Refused at construction, with the fix: fewer than 2 saves, an unknown size, system,
    workload or device, and ``cuda`` without a CUDA device."""

    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    saves: int = 17  # the mean is over saves 2..17: long enough for ckptlib's chains to end and restart
    steps_between: int | None = None  # None: each workload's own (STEPS_BETWEEN, else 10)
    size: str = "bench"
    store: str | None = None  # directory for the per-system temporary directories (default: system temp)
    device: str = "cpu"  # where the captured states live while they are saved: "cpu" | "cuda"
    systems: tuple[str, ...] = SYSTEMS
    seed: int = 0
    extra: dict = field(default_factory=dict)  # workload knobs (WorkloadConfig.extra), e.g. a bigger model

    def steps_for(self, workload: str) -> int:
        if self.steps_between is not None:
            return self.steps_between
        return STEPS_BETWEEN.get(workload, DEFAULT_STEPS_BETWEEN)

    def __post_init__(self) -> None:
        from workloads.base import BUILTIN_WORKLOADS

        if not self.workloads:
            raise ValueError("give at least one workload, e.g. tinylm,recsys,finetune")
        bad = [n for n in self.workloads if n not in BUILTIN_WORKLOADS and ":" not in n]
        if bad:
            raise ValueError(f"unknown workload(s) {bad}: choose from {', '.join(BUILTIN_WORKLOADS)} "
                             "or give 'package.module:factory'")
        if self.saves < 2:
            raise ValueError(f"saves must be >= 2 (the mean is over every save after the first), got {self.saves}")
        if self.steps_between is not None and self.steps_between < 1:
            raise ValueError(f"steps_between must be >= 1, got {self.steps_between}")
        if self.size not in ("small", "bench"):
            raise ValueError(f"size must be 'small' or 'bench', got {self.size!r}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"unknown system(s) {unknown}: choose from {', '.join(SYSTEMS)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available to this torch build; use --device cpu")
