"""A workload for recovery tests: tinylm, but each step also sleeps ``CKPT_TEST_STEP_SLEEP`` seconds
(unset: 0), so a test can kill a run at a moment it chooses; with ``CKPT_TEST_STEP_SLEEP_FROM`` set,
only the steps from that data position on sleep (a test that strikes in round 2 need not wait
through round 1). The sleep is outside the trajectory: a run with it and one without reach the same
digests."""

from __future__ import annotations

import os
import time

from workloads.tinylm import TinyLMWorkload


class SlowSteps(TinyLMWorkload):
    def train_step(self) -> float:
        if self.data_position >= int(os.environ.get("CKPT_TEST_STEP_SLEEP_FROM") or 0):
            time.sleep(float(os.environ.get("CKPT_TEST_STEP_SLEEP") or 0.0))
        return super().train_step()


def build(config, shard: int = 0, num_shards: int = 1) -> SlowSteps:
    return SlowSteps(config, shard, num_shards)
