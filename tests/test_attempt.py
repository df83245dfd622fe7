"""One attempt driver for both hosts (trainrun.attempt) and one failures vocabulary (trainrun.failures):
a real rank of a real gloo group (of one, in this process), real stores on disk."""

from __future__ import annotations

import json
import math
import time

import pytest

from ckptlib import Checkpointer, commit
from trainrun.documents import Cut
from trainrun.failures import WATCHDOG_KINDS, FailureKind, RankExit
from trainrun.rank_round import RankJob, train_rank_round
from trainrun.recovery import Recovery, fence_recoveries
from trainrun.spec import RunSpec
from trainrun.step_zero import write_step_zero
from trainrun.watchdog.judge import PartView

EXTRA = {"d_model": 16, "n_layers": 1, "ctx": 8, "corpus_bytes": 32768}


@pytest.fixture
def group_of_one(tmp_path):
    """This process as rank 0 of a gloo group of one (what a rank process is after its rendezvous)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "rendezvous"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_rank_whose_loss_diverges_writes_its_round_as_a_process_does(tmp_path, group_of_one):
    """lr 1e30: the round's loss is NaN. The group's fragment is written (its meta's loss null and
    named in ``non_finite``, as a shard task's), not refused for JSON's lack of NaN (before: the
    rank failed at its fragment write, "Out of range float values are not JSON compliant")."""
    url = str(tmp_path / "run")
    s = RunSpec(workload="tinylm", workload_extra=EXTRA, shards=1, steps_per_round=3, lr=1e30).trajectory()
    with Checkpointer(url) as ck:
        write_step_zero(ck, s)
    job = RankJob(url=url, storage_options=None, spec=s.to_dict(), shard=0, round_no=1, cut=Cut.of_step(0).to_dict(),
                  generation=0, attempt=1, chaos=[], heartbeat_every_s=60.0, rank=0, ranks=1,
                  rendezvous=str(tmp_path / "rendezvous"), group_timeout_s=30.0,
                  result_path=str(tmp_path / "result.json"))
    result = train_rank_round(job)
    assert result.status == "finished" and math.isnan(result.loss)
    with Checkpointer(url) as ck:
        meta = commit.read_fragment(ck.store, commit.fragment_key(1, "shard-0", 0))[0].meta
    assert meta["loss"] is None and meta["non_finite"] == ["loss"] and meta["ranks"] == 1


def test_the_failure_kinds_are_the_strings_of_the_format(tmp_path):
    """A recovery row's ``kind`` and a fence's ``state`` are written and read back byte-identical
    (docs/run-layout.md); a fence that names no state (the quorum flow's) is a ``fenced`` recovery."""
    assert [str(k) for k in FailureKind] == ["crash", "preempted", "process-died", "silent", "stalled", "lost", "missing",
                                             "fenced", "run-died"]
    assert WATCHDOG_KINDS == ("silent", "stalled", "lost", "missing")
    assert all(PartView("shard-0", k, 0).dead for k in WATCHDOG_KINDS)
    assert not any(PartView("shard-0", k, 0).dead for k in ("crash", "fenced", "running", "replaced"))
    row = Recovery(shard=0, round=1, kind=FailureKind.PROCESS_DIED, failed_at_step=3, resumed_at_step=2,
                   steps_recomputed=1, detect_s=0.1, back_to_training_s=0.2)
    assert b'"kind": "process-died"' in row.to_json() and Recovery.from_json(row.to_json()) == row
    with Checkpointer(str(tmp_path / "run")) as ck:
        now = time.time()
        assert commit.fence(ck.store, "shard-0", 1, reason="silent", by="test",
                            details={"state": FailureKind.SILENT, "round": 1, "round_step": 4, "detected": now})
        assert commit.fence(ck.store, "shard-1", 1, reason="quorum", by="test", details={"round": 1, "detected": now})
        assert json.loads(ck.store.get(commit.fence_key("shard-0", 1)))["state"] == "silent"
        rows = fence_recoveries(ck.store, 1, set(), since=now - 1)
    assert sorted((r.part, r.kind, r.steps_recomputed) for r in rows) == [("shard-0", "silent", 4),
                                                                          ("shard-1", "fenced", 0)]
    assert [int(c) for c in RankExit] == [0, 1, 3, 4]
