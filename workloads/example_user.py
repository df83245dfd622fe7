"""An example user workload, written against the protocol only: ``workloads.example_user:build``.

Use it as a template for your own: copy this file into your package and name it in the run's
config as ``WorkloadConfig(name="your_package.your_module:build", ...)``. Nothing here depends on
the built-in workloads' helpers; only torch and the standard library.

What the protocol asks (see workloads/base.py):
- build model, optimizer (and scheduler or None) from the config and a shard index; the model's
  initial values must depend on ``config.seed`` only (every shard starts identical);
- ``train_step()``: one optimizer step on the batch at ``data_position`` of this shard, a pure
  function of (seed, shard, position), then ``data_position += 1``;
- ``state_dict()`` / ``load_state_dict()``: everything needed to continue bit for bit;
- ``evaluate()``: a loss on a fixed held-out batch; ``checkpoint_state()``: what to save.

The task: a two-layer MLP regressing a fixed random teacher's outputs, SGD with momentum, a step LR.
"""

from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn


def _generator(*parts) -> torch.Generator:
    """A generator seeded from a hash of named parts: never the global RNG."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class ExampleWorkload:
    def __init__(self, config, shard: int = 0, num_shards: int = 1) -> None:
        self.config, self.shard, self.num_shards = config, shard, num_shards
        hidden = int(config.extra.get("hidden", 64))
        self.batch_size = config.batch_size or 32
        self.d_in, self.d_out = 16, 4

        # Model: build it, then overwrite every parameter from a seeded generator. (Constructing the
        # layers draws from torch's global RNG; the values drawn are overwritten, so that is harmless
        # here. The built-ins construct on the "meta" device and draw nothing.)
        self.model = nn.Sequential(nn.Linear(self.d_in, hidden), nn.Tanh(), nn.Linear(hidden, self.d_out))
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.normal_(0.0, 0.1, generator=_generator("example", "init", config.seed, name))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=config.lr or 0.05, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=100, gamma=0.5)
        self.data_position = 0

        # The task (a function of the seed, not part of the state).
        self.teacher = torch.randn(self.d_in, self.d_out, generator=_generator("example", "teacher", config.seed))

    def _batch(self, g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, self.d_in, generator=g)
        return x, torch.tanh(x @ self.teacher)

    def train_step(self) -> float:
        x, y = self._batch(_generator("example", "train", self.config.seed, self.shard, self.data_position),
                           self.batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.data_position += 1
        return float(loss.detach())

    def evaluate(self) -> float:
        x, y = self._batch(_generator("example", "eval", self.config.seed), 256)
        with torch.no_grad():
            return float(nn.functional.mse_loss(self.model(x), y))

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "data_position": self.data_position}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        # torch optimizers keep references to the tensors they are given: copy them.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.scheduler.load_state_dict(copy.deepcopy(state["scheduler"]))
        self.data_position = int(state["data_position"])

    def checkpoint_state(self) -> dict:
        return self.state_dict()

    def describe(self) -> dict:
        n = sum(p.numel() for p in self.model.parameters())
        return {"name": self.config.name, "params": n, "trainable_params": n, "param_bytes": 4 * n}


def build(config, shard: int = 0, num_shards: int = 1) -> ExampleWorkload:
    return ExampleWorkload(config, shard, num_shards)
