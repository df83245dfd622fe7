"""A rank group is preempted together, and a crashed rank is detected at its exit (issue 39, items 3
and 2): real gloo groups of 2 real rank processes on CPU, real SIGTERMs, real SIGKILLs.

* ``preempt:...,rank=1``: rank 1 gets SIGTERM mid-round; the group agrees on one step, checkpoints
  there collectively and stops (``Preempted``); the rerun continues from that step (0 recomputed)
  and writes the clean group's fragment, bit for bit.
* The supervisor's own process asked to stop (its flag, as its SIGTERM sets it): it forwards the
  request to its ranks, and the group stops the same way.
* ``kill:...,rank=1``: the supervisor sees the exit and records it as the detection: the retry's
  recovery row says ``detect_s`` < 1 s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from ckptlib import Checkpointer, commit
from ckptlib.heartbeat import read_heartbeat, read_rank_heartbeats
from trainrun import preemption
from trainrun.documents import Cut
from trainrun.errors import Preempted, RankGroupFailed
from trainrun.rank_group import train_shard_group
from trainrun.recovery import read_recoveries
from trainrun.spec import RunSpec
from trainrun.step_zero import write_step_zero

EXTRA = {"d_model": 32, "n_layers": 1, "ctx": 16, "corpus_bytes": 65536}
NEVER = 1000  # no shard checkpoint by cadence in a round: each one is a stop's
SPEC = RunSpec(workload="slow_steps:build", workload_extra=EXTRA, shards=2, steps_per_round=8, ranks_per_shard=2)


def _store(url: str) -> Checkpointer:
    ck = Checkpointer(url)
    write_step_zero(ck, SPEC)
    return ck


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    ck = _store(str(tmp_path_factory.mktemp("clean")))
    return train_shard_group(ck, None, SPEC, 0, 1, Cut.of_step(0), heartbeat_every_s=0.2, checkpoint_every=NEVER)


def _at_round_step(ck: Checkpointer, k: int, act: Callable[[], None]) -> threading.Thread:
    """A started thread that calls ``act`` once shard-0's beat says round step ``k`` (at most 120 s on)."""
    def wait_then_act() -> None:
        deadline = time.monotonic() + 120
        while ((b := read_heartbeat(ck.store, "shard-0")) is None or (b.round_step or 0) < k) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        act()

    th = threading.Thread(target=wait_then_act)
    th.start()
    return th


def _stopped_at(ck: Checkpointer) -> int:
    """Where the preempted group stopped: every rank's last beat and the one checkpoint agree."""
    beats = read_rank_heartbeats(ck.store, "shard-0")
    assert {b.status for b in beats.values()} == {"failed"} and all("Preempted" in (b.error or "")
                                                                     for b in beats.values()), beats
    keys = commit.substep_keys(ck.store, 1, "shard-0", 0)
    assert len(keys) == 1, keys  # one checkpoint: the stop's, at the step the ranks agreed on
    (k,) = keys
    assert {b.round_step for b in beats.values()} == {k}, (k, beats)
    return k


def test_a_sigterm_to_one_rank_stops_the_group_at_one_agreed_step_and_the_rerun_recomputes_nothing(clean, tmp_path):
    ck = _store(str(tmp_path / "p"))
    chaos = ["preempt:shard=0,round=1,rank=1,step=3"]
    t0 = time.monotonic()
    with pytest.raises(Preempted, match=r"shard-0 round 1 stopped at step 3 \(SIGTERM\)") as e:
        train_shard_group(ck, None, SPEC, 0, 1, Cut.of_step(0), chaos=chaos, heartbeat_every_s=0.2,
                          checkpoint_every=NEVER)
    assert e.value.round_step == 3 and time.monotonic() - t0 < 60
    assert _stopped_at(ck) == 3
    again = train_shard_group(ck, None, SPEC, 0, 1, Cut.of_step(0), attempt=2, chaos=chaos, checkpoint_every=NEVER)
    assert (again.resumed_at_step, again.start_source) == (3, "store")  # 0 steps recomputed
    assert again.digest == clean.digest and again.loss == clean.loss
    [row] = read_recoveries(ck.store, 1)
    assert (row.resumed_at_step, row.steps_recomputed) == (3, 0), row


def test_the_supervisors_preemption_is_forwarded_to_its_ranks(clean, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_TEST_STEP_SLEEP", "0.2")  # the ranks inherit it: the request lands mid-round
    ck = _store(str(tmp_path / "s"))

    th = _at_round_step(ck, 2, lambda: preemption.request("SIGTERM"))  # what this process's SIGTERM handler does
    try:
        with pytest.raises(Preempted, match=r"\(SIGTERM\)"):
            train_shard_group(ck, None, SPEC, 0, 1, Cut.of_step(0), heartbeat_every_s=0.1, checkpoint_every=NEVER)
    finally:
        th.join()
        preemption.reset()
    k = _stopped_at(ck)
    assert 2 <= k < 8
    monkeypatch.delenv("CKPT_TEST_STEP_SLEEP")
    again = train_shard_group(ck, None, SPEC, 0, 1, Cut.of_step(0), attempt=2, checkpoint_every=NEVER)
    assert again.resumed_at_step == k and again.digest == clean.digest


def test_a_rank_group_stops_at_the_runs_stop_document_and_the_rerun_recomputes_nothing(clean, tmp_path,
                                                                                         monkeypatch):
    """A cancel or a coordinator's SIGTERM reaches a rank group as it reaches a thread shard: the
    supervisor's beats read ``control/stop.json`` (``StopWatch``, as ``tasks.shard`` passes it), its
    process is asked to stop, and it stops its ranks at one agreed step with a shard checkpoint."""
    monkeypatch.setenv("CKPT_TEST_STEP_SLEEP", "0.2")  # the ranks inherit it: the document lands mid-round
    ck = _store(str(tmp_path / "d"))

    th = _at_round_step(ck, 2, lambda: preemption.write_stop(ck.store, "cancel", by="test", round_no=1))
    try:
        with pytest.raises(Preempted, match=r"cancel"):
            train_shard_group(ck, None, SPEC, 0, 1, Cut.of_step(0), heartbeat_every_s=0.1, checkpoint_every=NEVER,
                              on_beat=preemption.StopWatch(ck.store))
    finally:
        th.join()
        preemption.forget_stop_document()
        preemption.reset()
    k = _stopped_at(ck)
    assert 2 <= k < 8
    ck.store.delete(preemption.STOP_KEY)  # a resumed run starts without it
    monkeypatch.delenv("CKPT_TEST_STEP_SLEEP")
    again = train_shard_group(ck, None, SPEC, 0, 1, Cut.of_step(0), attempt=2, checkpoint_every=NEVER)
    assert again.resumed_at_step == k and again.digest == clean.digest


def test_a_killed_rank_is_detected_at_its_exit(tmp_path):
    ck = _store(str(tmp_path / "k"))
    chaos = ["kill:shard=0,round=1,rank=1,step=3"]
    with pytest.raises(RankGroupFailed, match="rank 1 of its group of 2 was killed by signal 9"):
        train_shard_group(ck, None, SPEC, 0, 1, Cut.of_step(0), chaos=chaos, heartbeat_every_s=0.2,
                          checkpoint_every=NEVER)
    train_shard_group(ck, None, SPEC, 0, 1, Cut.of_step(0), attempt=2, chaos=chaos, checkpoint_every=NEVER)
    [row] = read_recoveries(ck.store, 1)
    assert (row.kind, row.cause) == ("crash", "kill"), row
    assert row.detect_s is not None and row.detect_s < 1.0, row
