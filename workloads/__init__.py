"""Real torch training workloads for the checkpoint benchmark and the training flow.

    from workloads import WorkloadConfig, build_workload
    wl = build_workload(WorkloadConfig("recsys", seed=0, size="small"), shard=0, num_shards=2)
    loss = wl.train_step()
    state = wl.checkpoint_state()

Built-ins: tinylm (dense AdamW), recsys (sparse embedding rows), finetune (frozen backbone + LoRA),
finetune-bf16 (bf16 weights published at lr 1e-5), dense-lm (a 256 MiB transformer + AdamW state);
any other as "package.module:factory".
The protocol and its guarantees are in workloads/base.py; a guide is docs/workloads.md.
"""

from .base import (
    BUILTIN_WORKLOADS,
    Workload,
    WorkloadConfig,
    build_workload,
    clone_state,
    describe,
    resolve_factory,
    state_nbytes,
)

__all__ = [
    "BUILTIN_WORKLOADS",
    "Workload",
    "WorkloadConfig",
    "build_workload",
    "clone_state",
    "describe",
    "resolve_factory",
    "state_nbytes",
]
