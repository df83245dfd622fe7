"""recsys: an embedding-heavy click model; sparse row updates (the benchmark's sparse case).

Model: user and item embedding tables (``sparse=True``) -> [u, i, u*i] -> MLP -> click logit, BCE.
Optimizers: ``SparseAdam`` over the tables, ``Adam`` over the MLP (one ``MultiOptimizer``). A step
changes only the rows of the users and items in its batch, and only those rows' Adam moments: the
rest of the tables, and of their moments, stay bit-identical.

Data: users and items are drawn from Zipf distributions (popular ids repeat); ranks map to ids by a
fixed permutation from the seed (``scatter_ids``), as hashed ids would be, so the hot rows are spread
over the table and not packed at its start. Labels come from a fixed hidden model (rank-``truth_rank``
user/item factors, an item bias and a global bias, all from the seed), so the loss goes down.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from .base import WorkloadConfig
from .common import TorchWorkload, build_on_meta, generator, init_params_
from .multi_optimizer import MultiOptimizer


class ClickModel(nn.Module):
    def __init__(self, n_users: int, n_items: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.user = nn.Embedding(n_users, dim, sparse=True)
        self.item = nn.Embedding(n_items, dim, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        u, i = self.user(users), self.item(items)
        return self.mlp(torch.cat([u, i, u * i], dim=-1)).squeeze(-1)


@lru_cache(maxsize=8)
def zipf_cdf(n: int, alpha: float) -> torch.Tensor:
    """CDF over ranks 0..n-1 with P(rank r) proportional to 1/(r+1)^alpha (float64; cached, read-only)."""
    w = torch.arange(1, n + 1, dtype=torch.float64).pow(-alpha)
    cdf = w.cumsum(0)
    return cdf / cdf[-1]


def sample_zipf(cdf: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    u = torch.rand(k, generator=g, dtype=torch.float64)
    return torch.searchsorted(cdf, u).clamp_(max=cdf.numel() - 1)


class RecSysWorkload(TorchWorkload):
    workload_name = "recsys"
    # sparse embedding gradients (SparseAdam): one process per shard only, not a group of DDP ranks
    parallelisms: tuple[str, ...] = ()
    SIZES = {
        # 1.6 M embedding params (2 x 50k x 16) + 9.5 k MLP; ~19 MB state with moments
        "small": dict(n_users=50_000, n_items=50_000, dim=16, hidden=64, batch_size=256, lr=3e-3, sparse_lr=0.02,
                      emb_std=0.05, zipf_users=1.05, zipf_items=1.1, truth_rank=8, truth_scale=1.5,
                      click_bias=-1.0, scatter_ids=True, eval_batch_size=4096),
        # 16 M embedding params (500k rows x 32) + 29 k MLP; ~192 MB state with moments
        "bench": dict(n_users=200_000, n_items=300_000, dim=32, hidden=128, batch_size=1024, lr=3e-3,
                      sparse_lr=0.02, emb_std=0.05, zipf_users=1.05, zipf_items=1.1, truth_rank=8,
                      truth_scale=1.5, click_bias=-1.0, scatter_ids=True, eval_batch_size=4096),
    }

    def __init__(self, config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> None:
        super().__init__(config, shard, num_shards)
        hp = self.hparams
        seed = config.seed
        self.n_users, self.n_items = int(hp["n_users"]), int(hp["n_items"])
        self.model = build_on_meta(lambda: ClickModel(self.n_users, self.n_items, int(hp["dim"]), int(hp["hidden"])))
        init_params_(self.model, "recsys", "init", seed, embedding_std=float(hp["emb_std"]))
        sparse = [self.model.user.weight, self.model.item.weight]
        self.optimizer = MultiOptimizer(
            torch.optim.SparseAdam(sparse, lr=float(hp["sparse_lr"])),
            torch.optim.Adam(self.model.mlp.parameters(), lr=self.lr))
        self.scheduler = None

        # The data distribution and the hidden "true" model: functions of the seed, not state.
        self._user_cdf = zipf_cdf(self.n_users, float(hp["zipf_users"]))
        self._item_cdf = zipf_cdf(self.n_items, float(hp["zipf_items"]))
        if hp["scatter_ids"]:
            self._user_ids = torch.randperm(self.n_users, generator=generator("recsys", "user_ids", seed))
            self._item_ids = torch.randperm(self.n_items, generator=generator("recsys", "item_ids", seed))
        else:
            self._user_ids = torch.arange(self.n_users)
            self._item_ids = torch.arange(self.n_items)
        r = int(hp["truth_rank"])
        g = generator("recsys", "truth", seed)
        self._true_user = torch.randn(self.n_users, r, generator=g) / r ** 0.25
        self._true_item = torch.randn(self.n_items, r, generator=g) / r ** 0.25
        self._true_item_bias = torch.randn(self.n_items, generator=g) * 0.5

    def _sample(self, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        users = self._user_ids[sample_zipf(self._user_cdf, k, g)]
        items = self._item_ids[sample_zipf(self._item_cdf, k, g)]
        logit = (float(self.hparams["click_bias"]) + self._true_item_bias[items]
                 + float(self.hparams["truth_scale"]) * (self._true_user[users] * self._true_item[items]).sum(-1))
        clicks = torch.bernoulli(torch.sigmoid(logit), generator=g)
        return users, items, clicks

    def make_batch(self, position: int):
        return self._sample(self.batch_size, self.batch_generator(position))

    def make_eval_batch(self):
        return self._sample(int(self.hparams["eval_batch_size"]), generator("recsys", "eval", self.config.seed))

    def compute_loss(self, batch) -> torch.Tensor:
        users, items, clicks = batch
        return F.binary_cross_entropy_with_logits(self.model(users, items), clicks)


def build(config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> RecSysWorkload:
    return RecSysWorkload(config, shard, num_shards)
