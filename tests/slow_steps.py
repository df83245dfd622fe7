"""A workload for recovery tests: tinylm, but each step also sleeps ``CKPT_TEST_STEP_SLEEP`` seconds
(unset: 0), so a test can kill a run at a moment it chooses. The sleep is outside the trajectory:
a run with it and one without reach the same digests."""

from __future__ import annotations

import os
import time

from workloads.tinylm import TinyLMWorkload


class SlowSteps(TinyLMWorkload):
    def train_step(self) -> float:
        time.sleep(float(os.environ.get("CKPT_TEST_STEP_SLEEP") or 0.0))
        return super().train_step()


def build(config, shard: int = 0, num_shards: int = 1) -> SlowSteps:
    return SlowSteps(config, shard, num_shards)
