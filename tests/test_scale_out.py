"""Scale-out, for real, at a small scale (docs/scale.md; the measurements are in bench/):

* shards in separate Dask worker processes started from the ``dask`` CLI (own working directories,
  the store on SeaweedFS S3, credentials in the workers' environment), one worker killed mid-round
  like a machine (SIGKILL of its process group), then the run resumed with another shard count;
* shards as flow runs of the ``train-shard/shard`` deployment spread over two Prefect workers of one
  process work pool, one worker killed mid-round with the flow run it was running;
* the watchdog simulator: a look's requests do not grow with the run's history, the watchdog's
  memory does not grow with rounds, and a silent shard is fenced within 1 s of the timeout.

Every run here reaches the digest of a clean run with the same settings (threads, local store).
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from ckptlib import Checkpointer
from ckptlib.heartbeat import read_heartbeats
from ckptlib.store import Store
from tests.drills import TIMEOUT
from tests.runs import EXTRA, digests, worker_env
from trainrun.spec import RunSpec

SETTINGS = {"workload": "tinylm", "workload_extra": EXTRA, "shards": 2, "rounds": 2, "steps_per_round": 60, "seed": 0,
            "heartbeat_every_s": 0.1, "retry_delay_s": 0.2, "validation_runner": "threads"}


def params(**kw):
    from flows.params import TrainParams

    return TrainParams(**{**SETTINGS, **kw})


@pytest.fixture(scope="module")
def clean(prefect_harness, clean_digests):
    """The reference digests (plain calls, computed once per session; the same as a Prefect run's)."""
    return clean_digests(RunSpec(**{k: v for k, v in SETTINGS.items() if k in RunSpec.model_fields}),
                         SETTINGS["rounds"])


class KillMidRound(threading.Thread):
    """Watches the run's heartbeats; the first time a shard beats mid-round (some steps done, its
    fragment not written yet) from a process of a watched machine, kills that machine."""

    def __init__(self, store: Store, machines: dict[int, object], pids_of, kill):
        super().__init__(daemon=True)
        self.store, self.machines, self.pids_of, self.kill = store, machines, pids_of, kill
        self.killed: dict | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and self.killed is None:
            for beat in read_heartbeats(self.store).values():
                if beat.part == "coordinator" or beat.status != "running" or not beat.round_step:
                    continue
                if self.store.exists(f"fragments/{beat.round}/{beat.part}.g{beat.generation}.json"):
                    continue
                for m in self.machines:
                    if beat.pid in self.pids_of(m):
                        self.kill(m)
                        self.killed = {"machine": m, "part": beat.part, "round": beat.round,
                                       "round_step": beat.round_step, "time": time.time()}
                        return
            time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.prefect
def test_dask_cli_workers_on_s3_survive_a_killed_worker_and_reshard(clean, s3_url, tmp_path, monkeypatch):
    from deployments.dask_cluster import DaskCluster
    from flows.train import train_run

    store, so = s3_url
    # the flow's process reaches the store with its own environment too: no credentials in any parameter
    monkeypatch.setenv("CKPT_STORAGE_OPTIONS", json.dumps(so))
    with DaskCluster.start(tmp_path / "dask", workers=3, env=worker_env(so)) as dc:
        url = f"{store}/dask-cli"
        workers = set().union(*(dc.worker_pids(i) for i in range(3)))  # the "machines'" processes
        killer = KillMidRound(Store.from_url(url, so), {0: None, 1: None, 2: None}, dc.worker_pids, dc.kill_worker)
        killer.start()
        try:
            s = train_run(params(store=store, run_id="dask-cli", task_runner=dc.runner))
        finally:
            killer.stop.set()
        assert killer.killed is not None, "no shard was caught mid-round: the round was over too soon"
        assert dc.alive_workers() == 2
        assert s["final_digest"] == clean[2] and digests(url, so) == clean
        # the shards' last beats came from the workers' processes, none from this one
        pids = {b.pid for b in read_heartbeats(Store.from_url(url, so)).values() if b.part != "coordinator"}
        assert pids and pids <= workers and os.getpid() not in pids, (pids, workers)
        # ... and a resume with another shard count continues from the last step on the same cluster
        r = train_run(params(store=store, run_id="dask-cli", task_runner=dc.runner, resume=True, shards=3, rounds=3))
    with Checkpointer(url, so) as ck:
        assert sorted(ck.manifest(3).parts) == ["coordinator", "shard-0", "shard-1", "shard-2"]
        assert ck.restore(3, part="coordinator")["reshards"] == [{"step": 2, "shards": [2, 3]}]
        assert ck.healthy_steps() == [0, 1, 2, 3]
    assert r["committed"] == [3] and {k: v for k, v in digests(url, so).items() if k <= 2} == clean


@pytest.mark.slow  # over 60 s on CI: Prefect workers start a process (torch imported) per shard round
@pytest.mark.prefect
def test_work_pool_shards_survive_a_killed_prefect_worker(clean, s3_url, tmp_path, monkeypatch):
    from ckpt.beside import BesideWatchdog
    from deployments.shard_pool import PrefectWorkers, deploy_shard_flow
    from flows.train import train_run

    store, so = s3_url
    monkeypatch.setenv("CKPT_STORAGE_OPTIONS", json.dumps(so))
    pool = "test-shards"
    runner = deploy_shard_flow(pool, name="test")
    assert runner == "pool:train-shard/test"
    with PrefectWorkers.start(tmp_path / "workers", pool, workers=2, env=worker_env(so)) as workers:
        url = f"{store}/pool"
        killer = KillMidRound(Store.from_url(url, so), {0: None, 1: None}, workers.pids, workers.kill)
        p = params(store=store, run_id="pool", task_runner=runner, validate_checkpoints=False)  # digests only
        guard = BesideWatchdog(p, timeout_s=TIMEOUT).start()  # the machine died: its shard is silent
        killer.start()
        try:
            s = train_run(p)
        finally:
            killer.stop.set()
            guard.stop()
        assert killer.killed is not None, "no shard was caught mid-round: the round was over too soon"
    assert s["final_digest"] == clean[2] and digests(url, so) == clean
    # the dead machine's shard was fenced and rerun; on a loaded machine a flow run slow to start
    # (tens of seconds) may be fenced too ("missing"): the digest is the same either way
    fenced = {(d["part"], d["round"]) for d in guard.decisions() if d["kind"] == "fenced"}
    assert (killer.killed["part"], killer.killed["round"]) in fenced, (killer.killed, fenced)
    hosts = {r["shard"]: r for x in s["rounds_log"] for r in x["shards"]}
    assert hosts  # the rounds' shard results were read back from the store


def test_watchdog_simulator_look_cost_memory_and_detection(tmp_path):
    from bench.watchdog_sim import BeatSimulator, add_history, detection_jitter, look, watchdog

    url = str(tmp_path / "sim")
    store = Store.from_url(url)
    shards, timeout = 20, 3.0
    with BeatSimulator(store, shards, every_s=0.2, round=301) as sim:
        wd = watchdog(url, None, timeout)
        look(wd)
        first = look(wd)
        # listings of the heartbeats, the fences and this round's fragments, one read per beat;
        # nothing per round of history
        assert first["by_verb"] == {"LIST": 3, "GET": shards + 1}, first
        add_history(store, 300)
        later = look(wd)
        assert later["requests"] == first["requests"], (first, later)
        for _ in range(5):
            sim.next_round()
            look(wd)
        assert len(wd.memory) <= 2 * shards, sorted(map(str, wd.memory))  # per part, not per round
        assert not [d for d in wd.decisions if d.kind == "fenced"], wd.decisions  # healthy shards are left alone
        jitter = detection_jitter(sim, wd, trials=2, poll_s=0.2, timeout_s=timeout)
    assert all(0 <= j["jitter_s"] < 1.0 for j in jitter), jitter


def test_a_work_pool_run_gives_shards_a_flow_runs_start_before_calling_them_missing():
    """A shard flow run on a work pool starts a fresh process (40 s on a loaded machine): the
    watchdog beside the run must not fence every shard of every round as never started."""
    from ckpt.beside import POOL_START_TIMEOUT_S, BesideWatchdog
    from trainrun.watchdog.judge import start_timeout_for

    assert BesideWatchdog(params(task_runner="pool:train-shard/shard"), 4.0).start_timeout_s == POOL_START_TIMEOUT_S
    assert BesideWatchdog(params(task_runner="pool:train-shard/shard"), 90.0).start_timeout_s == 180.0
    assert BesideWatchdog(params(task_runner="threads"), 4.0).start_timeout_s is None  # the default
    # a Dask worker process imports torch and Prefect with its first task (over 34 s seen in CI)
    assert BesideWatchdog(params(task_runner="dask"), 4.0).start_timeout_s == POOL_START_TIMEOUT_S
    assert start_timeout_for(4.0) < 40 < POOL_START_TIMEOUT_S
