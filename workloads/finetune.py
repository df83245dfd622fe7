"""finetune: a frozen "pretrained" backbone, LoRA adapters and a head (the benchmark's frozen case).

Backbone: input projection, residual pre-norm MLP blocks, final LayerNorm; all frozen
(``requires_grad=False``), initialised from the seed. Trainable: rank-``lora_rank`` adapters on both
linear layers of every block (``B`` starts at zero, so the model starts as the backbone) and a
linear classification head. AdamW sees only the trainable parameters.

Task: inputs ``x ~ N(0, 1)``; the label is the argmax of a fixed hidden linear "teacher" head on the
frozen backbone's own features (adapters off), so the pretrained features are the right ones and the
loss falls quickly. The checkpoint holds the frozen backbone too (it round-trips; it never changes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import WorkloadConfig
from .common import TorchWorkload, build_on_meta, generator, init_params_


class LoRALinear(nn.Module):
    """``base(x) + (x A^T) B^T * alpha / rank`` with ``base`` frozen; ``lora=False`` skips the adapter."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        self.scaling = alpha / rank

    def init_with(self, gen_for) -> None:
        bound = 1.0 / math.sqrt(self.base.in_features)
        self.base.weight.uniform_(-bound, bound, generator=gen_for("base.weight"))
        self.base.bias.zero_()
        self.lora_a.uniform_(-bound, bound, generator=gen_for("lora_a"))
        self.lora_b.zero_()

    def forward(self, x: torch.Tensor, lora: bool = True) -> torch.Tensor:
        y = self.base(x)
        if lora:
            y = y + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scaling
        return y


class MLPBlock(nn.Module):
    def __init__(self, d_model: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.fc1 = LoRALinear(d_model, 4 * d_model, rank, alpha)
        self.fc2 = LoRALinear(4 * d_model, d_model, rank, alpha)

    def forward(self, x: torch.Tensor, lora: bool = True) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x), lora)), lora)


class AdaptedClassifier(nn.Module):
    def __init__(self, d_in: int, d_model: int, n_blocks: int, n_classes: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d_model)
        self.blocks = nn.ModuleList(MLPBlock(d_model, rank, alpha) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)

    def features(self, x: torch.Tensor, lora: bool = True) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, lora)
        return self.ln_f(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def trainable_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters() if n.startswith("head.") or ".lora_" in n]


class FinetuneWorkload(TorchWorkload):
    workload_name = "finetune"
    fsdp_forward_methods = ("features",)  # make_batch labels its rows with the frozen backbone's features
    SIZES = {
        # ~1.5 M params (frozen) + ~50 k trainable; state ~6 MB
        "small": dict(d_in=64, d_model=192, n_blocks=5, n_classes=16, lora_rank=4, lora_alpha=8.0,
                      batch_size=64, lr=3e-3, weight_decay=0.01, teacher_scale=4.0, eval_batch_size=512),
        # ~25 M params (frozen) + ~0.25 M trainable (1%, LoRA rank 4 as commonly used); state ~104 MB
        "bench": dict(d_in=128, d_model=512, n_blocks=12, n_classes=16, lora_rank=4, lora_alpha=8.0,
                      batch_size=64, lr=1e-3, weight_decay=0.01, teacher_scale=4.0, eval_batch_size=512),
    }

    def __init__(self, config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> None:
        super().__init__(config, shard, num_shards)
        hp = self.hparams
        seed = config.seed
        self.model = build_on_meta(lambda: AdaptedClassifier(
            int(hp["d_in"]), int(hp["d_model"]), int(hp["n_blocks"]), int(hp["n_classes"]),
            int(hp["lora_rank"]), float(hp["lora_alpha"])))
        init_params_(self.model, "finetune", "init", seed)
        trainable = set(self.model.trainable_names())
        for name, p in self.model.named_parameters():
            p.requires_grad_(name in trainable)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.lr,
                                           weight_decay=float(hp["weight_decay"]))
        self.scheduler = None
        g = generator("finetune", "teacher", seed)
        self._teacher = torch.randn(int(hp["n_classes"]), int(hp["d_model"]), generator=g)
        self._teacher *= float(hp["teacher_scale"]) / math.sqrt(int(hp["d_model"]))

    def _labelled(self, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(k, int(self.hparams["d_in"]), generator=g)
        with torch.no_grad():  # the backbone is frozen: labels depend on (seed, shard, position) only
            y = (self.model.features(x, lora=False) @ self._teacher.t()).argmax(-1)
        return x, y

    def make_batch(self, position: int):
        return self._labelled(self.batch_size, self.batch_generator(position))

    def make_eval_batch(self):
        return self._labelled(int(self.hparams["eval_batch_size"]), generator("finetune", "eval", self.config.seed))

    def compute_loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.forward(x), y)


def build(config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> FinetuneWorkload:
    return FinetuneWorkload(config, shard, num_shards)
