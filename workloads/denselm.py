"""dense-lm: a ~250 MB language-model training state (transformer + AdamW), the benchmark's dense case.

What most users checkpoint: fp32 weights and both AdamW moments, every element changing at every
step. The model is tinylm's byte-level decoder (``workloads.tinylm.TinyLM``), wider and deeper;
batches are small (2 windows of 64 bytes) so that training the benchmark's series stays quick on
2 cores, while the state (what a checkpoint costs) has the size of a small real LM's. AdamW with
decoupled weight decay on the matrices, betas (0.9, 0.95), linear warm-up then cosine decay.
Deterministic like every workload here (batches from generators of (seed, shard, position)).
"""

from __future__ import annotations

from .base import WorkloadConfig
from .tinylm import TinyLMWorkload


class DenseLMWorkload(TinyLMWorkload):
    workload_name = "dense-lm"
    # tinylm's settings but for these: small ~0.5 M params, ~5.6 MB state (what the tests run);
    # bench ~22.4 M params, 268 MB (256 MiB) of fp32 weights + AdamW moments
    SIZES = {
        "small": {**TinyLMWorkload.SIZES["small"], "batch_size": 2, "lr": 6e-4, "eval_batch_size": 8},
        "bench": {**TinyLMWorkload.SIZES["bench"], "d_model": 512, "n_layers": 7, "ctx": 64, "batch_size": 2,
                  "lr": 6e-4, "warmup_steps": 20, "eval_batch_size": 8},
    }


def build(config: WorkloadConfig, shard: int = 0, num_shards: int = 1) -> DenseLMWorkload:
    return DenseLMWorkload(config, shard, num_shards)
