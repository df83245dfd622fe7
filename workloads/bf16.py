"""finetune-bf16: fp32 AdamW at lr 1e-5 that publishes bf16 weights (the benchmark's bf16 case).

A trainer that serves inference workers (RL post-training, online fine-tuning) keeps fp32 master
weights and Adam moments, and after every step publishes a bf16 copy of the weights. At a small
learning rate most bf16 values do not move: an update changes a bf16 value only when it carries the
fp32 master across a bf16 rounding boundary. ``checkpoint_state()`` is ``state_dict()`` plus
``"weights_bf16": {name: param.to(bfloat16)}``; ``load_state_dict`` ignores that key (it is derived).

Model: a residual pre-norm MLP (input projection, blocks of LayerNorm -> Linear(4x) -> GELU ->
Linear, output head), all trainable, linear weights N(0, 0.02^2) like a pretrained transformer's.
Task: regression onto a fixed hidden affine teacher ``y = x W + b`` (from the seed), MSE.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import WorkloadConfig
from .common import TorchWorkload, build_on_meta, generator, init_params_


class Block(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ResidualMLP(nn.Module):
    def __init__(self, d_in: int, d_model: int, n_blocks: int, d_out: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d_model)
        self.blocks = nn.ModuleList(Block(d_model) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


class Bf16PublishWorkload(TorchWorkload):
    workload_name = "finetune-bf16"
    # init_std 0.04 puts the weights where a 1e-5 AdamW step moves ~10% of bf16 values by one ulp,
    # the regime the publish stream is specified for (at 0.02 it is ~16%: smaller weights, finer ulps).
    SIZES = {
        # ~1.1 M params; state ~15 MB (fp32 master + moments + bf16 copy)
        "small": dict(d_in=64, d_model=256, n_blocks=2, d_out=64, batch_size=64, lr=1e-5, weight_decay=0.0,
                      init_std=0.04, teacher_bias=0.5, eval_batch_size=512),
        # ~19 M params; state ~265 MB
        "bench": dict(d_in=128, d_model=768, n_blocks=4, d_out=128, batch_size=64, lr=1e-5, weight_decay=0.0,
                      init_std=0.04, teacher_bias=0.5, eval_batch_size=512),
    }

    def __init__(self, config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> None:
        super().__init__(config, shard, num_shards)
        hp = self.hparams
        seed = config.seed
        d_in, d_out = int(hp["d_in"]), int(hp["d_out"])
        self.model = build_on_meta(lambda: ResidualMLP(d_in, int(hp["d_model"]), int(hp["n_blocks"]), d_out))
        init_params_(self.model, "finetune-bf16", "init", seed, linear_std=float(hp["init_std"]))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=float(hp["weight_decay"]))
        self.scheduler = None
        g = generator("finetune-bf16", "teacher", seed)
        self._teacher_w = torch.randn(d_in, d_out, generator=g) / math.sqrt(d_in)
        self._teacher_b = torch.randn(d_out, generator=g) * float(hp["teacher_bias"])

    def _labelled(self, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(k, int(self.hparams["d_in"]), generator=g)
        return x, x @ self._teacher_w + self._teacher_b

    def make_batch(self, position: int):
        return self._labelled(self.batch_size, self.batch_generator(position))

    def make_eval_batch(self):
        return self._labelled(int(self.hparams["eval_batch_size"]), generator("finetune-bf16", "eval", self.config.seed))

    def compute_loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.forward(x), y)

    def weights_bf16(self) -> dict[str, torch.Tensor]:
        """The published copy: every parameter rounded to bfloat16 (round-to-nearest-even)."""
        return {name: p.detach().to(torch.bfloat16) for name, p in self.model.named_parameters()}

    def checkpoint_state(self) -> dict[str, Any]:
        return {**self.state_dict(), "weights_bf16": self.weights_bf16()}


def build(config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> Bf16PublishWorkload:
    return Bf16PublishWorkload(config, shard, num_shards)
