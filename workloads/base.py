"""The workload protocol: what a checkpoint benchmark and the training flow drive.

Who calls what, in which order
------------------------------
A caller (the checkpoint benchmark, a shard task of the training flow) does::

    wl = build_workload(config, shard=s, num_shards=n)   # model init depends on config.seed only
    wl.load_state_dict(state)                            # optional: resume from a committed cut
    for _ in range(h):
        loss = wl.train_step()                           # one optimizer step on shard s's next batch
    state = wl.checkpoint_state()                        # what to save (== state_dict() but for
                                                         # finetune-bf16, which adds weights_bf16)

Every shard builds the same model (same seed => same initial parameters) and reads its own data.
The caller owns the thread count (``torch.set_num_threads``); a workload never changes it, never
touches the global RNGs (torch, numpy, python) and never downloads anything.

What an implementation must guarantee
-------------------------------------
- Determinism: the batch at data position ``i`` of shard ``s`` is a pure function of
  ``(config, s, i)``; model initialisation is a pure function of ``config``. Same config + same
  sequence of calls => bit-identical ``state_dict()`` on CPU with the same torch build and thread
  count (floating-point reductions may differ across thread counts; the flow makes the thread count
  part of its config).
- Resume: ``b.load_state_dict(a.state_dict())`` followed by ``k`` steps of ``b`` gives the same bits
  as ``k`` more steps of ``a``. ``data_position`` is part of the state, so the data continues too.
- ``state_dict()`` holds only what ``ckptlib.tree`` can store: dicts/lists/tuples, tensors, JSON
  scalars. Its tensors ALIAS the live state (like ``nn.Module.state_dict``): encode or copy them
  (``clone_state``) before the next ``train_step``. ``load_state_dict`` copies what it is given, so
  the source may keep training afterwards.
- ``load_state_dict`` also accepts what ``checkpoint_state()`` returned; keys it does not know are
  ignored, so a caller may keep its own values beside them.

Names: built-ins are listed in ``BUILTIN_WORKLOADS``; any other workload is named
``"package.module:factory"`` and built by ``factory(config, shard, num_shards)``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

SIZES = ("small", "bench")

# name -> "module:factory"; imported lazily so that building one workload never imports the others.
BUILTIN_WORKLOADS: dict[str, str] = {
    "tinylm": "workloads.tinylm:build",
    "recsys": "workloads.recsys:build",
    "finetune": "workloads.finetune:build",
    "finetune-bf16": "workloads.bf16:build",
    "dense-lm": "workloads.denselm:build",
}

# What a workload object must have for the callers; checked on every object a factory returns.
REQUIRED_ATTRS = ("config", "shard", "num_shards", "model", "optimizer", "scheduler", "data_position")
REQUIRED_METHODS = ("train_step", "state_dict", "load_state_dict", "evaluate", "checkpoint_state")


@dataclass(frozen=True)
class WorkloadConfig:
    """Which workload, seeded how. JSON-serialisable (``to_dict`` / ``from_dict``); part of a run's config."""

    name: str  # "tinylm" | "recsys" | "finetune" | "finetune-bf16" | "dense-lm" | "package.module:factory"
    seed: int = 0
    batch_size: int | None = None  # None = the workload's default
    lr: float | None = None  # None = the workload's default
    size: str = "small"  # "small" (tests, demo: fast) | "bench" (bigger state for the benchmark)
    extra: dict = field(default_factory=dict)  # workload-specific knobs (see each workload's SIZES)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"WorkloadConfig.name must be a non-empty string, got {self.name!r}")
        if self.size not in SIZES:
            raise ValueError(f"WorkloadConfig.size must be one of {SIZES}, got {self.size!r}")
        if self.batch_size is not None and int(self.batch_size) < 1:
            raise ValueError(f"WorkloadConfig.batch_size must be >= 1 or None, got {self.batch_size!r}")
        if self.lr is not None and not float(self.lr) > 0:
            raise ValueError(f"WorkloadConfig.lr must be > 0 or None, got {self.lr!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"WorkloadConfig.extra must be a dict, got {type(self.extra).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorkloadConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown WorkloadConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**{**d, "extra": dict(d.get("extra") or {})})


@runtime_checkable
class Workload(Protocol):
    """One data-parallel worker's training state and its data stream (see the module docstring)."""

    config: WorkloadConfig
    shard: int
    num_shards: int
    model: torch.nn.Module
    optimizer: Any  # a torch.optim.Optimizer, or an object with the same five methods (recsys)
    scheduler: Any  # an LR scheduler or None
    data_position: int  # number of batches this shard has consumed

    def train_step(self) -> float:
        """One optimizer step on the next batch of THIS shard; returns the loss; advances data_position."""
        ...

    def state_dict(self) -> dict:
        """Complete state: {"model", "optimizer", "scheduler", "data_position", ...}; tensors alias live state."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore from state_dict() or checkpoint_state(); copies what it is given."""
        ...

    def evaluate(self) -> float:
        """Loss on a fixed held-out batch (the same for every shard); changes no state."""
        ...

    def checkpoint_state(self) -> dict:
        """What a checkpoint of this workload should hold (state_dict(), plus extras for some workloads)."""
        ...


def build_workload(config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> Workload:
    """Build the workload ``config.name`` for ``shard`` of ``num_shards``."""
    if not isinstance(config, WorkloadConfig):
        raise TypeError(f"build_workload needs a WorkloadConfig, got {type(config).__name__} "
                        "(use WorkloadConfig.from_dict for a dict)")
    if not (isinstance(num_shards, int) and num_shards >= 1 and isinstance(shard, int) and 0 <= shard < num_shards):
        raise ValueError(f"need 0 <= shard < num_shards, got shard={shard!r}, num_shards={num_shards!r}")
    factory = resolve_factory(config.name)
    wl = factory(config, shard, num_shards)
    missing = [a for a in REQUIRED_ATTRS if not hasattr(wl, a)]
    missing += [m for m in REQUIRED_METHODS if not callable(getattr(wl, m, None))]
    if missing:
        raise TypeError(f"workload factory for {config.name!r} returned a {type(wl).__qualname__} that lacks "
                        f"{missing}; a workload needs attributes {list(REQUIRED_ATTRS)} and methods "
                        f"{list(REQUIRED_METHODS)} (see workloads/example_user.py)")
    return wl


def resolve_factory(name: str) -> Callable[[WorkloadConfig, int, int], Workload]:
    """The factory for a built-in name or a ``"package.module:factory"`` reference."""
    target = BUILTIN_WORKLOADS.get(name)
    if target is None:
        if ":" not in name:
            raise ValueError(f"unknown workload {name!r}: the built-ins are {sorted(BUILTIN_WORKLOADS)}; for your "
                             "own workload give 'package.module:factory', where factory(config, shard, "
                             "num_shards) returns a Workload (e.g. 'workloads.example_user:build')")
        target = name
    module_name, _, attr = target.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"bad workload reference {name!r}: expected 'package.module:factory', e.g. "
                         "'workloads.example_user:build'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} for workload {name!r}: {e}. Fix: make the "
                          f"module importable where the run executes (install its package, or add its "
                          f"directory to PYTHONPATH on every worker)") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"module {module_name!r} has no callable {attr!r} (workload {name!r}); define "
                         f"def {attr}(config, shard, num_shards) -> Workload in it")
    return factory


def clone_state(state: Any) -> Any:
    """A deep copy of a state tree: tensors cloned, containers copied, so training may go on."""
    return copy.deepcopy(state)


def state_nbytes(state: Any) -> int:
    """Bytes of all tensors in a state tree (what a full, uncompressed checkpoint of it writes)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(v) for v in state)
    return 0


def describe(workload: Workload) -> dict[str, Any]:
    """Sizes for a benchmark to print; uses the workload's own describe() when it has one."""
    own = getattr(workload, "describe", None)
    if callable(own):
        return own()
    params = list(workload.model.parameters())
    state = workload.checkpoint_state()
    return {"name": workload.config.name, "size": workload.config.size,
            "params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "state_bytes": state_nbytes(state)}
