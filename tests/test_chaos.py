"""Chaos specs and what each kind does to a shard attempt, without Prefect or training (fast).

The drills end to end (a training run recovering from them) are in ``test_watchdog.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ckptlib import Checkpointer, FencedError, commit
from ckptlib.heartbeat import Heartbeat, read_heartbeat
from trainrun.chaos import (ChaosCrash, Partitioned, StaleFences, check_runner, for_attempt, parse_chaos, read_strike,
                            strike)


def test_new_kinds_parse_with_the_crash_syntax():
    assert str(parse_chaos("hang:shard=0,round=2")) == "hang:shard=0,round=2"
    assert str(parse_chaos(" Zombie:shard=1, round=3 ,step=4")) == "zombie:shard=1,round=3,step=4"
    k = parse_chaos("kill:shard=1,round=2,attempt=2")
    assert (k.kind, k.shard, k.round, k.attempt) == ("kill", 1, 2, 2)
    assert str(parse_chaos("stall:shard=0,round=1")) == "stall:shard=0,round=1"
    with pytest.raises(ValueError, match="known kinds: crash, hang, kill, preempt, stall, stop, zombie"):
        parse_chaos("freeze:shard=0,round=1")
    specs = ["hang:shard=0,round=2", "zombie:shard=1,round=3", "kill:shard=1,round=2"]
    assert [str(c) for c in for_attempt(specs, 1, 2, 1)] == ["kill:shard=1,round=2"]
    assert for_attempt(specs, 1, 2, 2) == []  # the rerun (attempt 2) is spared


def test_kill_and_stop_need_a_process_based_task_runner():
    with pytest.raises(ValueError, match="use --task-runner dask"):
        check_runner(["hang:shard=0,round=2", "kill:shard=1,round=2"], "threads")
    with pytest.raises(ValueError, match="stop:shard=0,round=1 kills or stops"):
        check_runner(["stop:shard=0,round=1"], "threads")
    check_runner(["kill:shard=1,round=2"], "dask")
    check_runner(["hang:shard=0,round=2", "zombie:shard=1,round=3"], "threads")


def test_a_spec_strikes_once_per_run(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        c = parse_chaos("crash:shard=1,round=2")
        with pytest.raises(ChaosCrash):
            strike(c, part="shard-1", round_step=3, checkpointer=ck, generation=0)
        strike(c, part="shard-1", round_step=3, checkpointer=ck, generation=0)  # already struck: nothing
        record = read_strike(ck.store, "shard-1", 2, 1)
        assert record is not None and record.kind == "crash" and record.round_step == 3 and record.time <= time.time()


def test_a_hung_attempt_ends_itself_once_fenced(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        out: dict = {}

        def hang():
            try:
                strike(parse_chaos("hang:shard=0,round=1"), part="shard-0", round_step=2, checkpointer=ck, generation=0)
            except BaseException as e:  # noqa: BLE001
                out["error"], out["t"] = e, time.monotonic()

        th = threading.Thread(target=hang)
        th.start()
        time.sleep(0.8)
        assert th.is_alive() and not out  # hung: no return, no exception
        t_fence = time.monotonic()
        assert ck.fence("shard-0", 1, reason="test", by="test")
        th.join(timeout=5)
        assert isinstance(out["error"], FencedError) and out["t"] - t_fence < 2.0


def test_a_zombie_loses_its_beats_and_writes_a_fragment_of_a_fenced_generation(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        hb = Heartbeat(ck.store, "shard-1", generation=0, round=1, every_s=0.05)
        hb.start(step=0)
        done = threading.Event()
        th = threading.Thread(target=lambda: (strike(parse_chaos("zombie:shard=1,round=1"), part="shard-1", round_step=1,
                                                     heartbeat=hb, checkpointer=ck, generation=0), done.set()))
        th.start()
        time.sleep(0.3)
        assert not done.is_set()  # it holds its fragment back until it is fenced
        assert ck.fence("shard-1", 1, reason="silent", by="test")
        th.join(timeout=5)
        assert done.is_set()
        assert isinstance(hb.store, Partitioned) and isinstance(ck.store, StaleFences)
        before = read_heartbeat(ck.store.inner, "shard-1")
        assert hb.beat(step=5, force=True) is not None  # no FencedError: it cannot see its fence
        assert read_heartbeat(ck.store.inner, "shard-1") == before  # and the beat never arrived
        frag = ck.write_fragment(1, "shard-1", {"w": torch.ones(4)}, generation=0)  # its stale view says live
        real = ck.store.inner
        assert frag.generation == 0 and real.exists(commit.fragment_key(1, "shard-1", 0))
        with pytest.raises(FencedError):
            commit.check_live(real, "shard-1", 0)
        # what a coordinator gathers is the live generation's fragment, never this one
        with pytest.raises(TimeoutError, match="shard-1"):
            commit.gather(real, 1, ["shard-1"], timeout=0.3, poll=0.05)


def test_kill_is_a_real_sigkill_of_the_shards_own_process(tmp_path):
    code = (f"from ckptlib import Checkpointer; from trainrun.chaos import parse_chaos, strike; "
            f"ck = Checkpointer({str(tmp_path)!r}); "
            f"strike(parse_chaos('kill:shard=1,round=2'), part='shard-1', round_step=7, checkpointer=ck, generation=0); "
            f"print('survived')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL and "survived" not in p.stdout
    with Checkpointer(str(tmp_path)) as ck:
        assert read_strike(ck.store, "shard-1", 2, 1).round_step == 7
