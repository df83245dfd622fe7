"""Runs the tests share: the tiny trajectory and a run of rounds with plain function calls (no
Prefect), so that a test module never imports another."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from ckptlib import Checkpointer
from ckptlib.heartbeat import read_heartbeats
from ckptlib.store import Store
from trainrun.cut import cut_round
from trainrun.documents import Cut
from trainrun.shard_round import train_shard_round
from trainrun.spec import RunSpec
from trainrun.step_zero import write_step_zero

TINY = {"workload": "tinylm", "workload_extra": {"d_model": 32, "n_layers": 1, "ctx": 16, "corpus_bytes": 65536},
        "shards": 2, "steps_per_round": 3}


def run_rounds(url: str, spec: RunSpec, rounds: int, every: int = 1, start: int | None = None) -> dict[int, str]:
    """Train ``rounds`` rounds with plain function calls; returns {committed step: digest}."""
    digests = {}
    if start is None:
        with Checkpointer(url) as ck:
            digests[0] = write_step_zero(ck, spec).digest
        start = 0
    cut = Cut.of_step(start)
    for r in range(start + 1, rounds + 1):
        for i in range(spec.shards):
            with Checkpointer(url) as ck:
                assert train_shard_round(ck, spec, i, r, cut, heartbeat_every_s=0.05).status == "finished"
        with Checkpointer(url) as ck:
            result = cut_round(ck, spec, r, cut, publish=r % every == 0 or r == rounds, commit_timeout_s=30)
        if result.committed:
            digests[r] = result.digest
        cut = result.next_cut()
    return digests


def wait_for_round(proc: subprocess.Popen, run: Path, round_no: int = 2, steps: int = 5, shards: int = 2,
                   timeout_s: float = 240.0) -> None:
    """Returns once every shard of the run ``proc`` trains beats round ``round_no``, ``steps`` steps in
    (fails with ``proc``'s output if it ended first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"round {round_no} did not start in {timeout_s:.0f} s"
        beats = read_heartbeats(Store.from_url(str(run))) if run.exists() else {}
        if all((b := beats.get(f"shard-{i}")) is not None and b.round == round_no and (b.round_step or 0) >= steps
               for i in range(shards)):
            return
        time.sleep(0.05)
