"""The watchdog for real: heartbeating processes killed with SIGKILL and stopped with SIGSTOP, watchdogs
racing to fence, chaos drills in real Prefect training runs (threads and Dask processes, local and
SeaweedFS S3), ``ckpt train``/``ckpt status`` as subprocesses, and a dead deployment run started again.

Settings are tiny (``tests/drills.py``: tinylm with one layer, 2 shards, 3 rounds of 40 steps, a beat
every 0.5 s, a 2 s timeout, the shortest the beats' jitter allows) so the file runs in a couple of
minutes on two busy cores. Every drill ends with the clean run's digest at every step, every
committed step verifies, no manifest holds a fenced attempt's fragment, and the watchdog decided
nothing but the struck parts' recoveries (no false alarm). The figures measured here (detection latency, time to running again, steps lost) are
printed (``pytest -s``) and written to ``test-output/watchdog-figures.json``; docs/watchdog.md quotes
them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from ckptlib import Checkpointer, commit
from ckptlib.heartbeat import Beat, Heartbeat, read_heartbeat
from ckptlib.store import Store
from tests.drills import (
    DRILL,
    POLL,
    SLACK,
    TIMEOUT,
    again,
    check_latency,
    check_run,
    fenced,
    only_recoveries,
    params,
    train_with_watchdog,
)
from tests.runs import EXTRA, cli_env
from trainrun.spec import RunSpec
from trainrun.watchdog import Memory, Watchdog, assess_run

FIGURES: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield FIGURES
    if FIGURES:
        out = Path(__file__).resolve().parent.parent / "test-output"
        out.mkdir(exist_ok=True)
        (out / "watchdog-figures.json").write_text(json.dumps(FIGURES, indent=1))
        print("\nwatchdog figures:")
        for f in FIGURES:
            print("  " + ", ".join(f"{k}={v}" for k, v in f.items()))


def record(drill: str, **values) -> None:
    FIGURES.append({"drill": drill, **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in values.items()}})


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def where(request, tmp_path):
    """(url, storage_options) of an empty place for one run: a local directory or an S3 prefix."""
    if request.param == "local":
        return str(tmp_path / "run"), None
    loc = request.getfixturevalue("s3_url")
    return loc.url, loc.storage_options


# --- judging beats (no processes, a fake clock) --------------------------------------------------------

def _beat(store, part, *, t, gen=0, status="running", round=1, step=5, attempt=1, started=None, meta=None):
    doc = {"format": 1, "part": part, "generation": gen, "round": round, "step": step, "round_step": step,
           "steps_per_round": 40, "status": status, "time": t, "started": started or t - 1, "beats": 3,
           "host": "h", "pid": 1, "attempt": attempt, "loss": None, "meta": meta or {}}
    store.put(f"heartbeats/{part}.json", json.dumps(doc).encode())


def test_the_watchdogs_memory_keeps_per_part_progress_and_reports_a_decision_once():
    """What a watchdog remembers between looks: since when a part is at its step (per part, not per
    round), the last beat of each generation, and which decisions it has made already."""
    memory = Memory()

    def beat(t: float, step: int, generation: int = 0, round_no: int = 2) -> Beat:
        return Beat(part="shard-0", generation=generation, round=round_no, status="running", time=t, started=0.0,
                    step=step, attempt=1)

    assert memory.progress_since("u", "shard-0", beat(10.0, 5)) == 10.0
    assert memory.progress_since("u", "shard-0", beat(15.0, 5)) == 10.0  # same step: since the first look
    assert memory.progress_since("u", "shard-0", beat(16.0, 6)) == 16.0  # it moved
    assert memory.progress_since("u", "shard-0", beat(17.0, 6, generation=1)) == 17.0  # another attempt
    for r in range(3, 50):  # later rounds replace the part's entry: the memory does not grow with them
        memory.progress_since("u", "shard-0", beat(float(r), r, round_no=r))
    assert memory.last_seen("u", "shard-0", 1) is None
    memory.saw("u", "shard-0", beat(20.0, 7, generation=1))
    memory.saw("u", "shard-0", beat(21.0, 8, generation=1))
    assert memory.last_seen("u", "shard-0", 1) == 21.0 and memory.last_seen("v", "shard-0", 1) is None
    assert memory.first_time("gave-up", "u", "shard-0", 2) and not memory.first_time("gave-up", "u", "shard-0", 2)
    assert memory.first_time("gave-up", "u", "shard-0", 3) and memory.first_time("cannot-rerun", "u", "shard-0", 2)
    assert len(memory) == 5 == len(list(memory))  # progress of one part, one generation seen, three decisions


def test_the_rules_silent_stalled_replaced_lost_missing_and_stale_beats(tmp_path):
    store = Store.from_url(str(tmp_path))
    now = 1_000_000.0
    coord_meta = {"spec": {"shards": 3}, "phase": "shards", "phase_time": now - 50, "cut": {"step": 1}}
    _beat(store, "coordinator", t=now - 0.5, round=2, step=2, started=now - 100, meta=coord_meta)
    _beat(store, "shard-0", t=now - 5, round=2)  # silent
    _beat(store, "shard-1", t=now - 0.2, round=2, started=now - 60)  # fresh
    _beat(store, "shard-2", t=now - 30, round=1, status="finished")  # has not started round 2 for 50 s
    memory = Memory()
    v = assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=now, memory=memory)
    assert v.state == "running" and [p.state for p in v.shards] == ["silent", "running", "missing"]
    assert v.shards[0].failure_time == now - 5 and "no heartbeat for 5.0 s" in v.shards[0].reason
    # shard-1 keeps beating at the same step: stalled once that lasted longer than the timeout
    _beat(store, "shard-1", t=now + 4.5, round=2, started=now - 60)  # the same attempt
    _beat(store, "coordinator", t=now + 4.5, round=2, step=2, started=now - 100, meta=coord_meta)
    v = assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=now + 4.6, memory=memory)
    assert v.shards[1].state == "stalled" and v.shards[1].failure_time == now - 0.2
    # fenced: the old beat is a replaced attempt's until the new generation beats (then "lost")
    commit.fence(store, "shard-0", 1, reason="t", by="t")  # (the fence document's time is now)
    t = time.time()
    _beat(store, "coordinator", t=t, round=2, step=2, started=now - 100, meta=coord_meta)
    v = assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=t + 1)
    assert v.shards[0].state == "replaced" and v.shards[0].live == 1
    v = assess_run(store, "u", timeout_s=4, start_timeout_s=3, now=t + 3.5)
    assert v.shards[0].state == "lost" and "never beat" in v.shards[0].reason
    # a written fragment means done, whatever the beat says
    store.put(commit.fragment_key(2, "shard-2", 0), b"{}")
    assert assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=now).shards[2].state == "done"
    # beats from before the coordinator's session (a previous run of this run id) are ignored
    _beat(store, "coordinator", t=now - 0.5, round=2, step=2, started=now - 1, meta={**coord_meta, "phase_time": now - 1})
    assert assess_run(store, "u", timeout_s=4, now=now).shards[0].state == "waiting"
    # and a silent coordinator is a dead run, whose shards are nobody's business
    _beat(store, "coordinator", t=now - 10, round=2, step=2, started=now - 100, meta=coord_meta)
    v = assess_run(store, "u", timeout_s=4, now=now)
    assert v.state == "dead" and "coordinator has not beaten" in v.coordinator.reason


def test_a_watchdog_of_one_session_does_not_take_a_dead_predecessor_for_its_run(tmp_path):
    """The run was killed (its coordinator's and shards' last beats say running, long ago); a new
    session resumes it. The watchdog beside that session (``since`` = its start) sees nothing dead
    until the session beats, and then judges only the session's beats. Before: "run-dead: the
    coordinator has not beaten for 40.1 s" in the resumed run's own summary."""
    store = Store.from_url(str(tmp_path / "r"))
    now = time.time()
    meta = {"spec": {"shards": 2}, "phase": "shards", "phase_time": now - 60, "cut": {"step": 1}}
    _beat(store, "coordinator", t=now - 40, round=2, step=2, started=now - 100, meta=meta)
    for i in range(2):
        _beat(store, f"shard-{i}", t=now - 40, round=2)
    ignoring = Watchdog(str(tmp_path / "r"), timeout_s=4, since=now - 1)
    assert ignoring.poll() == [] and ignoring.views[str(tmp_path / "r")].coordinator is None
    assert [d.kind for d in Watchdog(str(tmp_path / "r"), timeout_s=4).poll()] == ["run-dead"]  # another watchdog
    # the session beats: from then on it is judged (a silent shard of this session is dead again)
    _beat(store, "coordinator", t=now + 4.8, round=2, step=2, started=now - 0.5, meta={**meta, "phase_time": now - 0.5})
    _beat(store, "shard-0", t=now, round=2)
    view = assess_run(store, "u", timeout_s=4, now=now + 5, since=now - 1)
    assert view.state == "running" and view.shards[0].state == "silent" and view.shards[1].state == "waiting"


