"""tinylm: a byte-level decoder-only transformer on Python stdlib source text, dense AdamW + warmup/cosine.

The dense case of the benchmark: every parameter and both Adam moments change at every step.
Batches are windows of ``ctx + 1`` bytes at offsets drawn from the generator of (seed, shard,
position) in the first 90% of the corpus; ``evaluate`` uses fixed windows of the last 10%.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import WorkloadConfig
from .common import TorchWorkload, build_on_meta, causal_lm_schedule, generator, init_params_
from .corpus import corpus_info, load_corpus

VOCAB = 256  # bytes: fixed, never depends on the text


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP (explicit matmuls: deterministic on CPU)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        att = att.masked_fill(causal_mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, d_model: int, n_layers: int, n_heads: int, ctx: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(ctx, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)  # True above the diagonal = future: masked
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class TinyLMWorkload(TorchWorkload):
    workload_name = "tinylm"
    SIZES = {
        # ~0.46 M params, ~5.5 MB state with AdamW moments
        "small": dict(d_model=128, n_layers=2, n_heads=4, ctx=64, batch_size=8, lr=3e-3, weight_decay=0.1,
                      warmup_steps=10, total_steps=2000, min_lr_ratio=0.1, eval_batch_size=32,
                      corpus_bytes=512 * 1024, corpus_path=""),
        # ~3.3 M params, ~40 MB state
        "bench": dict(d_model=256, n_layers=4, n_heads=8, ctx=128, batch_size=8, lr=1e-3, weight_decay=0.1,
                      warmup_steps=50, total_steps=20000, min_lr_ratio=0.1, eval_batch_size=32,
                      corpus_bytes=1024 * 1024, corpus_path=""),
    }

    def __init__(self, config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> None:
        super().__init__(config, shard, num_shards)
        hp = self.hparams
        self.ctx = int(hp["ctx"])
        self.corpus = load_corpus(int(hp["corpus_bytes"]), str(hp["corpus_path"]))
        self.n_train = int(self.corpus.numel() * 0.9)
        if self.n_train < 2 * (self.ctx + 1):
            raise ValueError(f"corpus of {self.corpus.numel()} bytes is too small for ctx={self.ctx}")
        self.model = build_on_meta(lambda: TinyLM(int(hp["d_model"]), int(hp["n_layers"]), int(hp["n_heads"]),
                                                  self.ctx))
        init_params_(self.model, self.workload_name, "init", config.seed, linear_std=0.02, embedding_std=0.02)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": float(hp["weight_decay"])},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr, betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, causal_lm_schedule(int(hp["warmup_steps"]), int(hp["total_steps"]),
                                               float(hp["min_lr_ratio"])))

    def _windows(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.ctx + 1)
        tokens = self.corpus[idx].long()
        return tokens[:, :-1], tokens[:, 1:]

    def make_batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.batch_generator(position)
        return self._windows(torch.randint(0, self.n_train - self.ctx - 1, (self.batch_size,), generator=g))

    def make_eval_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(self.workload_name, "eval", self.config.seed)
        lo, hi = self.n_train, self.corpus.numel() - self.ctx - 1
        return self._windows(torch.randint(lo, hi, (int(self.hparams["eval_batch_size"]),), generator=g))

    def compute_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self.forward(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **corpus_info(self.corpus)}


def build(config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> TinyLMWorkload:
    return TinyLMWorkload(config, shard, num_shards)
