"""Shared machinery of the built-in workloads: seeds, deterministic init, the train/eval loop.

Randomness never comes from the global RNGs. Every random tensor is drawn from a fresh
``torch.Generator`` seeded by ``derive_seed(...)``, a hash of named parts, e.g.
``("tinylm", "train", seed, shard, position)`` for a batch or ``("tinylm", "init", seed, param_name)``
for a parameter. So a batch does not depend on when, where or in which thread it is made, and
shards that build their models concurrently (the flow's thread runner) cannot disturb each other.

Models are constructed on the ``meta`` device, materialised with ``to_empty`` and initialised by
``init_params_`` from such generators: no global RNG is consumed, and every parameter's initial
value depends on (seed, its name) only.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable

import torch
from torch import nn

from .base import WorkloadConfig, clone_state, state_nbytes


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from named parts; stable across processes, machines and Python versions."""
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def generator(*parts: Any) -> torch.Generator:
    """A fresh CPU generator seeded by ``derive_seed(*parts)``."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def resolve_hparams(workload: str, sizes: dict[str, dict[str, Any]], config: WorkloadConfig) -> dict[str, Any]:
    """The size preset updated with ``config.extra``; an unknown extra key is an error (typos)."""
    hp = dict(sizes[config.size])
    unknown = sorted(set(config.extra) - set(hp))
    if unknown:
        raise ValueError(f"unknown extra key(s) {unknown} for workload {workload!r}; known keys: {sorted(hp)}")
    for k, v in config.extra.items():
        default = hp[k]
        hp[k] = type(default)(v) if type(default) in (int, float, bool) else v
    if config.batch_size is not None:
        hp["batch_size"] = int(config.batch_size)
    if config.lr is not None:
        hp["lr"] = float(config.lr)
    return hp


def build_on_meta(ctor: Callable[[], nn.Module]) -> nn.Module:
    """Construct a module without allocating or initialising (no global RNG use), then materialise it on CPU."""
    with torch.device("meta"):
        module = ctor()
    return module.to_empty(device="cpu")


def init_params_(model: nn.Module, *seed_parts: Any, linear_std: float | None = None,
                 embedding_std: float = 0.02) -> None:
    """Initialise every parameter of ``model`` from generators keyed by (seed_parts, parameter name).

    Linear weights: ``linear_std`` given -> N(0, std^2), else torch's default bound U(+-1/sqrt(fan_in)).
    Biases 0, LayerNorm 1/0, Embedding N(0, embedding_std^2). A module may instead define
    ``init_with(gen_for)``, where ``gen_for(local_name)`` gives its parameter's generator.
    Every parameter and buffer must be covered: an uncovered one is an error, not garbage memory.
    """
    done: set[str] = set()
    with torch.no_grad():
        for mname, module in model.named_modules():
            prefix = f"{mname}." if mname else ""

            def gen_for(local: str, prefix: str = prefix) -> torch.Generator:
                return generator(*seed_parts, prefix + local)

            own = getattr(module, "init_with", None)
            if callable(own):
                own(gen_for)
                done.update(prefix + n for n, _ in module.named_parameters())
                continue
            init = _INITS.get(type(module))
            if init is None:
                continue
            init(module, gen_for, linear_std, embedding_std)
            done.update(prefix + n for n, _ in module.named_parameters(recurse=False))
    missing = [n for n, _ in model.named_parameters() if n not in done]
    missing += [n for n, _ in model.named_buffers()]  # to_empty leaves buffers as garbage: build them in forward
    if missing:
        raise RuntimeError(f"init_params_ does not know how to initialise {missing}: give their module an "
                           "init_with(gen_for) method (buffers: compute them in forward instead)")


def _init_linear(m: nn.Linear, gen_for, linear_std, embedding_std) -> None:
    if linear_std is None:
        bound = 1.0 / math.sqrt(m.in_features)
        m.weight.uniform_(-bound, bound, generator=gen_for("weight"))
    else:
        m.weight.normal_(0.0, linear_std, generator=gen_for("weight"))
    if m.bias is not None:
        m.bias.zero_()


def _init_embedding(m: nn.Embedding, gen_for, linear_std, embedding_std) -> None:
    m.weight.normal_(0.0, embedding_std, generator=gen_for("weight"))


def _init_layernorm(m: nn.LayerNorm, gen_for, linear_std, embedding_std) -> None:
    if m.weight is not None:
        m.weight.fill_(1.0)
    if m.bias is not None:
        m.bias.zero_()


_INITS = {nn.Linear: _init_linear, nn.Embedding: _init_embedding, nn.LayerNorm: _init_layernorm}


def causal_lm_schedule(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warm-up then cosine decay to ``min_ratio``; a plain function so LambdaLR stores no state for it."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))

    return factor


class TorchWorkload:
    """Base of the built-in workloads: the protocol's loop around make_batch / compute_loss.

    A subclass sets ``workload_name`` and ``SIZES`` and, in ``__init__`` after ``super().__init__``,
    assigns ``model``, ``optimizer`` and ``scheduler``; it implements ``make_batch(position)`` (a pure
    function of (seed, shard, position)), ``make_eval_batch()`` and ``compute_loss(batch)``.
    """

    workload_name = "?"
    SIZES: dict[str, dict[str, Any]] = {}
    # how a shard of it may be trained by a group of ranks (``train_as_rank``); () = one process only
    parallelisms: tuple[str, ...] = ("ddp", "fsdp")
    # methods of the model other than forward that the workload calls (FSDP2 must gather for them too)
    fsdp_forward_methods: tuple[str, ...] = ()

    def __init__(self, config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"need 0 <= shard < num_shards, got shard={shard}, num_shards={num_shards}")
        self.config = config
        self.shard = shard
        self.num_shards = num_shards
        self.hparams = resolve_hparams(self.workload_name, self.SIZES, config)
        self.batch_size = int(self.hparams["batch_size"])
        self.lr = float(self.hparams["lr"])
        self.data_position = 0
        self.model: nn.Module
        self.optimizer: Any
        self.scheduler: Any = None
        self._eval_batch: Any = None
        self.rank, self.ranks = 0, 1
        self._replica: nn.Module | None = None  # the DDP wrapper of ``model`` when trained by ranks

    # -- to implement -------------------------------------------------------------------------
    def make_batch(self, position: int) -> Any:
        raise NotImplementedError

    def make_eval_batch(self) -> Any:
        raise NotImplementedError

    def compute_loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    # -- the protocol -------------------------------------------------------------------------
    def batch_generator(self, position: int) -> torch.Generator:
        """The generator of the batch at ``position`` of this shard."""
        return generator(self.workload_name, "train", self.config.seed, self.shard, position)

    def train_as_rank(self, rank: int, ranks: int, parallelism: str = "ddp") -> None:
        """Train from now on as rank ``rank`` of a group of ``ranks`` processes (torch.distributed
        initialised, the model already holding the shard's state): each step takes rows
        ``[rank * b/ranks, (rank + 1) * b/ranks)`` of the shard's batch and the group averages the
        gradients, so it takes the step one process would take on the whole batch (the same math;
        the float reduction order differs). ``"ddp"``: the state stays a plain replica, the same on
        every rank. ``"fsdp"``: FSDP2 (``fully_shard`` of each of ``fsdp_blocks()``, then the root,
        over a 1-D mesh of the group): each rank holds dim-0 shards (DTensors) of every parameter
        and of the optimizer's state of it; ``state_dict`` holds those shards."""
        if parallelism not in self.parallelisms:
            raise ValueError(f"workload {self.config.name!r} cannot be trained as {parallelism!r} by a group of "
                             f"ranks (it supports {list(self.parallelisms) or 'none'}): choose --parallelism "
                             f"{self.parallelisms[0] if self.parallelisms else 'ddp'}, or --ranks-per-shard 1")
        if self.batch_size % ranks:
            raise ValueError(f"batch size {self.batch_size} of workload {self.config.name!r} does not split over "
                             f"{ranks} ranks: choose --batch-size a multiple of --ranks-per-shard")
        self.rank, self.ranks = rank, ranks
        if parallelism == "fsdp":
            from .fsdp import shard_model

            shard_model(self.model, self.optimizer, self.fsdp_blocks(), self.fsdp_forward_methods, ranks)
            return
        from torch.nn.parallel import DistributedDataParallel

        self._replica = DistributedDataParallel(self.model)  # (the built-ins have no buffers to broadcast)

    def fsdp_blocks(self) -> list[nn.Module]:
        """The modules FSDP2 shards as units of their own (all-gathered one at a time), before the
        root takes the rest: the model's ``blocks`` (the built-ins' layer lists), else none."""
        return list(getattr(self.model, "blocks", []))

    def forward(self, *inputs: Any) -> Any:
        """The model's forward for ``compute_loss``: through DDP when trained by a group of ranks."""
        return (self._replica if self._replica is not None and self.model.training else self.model)(*inputs)

    def rank_batch(self, batch: Any) -> Any:
        """This rank's rows of ``batch`` (every tensor split along dim 0 into ``ranks`` equal parts)."""
        if self.ranks == 1:
            return batch
        if isinstance(batch, torch.Tensor):
            return batch.tensor_split(self.ranks)[self.rank]
        if isinstance(batch, dict):
            return {k: self.rank_batch(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.rank_batch(v) for v in batch)
        return batch

    def train_step(self) -> float:
        batch = self.rank_batch(self.make_batch(self.data_position))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.compute_loss(batch)
        loss.backward()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.data_position += 1
        return float(loss.detach())

    def evaluate(self) -> float:
        if self._eval_batch is None:
            self._eval_batch = self.make_eval_batch()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return float(self.compute_loss(self._eval_batch))
        finally:
            self.model.train(was_training)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "data_position": int(self.data_position),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("model", "optimizer", "scheduler", "data_position") if k not in state]
        if missing:
            raise KeyError(f"{self.workload_name} state lacks {missing}: pass what state_dict() or "
                           "checkpoint_state() returned")
        if (state["scheduler"] is None) != (self.scheduler is None):
            raise ValueError(f"{self.workload_name}: the state's scheduler is "
                             f"{'absent' if state['scheduler'] is None else 'present'} but this workload "
                             f"{'has none' if self.scheduler is None else 'has one'}: was it saved by "
                             "another workload or config?")
        self.model.load_state_dict(state["model"], strict=True)  # copies into the parameters
        # Optimizer/LRScheduler.load_state_dict keep references to the given tensors and lists: copy
        # them, so the source state may go on training without changing ours.
        self.optimizer.load_state_dict(clone_state(state["optimizer"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(clone_state(state["scheduler"]))
        self.data_position = int(state["data_position"])

    def checkpoint_state(self) -> dict[str, Any]:
        return self.state_dict()

    def describe(self) -> dict[str, Any]:
        """Sizes and settings for a benchmark to print. Optimizer moments appear after the first step."""
        params = list(self.model.parameters())
        opt_state = self.optimizer.state_dict()["state"]
        return {
            "name": self.config.name,
            "size": self.config.size,
            "shard": self.shard,
            "num_shards": self.num_shards,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "hparams": dict(self.hparams),
            "params": sum(p.numel() for p in params),
            "trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "state_bytes": state_nbytes(self.checkpoint_state()),
            "optimizer_state_ready": len(opt_state) > 0,
        }