def test_describe_says_the_same_step_in_the_fence_and_in_the_steps_to_redo():
    """A drill knows the step it struck at, later than the last beat: both lines count from it
    (before: "at step 8/20" in the fence, then "10 steps to redo")."""
    from trainrun.watchdog import Decision, describe

    d = Decision(kind="fenced", run="r", run_url="u", part="shard-0", state="silent", detected=10.0,
                 failure_time=2.0, detection_latency_s=8.0, by="w", round=1, round_step=8, steps_per_round=20,
                 reason="no heartbeat for 8.0 s (timeout 8 s) at step 8/20 of round 1", generation=1,
                 steps_lost=10, strike_time=2.5, strike_latency_s=7.5)
    assert "the drill struck at step 10/20, 7.5 s ago" in describe(d)


def test_a_fenced_attempt_ends_at_info_and_a_failed_one_at_error():
    """Prefect logs every final state but Completed at ERROR; a Fenced attempt is recovery, not an error."""
    import logging

    import tasks  # noqa: F401 - installs the filter (tasks/log_levels.py)

    seen: list[tuple[int, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("prefect.task_runs")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.error("Finished in state Fenced('fenced by watchdog@h: no heartbeat', type=CANCELLED)")
        logger.error("Finished in state Failed('boom')")
    finally:
        logger.removeHandler(handler)
    assert [level for level, _ in seen] == [logging.INFO, logging.ERROR], seen


# --- real processes: detection, the zombie stops itself --------------------------------------------

BEATER = """
import json, sys, time
from ckptlib.errors import FencedError
from ckptlib.heartbeat import Heartbeat
from ckptlib.store import Store
store = Store.from_url(sys.argv[1], json.loads(sys.argv[2]))
hb = Heartbeat(store, "shard-0", generation=0, round=1, steps_per_round=10**6, every_s=0.2)
hb.start(step=0)
print("ready", flush=True)
step = 0
try:
    while True:
        step += 1
        time.sleep(0.01)
        hb.beat(step=step)
except FencedError:
    hb.finish("fenced")
    sys.exit(3)
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_dead_or_frozen_process_is_fenced_within_timeout_plus_one_poll(where, sig):
    url, so = where
    child = subprocess.Popen([sys.executable, "-c", BEATER, url, json.dumps(so)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        wd = Watchdog(url, so, timeout_s=2.0, by="test-watchdog")
        time.sleep(1.0)
        assert wd.poll() == []  # alive and advancing: nothing to do
        t_fail = time.time()
        os.kill(child.pid, getattr(signal, sig))
        fenced = None
        while fenced is None and time.time() - t_fail < 30:
            fenced = next((d for d in wd.poll() if d.kind == "fenced"), None)
            time.sleep(0.5)
        assert fenced is not None, "never detected"
        since_failure = fenced.detected - t_fail
        assert 2.0 <= fenced.detection_latency_s <= 2.0 + 0.5 + SLACK
        assert since_failure <= 2.0 + 0.5 + SLACK
        doc = commit.read_fence(Store.from_url(url, so), "shard-0", 1)
        assert doc["by"] == "test-watchdog" and doc["detection_latency_s"] == fenced.detection_latency_s
        record(f"detect-{sig.lower()}-{'s3' if so else 'local'}", timeout_s=2.0, poll_s=0.5,
               detection_latency_s=fenced.detection_latency_s, since_failure_s=since_failure)
        if sig == "SIGSTOP":  # woken up, the zombie notices the fence at its next beat and stops itself
            os.kill(child.pid, signal.SIGCONT)
            assert child.wait(timeout=30) == 3
            assert read_heartbeat(Store.from_url(url, so), "shard-0").status == "fenced"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


RACER = """
import json, sys, time
from ckptlib import commit
from ckptlib.store import Store
store = Store.from_url(sys.argv[1], json.loads(sys.argv[2]))
start = float(sys.argv[3])
time.sleep(max(0.0, start - time.time()))
print(json.dumps(commit.fence(store, "shard-1", 1, reason="race", by=sys.argv[4])), flush=True)
"""


def test_fencing_wins_exactly_once_among_racing_processes_and_watchdogs(where):
    url, so = where
    start = time.time() + 3.0  # every process imports first, then all call fence at the same moment
    procs = [subprocess.Popen([sys.executable, "-c", RACER, url, json.dumps(so), str(start), f"p{i}"],
                              stdout=subprocess.PIPE, text=True) for i in range(6)]
    wins = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert sum(wins) == 1
    store = Store.from_url(url, so)
    assert commit.read_fence(store, "shard-1", 1)["by"] == f"p{wins.index(True)}"

    # two watchdogs looking at the same silent shard at the same moment: one fences, one does nothing
    _beat(store, "shard-0", t=time.time() - 60)
    dogs = [Watchdog(url, so, timeout_s=5, by=f"dog-{i}") for i in range(2)]
    barrier = threading.Barrier(2)
    decided: dict = {}

    def look(i):
        dogs[i].discover()
        barrier.wait()
        decided[i] = dogs[i].poll()

    threads = [threading.Thread(target=look, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    kinds = sorted(d.kind for ds in decided.values() for d in ds)
    assert kinds.count("fenced") == 1 and set(kinds) <= {"fenced", "lost-race"}
    winner = next(d.by for ds in decided.values() for d in ds if d.kind == "fenced")
    assert commit.read_fence(store, "shard-0", 1)["by"] == winner
    assert commit.live_generation(store, "shard-0") == 1


# --- chaos drills in real training runs ---------------------------------------------------------------

@pytest.fixture(scope="module")
def clean(prefect_harness, clean_digests):
    """The reference: the clean run's digests (each drill checks its watchdog raised no false alarm)."""
    return clean_digests(RunSpec(**{k: v for k, v in DRILL.items() if k in RunSpec.model_fields}), DRILL["rounds"])


@pytest.mark.prefect
@pytest.mark.slow
def test_hang_and_zombie_drills_reach_the_clean_digest(clean, tmp_path):
    s, ds = train_with_watchdog(params(store=str(tmp_path), run_id="hz",
                                       chaos=["hang:shard=0,round=2", "zombie:shard=1,round=3"]))
    url = s["run_url"]
    check_run(url, None, clean, struck={"shard-0": 2, "shard-1": 3})
    hang, zombie = fenced(ds, "shard-0"), fenced(ds, "shard-1")
    only_recoveries(ds, {"shard-0", "shard-1"})
    assert (hang["round"], hang["dead_generation"], hang["generation"]) == (2, 0, 1)
    assert (zombie["round"], zombie["dead_generation"], zombie["generation"]) == (3, 0, 1)
    for d in (hang, zombie):
        check_latency(d)
    # the zombie wrote its fragment after it was fenced; the cut took the live generation's
    assert Path(url, "fragments", "3", "shard-1.g0.json").exists()
    with Checkpointer(url) as ck:
        assert commit.fragment_key(3, "shard-1", ck.manifest(3).parts["shard-1"].generation) != \
            commit.fragment_key(3, "shard-1", 0)
    # GC sweeps the zombie's fragment (garbage: no manifest names it); every checkpoint stays intact
    from ckptlib import RetentionPolicy

    with Checkpointer(url) as ck:
        ck.gc(RetentionPolicy(keep_last=10), grace_s=0)
        assert not Path(url, "fragments", "3", "shard-1.g0.json").exists()
        assert all(ck.verify(step) == [] for step in ck.steps()) and ck.steps() == [0, 1, 2, 3]
    shards = {r["round"]: {x["shard"]: x["status"] for x in r["shards"]} for r in s["rounds_log"]}
    assert shards[2][0] in ("fenced", "replaced") and shards[3][1] in ("superseded", "replaced")
    for kind, d in (("hang", hang), ("zombie", zombie)):
        a = again(ds, d["part"])
        record(kind, timeout_s=TIMEOUT, detection_latency_s=d["detection_latency_s"],
               from_strike_s=d["strike_latency_s"], running_again_s=a["running_again_s"],
               steps_lost=d["steps_lost"], flow_s=s["seconds"]["flow"])
    # the fence documents say why, and `ckpt status` shows it
    from typer.testing import CliRunner

    from ckpt.cli import app

    res = CliRunner().invoke(app, ["status", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.output)[0]
    assert st["state"] == "finished" and [p["live"] for p in st["parts"]] == [1, 1]
    assert {f["part"] for f in st["fences"]} == {"shard-0", "shard-1"} and all("no heartbeat" in f["reason"]
                                                                                for f in st["fences"])
    res = CliRunner().invoke(app, ["status", url])
    assert res.exit_code == 0 and "shard-1" in res.output and "fence shard-0 g1" in res.output


@pytest.mark.prefect
@pytest.mark.slow
def test_zombie_and_stall_drills_on_s3(clean, s3_url, monkeypatch):
    """On SeaweedFS: a zombie in round 2, and in round 3 a shard that beats on without advancing."""
    store, so = s3_url
    monkeypatch.setenv("CKPT_STORAGE_OPTIONS", json.dumps(so))  # the watchdog's (as ckpt train's is)
    s, ds = train_with_watchdog(params(store=store, run_id="zombie", storage_options=so,
                                       chaos=["zombie:shard=0,round=2", "stall:shard=1,round=3"]))
    check_run(s["run_url"], so, clean, struck={"shard-0": 2, "shard-1": 3})
    only_recoveries(ds, {"shard-0", "shard-1"})
    d = fenced(ds, "shard-0")
    check_latency(d)
    assert Store.from_url(s["run_url"], so).exists("fragments/2/shard-0.g0.json")
    record("zombie-s3", timeout_s=TIMEOUT, detection_latency_s=d["detection_latency_s"],
           from_strike_s=d["strike_latency_s"], running_again_s=again(ds, "shard-0")["running_again_s"],
           steps_lost=d["steps_lost"])
    st = fenced(ds, "shard-1")
    assert st["state"] == "stalled" and "no progress" in st["reason"] and st["round"] == 3
    # a stall is noticed from the first beat at the unchanged step: timeout + up to a beat and a look
    assert TIMEOUT <= st["strike_latency_s"] <= TIMEOUT + DRILL["heartbeat_every_s"] + POLL + SLACK, st
    record("stall-s3", timeout_s=TIMEOUT, detection_latency_s=st["detection_latency_s"],
           from_strike_s=st["strike_latency_s"], running_again_s=again(ds, "shard-1")["running_again_s"],
           steps_lost=st["steps_lost"])


class BeatLog(threading.Thread):
    """Every distinct beat of one part, read from the store every 20 ms (to date recoveries)."""

    def __init__(self, url: str, part: str):
        super().__init__(daemon=True)
        self.url, self.part, self.docs, self.stop = url, part, [], threading.Event()

    def run(self):
        seen = set()
        while not self.stop.wait(0.02):
            try:
                doc = json.loads(Path(self.url, "heartbeats", f"{self.part}.json").read_text())
            except (OSError, ValueError):
                continue
            k = (doc["started"], doc["beats"], doc["pid"])
            if k not in seen:
                seen.add(k)
                self.docs.append(doc)


@pytest.mark.prefect
@pytest.mark.slow  # over 60 s on CI: `ckpt train` with a Dask cluster, a killed worker replaced, a hang
def test_cli_kill_and_hang_drills_with_dask_processes(clean, tmp_path):
    """`ckpt train --task-runner dask --chaos kill:... --chaos hang:...` with its own watchdog: a Dask
    worker SIGKILLs itself in round 2, another shard hangs in round 3."""
    url = str(tmp_path / "kh")
    log = BeatLog(url, "shard-1")
    log.start()
    cmd = [sys.executable, "-m", "ckpt", "train", "--store", str(tmp_path), "--run-id", "kh", "--shards", "2",
           "--rounds", "3", "--steps-per-round", "40", "--workload-extra", json.dumps(EXTRA), "--heartbeat-every",
           "0.5", "--watchdog-timeout", str(TIMEOUT), "--task-runner", "dask", "--json", str(tmp_path / "s.json"),
           "--chaos", "kill:shard=1,round=2", "--chaos", "hang:shard=0,round=3", "--validation-runner", "threads"]
    p = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True, timeout=400)
    log.stop.set()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"digest: {clean[3]}" in p.stdout
    check_run(url, None, clean, struck={"shard-0": 3})
    s = json.loads((tmp_path / "s.json").read_text())
    hang = fenced(s["watchdog"], "shard-0")
    check_latency(hang)
    assert "watchdog        shard-0 of run kh round 3" in p.stdout
    kill = json.loads(Path(url, "chaos", "shard-1.r2.a1.json").read_text())
    # the killed worker's task ran again: by Dask at once (it saw the worker die), or by the watchdog
    later = [d for d in log.docs if d["round"] == 2 and d["started"] > kill["time"]]
    assert later and later[0]["pid"] != kill["pid"]
    by_watchdog = [d for d in s["watchdog"] if d["part"] == "shard-1" and d["kind"] == "fenced"]
    only_recoveries(s["watchdog"], {"shard-0", "shard-1"} if by_watchdog else {"shard-0"})
    record("kill", runner="dask", recovered_by="watchdog" if by_watchdog else "dask",
           running_again_s=later[0]["started"] - kill["time"], steps_lost=kill["round_step"],
           detection_latency_s=by_watchdog[0]["detection_latency_s"] if by_watchdog else None)
    record("hang-dask", timeout_s=TIMEOUT, detection_latency_s=hang["detection_latency_s"],
           from_strike_s=hang["strike_latency_s"], running_again_s=again(s["watchdog"], "shard-0")["running_again_s"],
           steps_lost=hang["steps_lost"], cli_s=s["seconds"]["cli_total"])


@pytest.mark.prefect
@pytest.mark.slow
def test_a_stopped_dask_worker_is_fenced_replaced_and_stops_itself_when_woken(clean, tmp_path):
    """``stop`` chaos: SIGSTOP of the Dask worker process training shard-1 in round 2 (a frozen host:
    Dask sees nothing for minutes); its waker sends SIGCONT once the watchdog has fenced it."""
    p = params(store=str(tmp_path), run_id="stop", task_runner="dask", chaos=["stop:shard=1,round=2"])
    url = str(tmp_path / "stop")
    s, ds = train_with_watchdog(p)
    stop = json.loads(Path(url, "chaos", "shard-1.r2.a1.json").read_text())
    assert stop["kind"] == "stop" and stop["pid"] != os.getpid()
    check_run(url, None, clean, struck={"shard-1": 2})
    d = fenced(ds, "shard-1")
    only_recoveries(ds, {"shard-1"})
    assert d["round"] == 2 and d["dead_generation"] == 0
    check_latency(d)
    assert d["detected"] - stop["time"] <= TIMEOUT + POLL + SLACK
    status = {x["shard"]: x["status"] for x in s["rounds_log"][1]["shards"]}[1]
    assert status in ("fenced", "replaced")  # woken, it found its fence and stopped (or the flow went on)
    record("sigstop-dask", timeout_s=TIMEOUT, detection_latency_s=d["detection_latency_s"],
           since_stop_s=d["detected"] - stop["time"], running_again_s=again(ds, "shard-1")["running_again_s"],
           steps_lost=d["steps_lost"])


def _dead_deployment_run(deployment_store: str, where: Path, run_id: str):
    """(deployment id, flow run): a deployment of train_run on ``deployment_store``, a flow run of it
    for ``run_id``, and under ``where`` that run's coordinator beat naming them, silent from now on."""
    from prefect.client.orchestration import get_client

    from flows.train import train_run

    base = params(store=deployment_store).model_dump(mode="json")
    with get_client(sync_client=True) as c:
        flow_id = c.create_flow(train_run)
        dep_id = c.create_deployment(flow_id=flow_id, name=f"wd-{uuid.uuid4().hex[:6]}", parameters={"params": base},
                                     entrypoint="flows.train.train_run")
        old = c.create_flow_run_from_deployment(dep_id, parameters={"params": {**base, "run_id": run_id}})
    hb = Heartbeat(Store.from_url(str(where / run_id)), "coordinator", generation=0, round=2, every_s=1,
                   meta={"run_id": run_id, "flow_run_id": str(old.id), "deployment_id": str(dep_id),
                         "spec": {"shards": 2}, "phase": "shards", "phase_time": time.time()})
    hb.start(step=2)
    time.sleep(1.2)  # silent from now on
    return dep_id, old


@pytest.mark.prefect
def test_a_dead_run_from_a_deployment_is_reported_and_started_again_once(prefect_harness, tmp_path):
    """The coordinator of a deployment's run stops beating: the watchdog marks the flow run crashed
    and runs the deployment again with resume (once, whatever the number of watchdogs)."""
    from prefect.client.orchestration import get_client

    from flows.watchdog import watchdog

    dep_id, old = _dead_deployment_run(str(tmp_path), tmp_path, "dead")
    first = watchdog(store=str(tmp_path), timeout_s=1.0, poll_s=0.2, duration_s=0.5)
    kinds = [d["kind"] for d in first["decisions"]]
    assert kinds == ["run-dead", "resumed"], first["decisions"]
    new_id = first["decisions"][1]["resumed"]["flow_run_id"]
    second = watchdog(store=str(tmp_path), timeout_s=1.0, poll_s=0.2, duration_s=0.5)
    assert second["decisions"] == []  # reported and restarted once
    with get_client(sync_client=True) as c:
        new = c.read_flow_run(uuid.UUID(new_id))
        assert new.deployment_id == dep_id
        assert new.parameters["params"]["resume"] is True and new.parameters["params"]["run_id"] == "dead"
        assert c.read_flow_run(old.id).state.type.value == "CRASHED"
        runs = c.read_flow_runs()
        assert sum(1 for r in runs if r.deployment_id == dep_id) == 2  # the dead one and one restart


@pytest.mark.prefect
def test_the_watchdog_resumes_only_runs_of_its_own_store(prefect_harness, tmp_path):
    """A beat in the watchdog's store names a flow run of a deployment that trained a run of the same
    id in another store (anyone who can write this store can write that beat). The watchdog refuses
    to start it (a resume-failed decision, notified), and starts nothing: before, it ran that
    deployment again, i.e. resumed a run of another store."""
    from prefect.client.orchestration import get_client

    from flows.watchdog import watchdog

    mine = tmp_path / "mine"
    dep_id, old = _dead_deployment_run(str(tmp_path / "theirs"), mine, "victim")
    out = watchdog(store=str(mine), timeout_s=1.0, poll_s=0.2, duration_s=0.5)
    kinds = [d["kind"] for d in out["decisions"]]
    assert kinds == ["run-dead", "resume-failed"], out["decisions"]
    assert "not the run this watchdog found dead" in out["decisions"][1]["reason"]
    with get_client(sync_client=True) as c:
        assert [r.id for r in c.read_flow_runs() if r.deployment_id == dep_id] == [old.id]  # nothing started
        assert not c.read_flow_run(old.id).state.is_crashed()  # and the other store's flow run left alone


@pytest.mark.prefect
def test_ckpt_watchdog_in_the_foreground_fences_a_silent_shard_of_any_run_under_the_root(prefect_harness, tmp_path):
    from typer.testing import CliRunner

    from ckpt.cli import app

    _beat(Store.from_url(str(tmp_path / "run-a")), "shard-0", t=time.time() - 60)
    _beat(Store.from_url(str(tmp_path / "run-b")), "shard-0", t=time.time())  # alive
    res = CliRunner().invoke(app, ["watchdog", str(tmp_path), "--timeout", "5", "--poll", "0.2", "--duration", "1",
                                   "--no-rerun", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert [(d["kind"], d["run"], d["generation"]) for d in summary["decisions"]] == [("fenced", "run-a", 1)]
    assert sorted(r.rsplit("/", 1)[-1] for r in summary["runs"]) == ["run-a", "run-b"]
    assert commit.live_generation(Store.from_url(str(tmp_path / "run-b")), "shard-0") == 0


# --- nothing the store names is ever imported or run -------------------------------------------------

EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")

def build(config, shard, num_shards):
    pathlib.Path({marker!r}).write_text("called")
"""


class DoomedRun(threading.Thread):
    """A run whose committed step 0, live coordinator (its beat naming ``workload``, renewed every
    0.2 s) and silent shard-0 invite a watchdog to rerun the shard."""

    def __init__(self, store: Store, workload: str, *, setup: bool = True):
        import torch

        super().__init__(daemon=True)
        self.store, self.halt = store, threading.Event()
        self.t0 = time.time()
        cut = {"step": 0, "committed": True, "generations": {}}
        spec = {"workload": workload, "shards": 1, "steps_per_round": 4}
        self.meta = {"run_id": "x", "spec": spec, "phase": "shards", "phase_time": self.t0, "source": cut, "cut": cut}
        if setup:
            with Checkpointer(store) as ck:
                ck.write_fragment(0, "shard-0", {"model": {"w": torch.zeros(2)}, "round": 0})
                ck.write_fragment(0, "coordinator", {"model": {"w": torch.zeros(2)}, "round": 0})
                ck.commit(0, ["coordinator", "shard-0"], timeout=10)
            _beat(store, "shard-0", t=self.t0 - 60, round=1, meta={"source": cut, "spec": spec, "cut": cut})
        self.beat()

    def beat(self):
        _beat(self.store, "coordinator", t=time.time(), round=1, step=1, started=self.t0 - 100, meta=self.meta)

    def run(self):
        while not self.halt.wait(0.2):
            self.beat()


@pytest.mark.prefect
def test_the_watchdog_never_imports_or_runs_a_workload_the_store_names(prefect_harness, tmp_path, monkeypatch, capfd):
    """Heartbeats naming ``builtins:print`` and a module with a side effect: refused and reported,
    never imported; the operator's allow-list is the only way in."""
    from flows.watchdog import watchdog

    marker = tmp_path / "marker"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "evil_workload.py").write_text(EVIL.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))  # importable: a refusal is not an import error
    root = tmp_path / "runs"
    runs = [DoomedRun(Store.from_url(str(root / "printer")), "builtins:print"),
            DoomedRun(Store.from_url(str(root / "evil")), "evil_workload:build")]
    for r in runs:
        r.start()
    try:
        out = watchdog(store=str(root), timeout_s=2.0, poll_s=0.2, duration_s=1.0, resume=False)
    finally:
        for r in runs:
            r.halt.set()
    refused = {d["run"]: d for d in out["decisions"] if d["kind"] == "cannot-rerun"}
    assert set(refused) == {"printer", "evil"}, out["decisions"]
    assert "'builtins:print'" in refused["printer"]["reason"] and "not imported" in refused["printer"]["reason"]
    assert "--allow-workload evil_workload:build" in refused["evil"]["reason"]
    assert not marker.exists() and "evil_workload" not in sys.modules
    assert "WorkloadConfig(" not in capfd.readouterr().out  # print was never called with a config
    assert commit.live_generation(Store.from_url(str(root / "evil")), "shard-0") == 0  # nothing fenced either
    # named by the operator, the same workload is obeyed: fenced, rerun, imported (and it fails: not a workload)
    runs[1] = DoomedRun(Store.from_url(str(root / "evil")), "evil_workload:build", setup=False)
    runs[1].start()
    try:
        out = watchdog(store=str(root), run_id="evil", timeout_s=2.0, poll_s=0.2, duration_s=1.0, resume=False,
                       allow_workloads=["evil_workload:build"])
    finally:
        runs[1].halt.set()
    assert [d["kind"] for d in out["decisions"]][:1] == ["fenced"], out["decisions"]
    assert marker.exists()
