"""A shard trained by a group of rank processes (--ranks-per-shard): real gloo groups of real
processes on CPU, real SIGKILLs, real fences (trainrun.rank_group, trainrun.rank_round)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ckptlib import Checkpointer, FencedError, commit
from ckptlib.distributed import GroupFragment
from ckptlib.heartbeat import read_rank_heartbeats
from tests.runs import rank_spec as spec
from tests.runs import step_zero
from trainrun import rank_group
from trainrun.chaos import check_runner, parse_chaos, read_strike
from trainrun.documents import Cut
from trainrun.errors import RankGroupFailed, RankGroupRefused
from trainrun.rank_group import end_groups, train_shard_group
from trainrun.recovery import read_recoveries
from trainrun.spec import RunSpec


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_ranks_per_shard_1_keeps_the_config_and_its_hash():
    one = RunSpec(shards=2)
    assert "ranks_per_shard" not in one.to_dict()
    assert RunSpec.from_dict(one.to_dict()).ranks_per_shard == 1
    two = RunSpec(shards=2, ranks_per_shard=2)
    assert two.to_dict()["ranks_per_shard"] == 2 and two.config_hash() != one.config_hash()


def test_chaos_addresses_one_rank_and_a_rank_process_may_be_killed_under_threads():
    c = parse_chaos("kill:shard=1,round=2,rank=1")
    assert (c.rank, str(c)) == (1, "kill:shard=1,round=2,rank=1")
    assert c.strikes(1, 2, 1, rank=1) and not c.strikes(1, 2, 1, rank=0)
    check_runner(["kill:shard=1,round=2,rank=1"], "threads", ranks_per_shard=2)
    with pytest.raises(ValueError, match="threads"):
        check_runner(["kill:shard=1,round=2"], "threads")
    with pytest.raises(ValueError, match="names a rank the shard's group does not have"):
        check_runner(["hang:shard=1,round=2,rank=2"], "threads", ranks_per_shard=2)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Round 1 of shard 0 by a clean group of 2 ranks, and its store."""
    s = spec()
    ck = step_zero(str(tmp_path_factory.mktemp("clean")), s)
    return ck, train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), heartbeat_every_s=0.2)


@pytest.mark.slow
def test_a_group_of_two_ranks_writes_the_shards_fragment_and_every_rank_beats(clean):
    ck, result = clean
    assert result.finished and result.data_position == 6 and result.seconds["group"] > 0
    frag = ck.gather(1, ["shard-0"], timeout=5)["shard-0"][0]
    assert isinstance(frag, GroupFragment) and frag.world == 2 and frag.digest == result.digest
    state = ck.read_fragment(1, "shard-0")
    assert state["data_position"] == 6 and state["loss"] == result.loss
    beats = read_rank_heartbeats(ck.store, "shard-0")
    assert sorted(beats) == [0, 1] and {b.status for b in beats.values()} == {"finished"}
    assert beats[0].pid != beats[1].pid and {b.rank for b in beats.values()} == {0, 1}
    # (the same round by a fresh group in another store gives the same fragment, bit for bit: every
    # retry below that writes the clean fragment checks that, so it is not run a second time here)


def reapable(pid: int) -> bool:
    """Whether a killed process is gone or a zombie its parent can reap: a many-threaded process's
    leader shows as a zombie while its other threads still exit, and ``waitpid`` waits for those."""
    try:
        return alive(pid) is False and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def rank_pids(ck: Checkpointer) -> dict[int, int | None]:
    return {r: b.pid for r, b in read_rank_heartbeats(ck.store, "shard-0").items()}


@pytest.mark.slow
def test_a_warm_group_trains_again_in_the_same_processes_on_a_fresh_groups_bits_and_a_failed_one_is_not_kept(
        clean, tmp_path, monkeypatch):
    """``warm=True`` (the shard task's): the group that finished a round waits for the next in the
    same rank processes, which train it on the bits of a fresh group; a group that failed is ended,
    never kept; ``end_groups`` ends the warm ones, and ranks nobody sends a job end themselves."""
    s, clean = spec(), clean[1]
    ck = step_zero(str(tmp_path / "w"), s)
    first = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), heartbeat_every_s=0.2, warm=True)
    pids = rank_pids(ck)
    again = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=2, heartbeat_every_s=0.2, warm=True)
    assert rank_pids(ck) == pids and all(alive(p) for p in pids.values() if p)  # the same processes
    assert (first.loss, again.loss, again.data_position) == (clean.loss, clean.loss, 6)
    assert again.seconds["group"] < first.seconds["group"]  # no processes to start, no rendezvous
    with pytest.raises(RankGroupFailed, match="rank 1 of its group of 2 exited with 1"):
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=3, heartbeat_every_s=0.2, warm=True,
                          chaos=["crash:shard=0,round=1,rank=1,attempt=3,step=2"])
    assert not any(alive(p) for p in pids.values() if p)  # the failed group was ended, not kept
    fresh = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=4, heartbeat_every_s=0.2, warm=True)
    assert fresh.loss == clean.loss and not set(rank_pids(ck).values()) & set(pids.values())
    pids = rank_pids(ck)
    os.kill(pids[1], signal.SIGKILL)  # a warm rank dies between two rounds: the next starts a fresh group
    deadline = time.monotonic() + 10
    while not reapable(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    replaced = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=5, heartbeat_every_s=0.2, warm=True)
    assert replaced.loss == clean.loss and not set(rank_pids(ck).values()) & set(pids.values())
    assert not any(alive(p) for p in pids.values() if p)
    pids = rank_pids(ck)
    assert end_groups(ck.url) == 1 and not any(alive(p) for p in pids.values() if p)
    monkeypatch.setattr(rank_group, "IDLE_S", 0.5)  # a supervisor that forgets its group
    train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=6, heartbeat_every_s=0.2, warm=True)
    pids, deadline = rank_pids(ck), time.monotonic() + 20
    while any(alive(p) for p in pids.values() if p) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids.values() if p)  # its ranks ended themselves
    end_groups(ck.url)


@pytest.mark.slow
def test_ranks_are_forked_by_one_launcher_that_ignores_sigterm_and_is_replaced_once_killed(clean, tmp_path):
    """Every fresh group's ranks are forked by this process's one launcher (torch imported once:
    trainrun.rank_launcher), whatever the run; the launcher ignores SIGTERM (a preemption signalled
    to a whole process group is for the ranks, which checkpoint); killed, it takes its ranks with it,
    which read as killed, and the next group starts a new launcher and trains the clean fragment."""
    import psutil

    s, clean = spec(), clean[1]
    launchers = set()
    for name in ("a", "b"):
        ck = step_zero(str(tmp_path / name), s)
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), heartbeat_every_s=0.2, warm=True)
        ranks = [psutil.Process(p) for p in rank_pids(ck).values() if p]
        assert len(ranks) == 2
        launchers |= {r.ppid() for r in ranks}
        assert all("trainrun.rank_round" not in " ".join(r.cmdline()) for r in ranks)  # not started apart
    [launcher_pid] = launchers  # one launcher for both groups
    launcher = psutil.Process(launcher_pid)
    assert launcher.ppid() == os.getpid() and "trainrun.rank_launcher" in launcher.cmdline()
    group = rank_group._WARM[rank_group.group_key(ck, "shard-0", s, rank_group.GROUP_TIMEOUT_S)]
    launcher.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert launcher.is_running() and all(r.process.poll() is None for r in group.ranks)
    launcher.kill()
    assert sorted(r.process.wait(timeout=20) for r in group.ranks) == [-signal.SIGKILL] * 2
    assert not any(alive(r.process.pid) for r in group.ranks)
    again = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=2, heartbeat_every_s=0.2, warm=True)
    assert again.loss == clean.loss and again.digest == clean.digest
    assert {psutil.Process(p).ppid() for p in rank_pids(ck).values() if p} - {launcher_pid}  # a new launcher
    assert end_groups() == 2


def test_a_launcher_that_cannot_start_says_why_and_leaves_nothing_running(tmp_path, monkeypatch):
    """A launcher whose interpreter cannot import the project ends at once: one LauncherError that
    says so, and no process of it is left."""
    import subprocess

    from trainrun.errors import LauncherError
    from trainrun.rank_launcher import RankLauncher

    (tmp_path / "trainrun").mkdir()  # a package of that name ahead of the project on the path
    (tmp_path / "trainrun" / "__init__.py").write_text("raise ImportError('not this one')\n")
    def launchers() -> set[int]:  # this process's (an earlier test's working one among them)
        out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "trainrun.rank_launcher"], capture_output=True,
                             text=True).stdout.split()
        return {int(p) for p in out if alive(int(p))}

    before = launchers()
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    monkeypatch.chdir(tmp_path)  # `python -m` looks in the working folder first
    with pytest.raises(LauncherError, match="the rank launcher .* ended") as e:
        RankLauncher(env)
    assert "stderr says why" in str(e.value)
    assert launchers() <= before


@pytest.mark.slow
def test_ranks_start_as_their_own_processes_when_the_launcher_fails(clean, tmp_path, monkeypatch, caplog):
    """Where the launcher cannot start, a group's ranks start as ``python -m trainrun.rank_round``
    (with one warning) and train the clean fragment."""
    import psutil

    from trainrun.errors import LauncherError

    def broken(env, stderr_fd):
        raise LauncherError("the rank launcher ended (test)")

    monkeypatch.setattr(rank_group, "launch_rank", broken)
    monkeypatch.setattr(rank_group, "_LAUNCHER_BROKEN", False)
    s, clean = spec(), clean[1]
    ck = step_zero(str(tmp_path / "p"), s)
    with caplog.at_level("WARNING", logger="trainrun.rank_group"):
        result = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), heartbeat_every_s=0.2, warm=True)
    assert result.digest == clean.digest
    ranks = [psutil.Process(p) for p in rank_pids(ck).values() if p]
    assert all(r.ppid() == os.getpid() and "trainrun.rank_round" in " ".join(r.cmdline()) for r in ranks)
    assert sum("start as their own processes" in r.message for r in caplog.records) == 1
    assert end_groups(ck.url) == 1


@pytest.mark.slow
def test_a_killed_rank_fails_its_group_whose_other_ranks_end_and_a_retry_writes_the_clean_fragment(clean, tmp_path):
    s, clean = spec(), clean[1]
    ck = step_zero(str(tmp_path / "k"), s)
    with pytest.raises(RankGroupFailed, match=r"shard-0: rank 1 of its group of 2 was killed by signal 9"):
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), chaos=["kill:shard=0,round=1,rank=1,step=3"],
                          heartbeat_every_s=0.2)
    beats = read_rank_heartbeats(ck.store, "shard-0")
    assert read_strike(ck.store, "shard-0", 1, 1).pid == beats[1].pid
    assert not any(alive(b.pid) for b in beats.values() if b.pid)  # no rank of the failed group lives on
    retry = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=2,
                              chaos=["kill:shard=0,round=1,rank=1,step=3"])
    assert retry.digest == clean.digest


@pytest.mark.slow
def test_a_killed_rank_0_leaves_the_shards_beat_failed_and_its_retry_recovers_from_a_crash(clean, tmp_path):
    """Rank 0 beats as the shard; killed, it cannot write its final beat, so the supervisor writes
    every rank's: the retry's row is a crash (Prefect's retry of a task that raised), not a process
    that died, and a watchdog does not judge the beat of a dead group silent while the retry starts."""
    s, clean = spec(), clean[1]
    ck = step_zero(str(tmp_path / "k0"), s)
    chaos = ["kill:shard=0,round=1,rank=0,step=3"]
    with pytest.raises(RankGroupFailed, match=r"shard-0: rank 0 of its group of 2 was killed by signal 9"):
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), chaos=chaos, heartbeat_every_s=0.2)
    beats = read_rank_heartbeats(ck.store, "shard-0")
    assert {r: (b.status, b.attempt) for r, b in beats.items()} == {0: ("failed", 1), 1: ("failed", 1)}, beats
    assert "rank 0 of its group of 2 was killed by signal 9" in (beats[0].error or ""), beats[0]
    assert beats[0].time >= read_strike(ck.store, "shard-0", 1, 1).time
    retry = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=2, chaos=chaos)
    assert retry.digest == clean.digest
    [row] = read_recoveries(ck.store, 1)
    assert (row.kind, row.cause, row.failed_at_step, row.attempt) == ("crash", "kill", 3, 2), row


@pytest.mark.slow
def test_a_groups_retry_continues_from_its_shard_checkpoint_and_writes_the_clean_fragment(clean, tmp_path):
    """Shard checkpoints of a group (every 2 steps, a collective write): rank 1 crashes at step 5, and
    the retry's fresh group continues from step 4, not from the cut, to the clean fragment."""
    s, clean = spec(), clean[1]
    ck = step_zero(str(tmp_path / "c"), s)
    chaos = ["crash:shard=0,round=1,rank=1,step=5"]
    with pytest.raises(RankGroupFailed, match="rank 1 of its group of 2 exited with 1"):
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), chaos=chaos, heartbeat_every_s=0.2, checkpoint_every=2)
    keys = commit.substep_keys(ck.store, 1, "shard-0", 0)
    assert sorted(keys) == [2, 4]  # the crashed rank waited for the write in flight (never at the last step)
    frag = commit.read_fragment(ck.store, keys[4])[0]
    assert isinstance(frag, GroupFragment) and frag.world == 2 and frag.meta["substep"] == 4
    retry = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=2, chaos=chaos, checkpoint_every=2)
    assert (retry.resumed_at_step, retry.start_source) == (4, "store")
    assert retry.digest == clean.digest and retry.loss == clean.loss
    [row] = read_recoveries(ck.store, 1)  # rank 0 of the retry said what the failure cost
    assert (row.kind, row.resumed_at_step, row.steps_recomputed) == ("crash", 4, 1), row
    # a group whose checkpoint does not check out (another cut) starts from the cut, every rank alike
    ck.store.put(keys[4], ck.store.get(keys[2]))  # step 2's fragment under step 4's key
    again = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=3, checkpoint_every=2)
    assert again.start_source == "cut" and again.digest == clean.digest


@pytest.mark.slow
def test_a_groups_auto_checkpoints_follow_the_time_rule_at_steps_its_ranks_agree_on(tmp_path, monkeypatch):
    """``auto`` in a group: the ranks agree on each checkpoint's step (a collective write at a step
    only one rank chose would wait out the group's timeout), by the time rule, not a fixed count: a
    tiny state (a write costs its floor, 10 ms: one every 0.5 s of training) and steps of >= 0.1 s
    take the first within 5 steps, where a fixed count of 50 took none in a 12-step round. Rank 1
    crashes at step 11; the retry continues from the newest and ends on the clean trajectory."""
    monkeypatch.setenv("PYTHONPATH", f"{os.path.dirname(__file__)}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    s = spec(workload="slow_steps:build", steps_per_round=12)
    ref = train_shard_group(step_zero(str(tmp_path / "ref"), s), None, s, 0, 1, Cut.of_step(0), checkpoint_every=0)
    monkeypatch.setenv("CKPT_TEST_STEP_SLEEP", "0.1")  # read by the ranks started from here on
    ck = step_zero(str(tmp_path / "a"), s)
    chaos = ["crash:shard=0,round=1,rank=1,step=11"]
    with pytest.raises(RankGroupFailed, match="rank 1 of its group of 2 exited with 1"):
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), chaos=chaos, heartbeat_every_s=0.2, checkpoint_every="auto")
    keys = commit.substep_keys(ck.store, 1, "shard-0", 0)
    assert keys and min(keys) <= 5 and max(keys) <= 10, sorted(keys)
    for k, key in keys.items():  # each one the whole group's: both ranks wrote at that step
        frag = commit.read_fragment(ck.store, key)[0]
        assert isinstance(frag, GroupFragment) and frag.world == 2 and frag.meta["substep"] == k
    retry = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=2, chaos=chaos, checkpoint_every="auto")
    assert (retry.resumed_at_step, retry.start_source) == (max(keys), "store")
    assert (retry.digest, retry.loss) == (ref.digest, ref.loss)  # the sleep is outside the trajectory
    [row] = read_recoveries(ck.store, 1)
    assert (row.kind, row.steps_recomputed) == ("crash", 11 - max(keys)), row


@pytest.mark.slow
def test_a_groups_retry_reads_its_ranks_local_copies_and_damaged_copies_fall_back_to_the_store(clean, tmp_path):
    """With a local tier each rank keeps the units it stored of the group's shard checkpoints
    (``<part>#r<rank>``): a retry on this host continues from them ("local"); copies that do not
    check out are noticed and the store read instead ("store"); a finished round leaves no copy."""
    from trainrun.local_tier import LocalTier

    s, clean = spec(), clean[1]
    ck = step_zero(str(tmp_path / "t"), s)
    tier = LocalTier(ck.url, tmp_path / "tier")
    chaos = ["crash:shard=0,round=1,rank=1,step=5", "crash:shard=0,round=1,rank=0,step=5,attempt=2"]
    for attempt in (1, 2):
        with pytest.raises(RankGroupFailed, match="exited with 1"):
            train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=attempt, chaos=chaos, heartbeat_every_s=0.2,
                              checkpoint_every=2, local_tier=tier)
        copies = sorted(tier.dir.glob("*.bin"))
        assert [p.name for p in copies] == ["shard-0#r0.g0.bin", "shard-0#r1.g0.bin"], copies
    for path in copies:  # the last byte of each copy's last unit
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    done = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=3, chaos=chaos, checkpoint_every=2,
                             local_tier=tier)
    assert (done.resumed_at_step, done.start_source) == (4, "store")
    assert done.digest == clean.digest and done.loss == clean.loss
    rows = read_recoveries(ck.store, 1)
    assert [(r.attempt, r.resumed_at_step, r.source) for r in rows] == [(2, 4, "local"), (3, 4, "store")], rows
    assert not list(tier.root.glob("*/*.bin"))  # the round is written: its copies are gone


def fence_the_hung_group(ck: Checkpointer, s: RunSpec, *, heartbeat_every_s: float, kill: bool = False) -> FencedError:
    """Train shard-1's round 1 with its rank 1 hung at step 2; fence the part once the hang struck
    (and with ``kill``, SIGKILL the hung rank right after, as a watchdog ends a fenced group):
    the FencedError the group raised."""
    def fence() -> None:
        deadline = time.monotonic() + 120
        while (strike := read_strike(ck.store, "shard-1", 1, 1)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        ck.fence("shard-1", 1, reason="test: rank 1 hangs", by="test")
        if kill and strike is not None:
            os.kill(strike.pid, signal.SIGKILL)

    th = threading.Thread(target=fence)
    th.start()
    try:
        with pytest.raises(FencedError) as err:
            train_shard_group(ck, None, s, 1, 1, Cut.of_step(0), chaos=["hang:shard=1,round=1,rank=1,step=2"],
                              heartbeat_every_s=heartbeat_every_s)
    finally:
        th.join()
    return err.value


@pytest.mark.slow
def test_a_fenced_group_ends_every_rank_and_its_fragment_is_never_gathered(tmp_path):
    s = spec(steps_per_round=6)
    ck = step_zero(str(tmp_path / "f"), s)
    err = fence_the_hung_group(ck, s, heartbeat_every_s=0.2)
    assert "every rank of the group was ended" in str(err)
    beats = read_rank_heartbeats(ck.store, "shard-1")
    assert sorted(beats) == [0, 1] and not any(alive(b.pid) for b in beats.values() if b.pid)
    assert ck.store.list("fragments/1") == []  # the fenced group wrote nothing
    live = train_shard_group(ck, None, s, 1, 1, Cut.of_step(0), attempt=2)
    assert live.generation == 1
    assert ck.gather(1, ["shard-1"], timeout=5)["shard-1"][0].generation == 1


def test_a_group_fenced_and_then_killed_is_fenced_whichever_rank_exits_first(tmp_path):
    """The watchdog fences a hung group, then ends its processes: a rank may exit first (killed, or
    its collective's connection closed) before the supervisor's next look at the fence. The group
    was fenced all the same: FencedError (the task run ends Fenced, no retry), never RankGroupFailed,
    whose retry would train the new generation beside the watchdog's rerun (a CI run saw it: the
    recovery row said ``process-died`` where the watchdog had found the group silent)."""
    s = spec(steps_per_round=6)
    ck = step_zero(str(tmp_path / "fk"), s)
    fence_the_hung_group(ck, s, heartbeat_every_s=30, kill=True)  # 30 s: the kill comes between two looks
    beats = read_rank_heartbeats(ck.store, "shard-1")
    assert not any(alive(b.pid) for b in beats.values() if b.pid)
    assert ck.store.list("fragments/1") == []


def test_a_group_whose_rendezvous_fails_says_why(tmp_path, monkeypatch):
    import trainrun.rank_group as rank_group

    s = spec()
    ck = step_zero(str(tmp_path / "r"), s)
    # the group's rendezvous (its FileStore) cannot be made: its folder is gone
    monkeypatch.setattr(rank_group, "rendezvous_path", lambda workdir: workdir / "gone" / "rendezvous")
    with pytest.raises(RankGroupFailed, match=r"rendezvous failed: rank \d of 2 could not join .*No such file"):
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), group_timeout_s=20)


@pytest.mark.slow
def test_a_workload_that_cannot_be_split_over_ranks_is_refused_not_retried(tmp_path):
    s = spec(batch_size=5)
    ck = step_zero(str(tmp_path / "b"), s)
    with pytest.raises(RankGroupRefused, match="choose --batch-size a multiple of --ranks-per-shard"):
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0))
    assert isinstance(RankGroupRefused("x"), ValueError)  # tasks.retry: deterministic, never retried


def test_the_watchdog_finds_a_group_silent_when_one_of_its_ranks_is(tmp_path):
    """Rank 0 beats for the group; rank 1's beat is older than the timeout: the shard is silent,
    and the reason names the rank (beats as a group's ranks write them)."""
    import json

    from ckptlib.store import Store
    from trainrun.watchdog import assess_run

    store = Store.from_url(str(tmp_path))
    now = 1_000_000.0

    def beat(key: str, t: float, part: str, rank: int | None, **kw) -> None:
        doc = {"format": 1, "part": part, "generation": 0, "round": 2, "step": 5, "round_step": 5,
               "steps_per_round": 40, "status": "running", "time": t, "started": t - 1, "beats": 3, "host": "h",
               "pid": 1, "attempt": 1, "loss": None, "meta": {}, "rank": rank, **kw}
        store.put(key, json.dumps(doc).encode())

    meta = {"spec": {"shards": 2, "ranks_per_shard": 2}, "phase": "shards", "phase_time": now - 5, "cut": {"step": 1}}
    beat("heartbeats/coordinator.json", now - 0.5, "coordinator", None, meta=meta, started=now - 100)
    for part in ("shard-0", "shard-1"):
        beat(f"heartbeats/{part}.json", now - 0.2, part, 0)
    beat("heartbeats/ranks/shard-0/1.json", now - 0.3, "shard-0", 1)
    beat("heartbeats/ranks/shard-1/1.json", now - 9, "shard-1", 1)  # silent
    v = assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=now)
    assert [p.state for p in v.shards] == ["running", "silent"]
    assert v.shards[1].reason.startswith("no heartbeat for 9.0 s (timeout 4 s): rank 1 of shard-1")
    assert v.shards[1].failure_time == now - 9
    # a rank beat of an earlier attempt does not count against the live one
    beat("heartbeats/ranks/shard-1/1.json", now - 9, "shard-1", 1, attempt=0)
    assert [p.state for p in assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=now).shards] == \
        ["running", "running"]


@pytest.mark.slow
def test_a_resume_may_change_ranks_per_shard_from_the_last_healthy_step_only(tmp_path):
    from trainrun.checks import validate_run_checkpoint
    from trainrun.errors import RunRefused
    from trainrun.resume import where_to_start

    url = str(tmp_path / "run")
    step_zero(url, spec(2)).close()
    with Checkpointer(url) as ck:
        with pytest.raises(RunRefused, match=r"from 2 to 1 ranks per shard yet: its latest committed step 0 is not "
                                             r"validated .* resume once with --ranks-per-shard 2"):
            where_to_start(ck, spec(1), resume=True)
        with pytest.raises(RunRefused, match=r"ranks_per_shard: 2 -> 1"):  # not from a chosen step
            where_to_start(ck, spec(1), resume=True, from_step=0)
        assert validate_run_checkpoint(url, 0).passed
        plan = where_to_start(ck, spec(1), resume=True)
        assert plan.start_step == 0 and plan.reshard is None and "1 ranks per shard instead of 2" in plan.note
        assert where_to_start(ck, spec(2), resume=True).note == "resuming from healthy step 0"
        with pytest.raises(RunRefused, match=r"seed: 0 -> 1"):  # another trajectory field is still refused
            where_to_start(ck, spec(1, seed=1), resume=True)


@pytest.mark.slow
def test_the_ranks_of_a_shard_task_killed_outright_end_with_it(tmp_path):
    """kill -9 of the process that supervises a group (a shard task's): its ranks and their launcher
    are not left running (the kernel kills them: PR_SET_PDEATHSIG)."""
    import signal
    import subprocess
    import sys

    url = str(tmp_path / "run")
    s = spec(steps_per_round=100000)  # a round that would last hours
    step_zero(url, s).close()
    code = ("import sys; from ckptlib import Checkpointer; from trainrun.documents import Cut; "
            "from trainrun.rank_group import train_shard_group; from trainrun.spec import RunSpec; "
            f"train_shard_group(Checkpointer({url!r}), None, RunSpec.from_dict({s.to_dict()!r}), 0, 1, Cut.of_step(0), "
            "heartbeat_every_s=0.2)")
    supervisor = subprocess.Popen([sys.executable, "-c", code])
    store = Checkpointer(url).store
    deadline = time.monotonic() + 180
    beats: dict = {}
    while time.monotonic() < deadline:
        beats = read_rank_heartbeats(store, "shard-0")
        if len(beats) == 2 and all(b.round_step for b in beats.values()):
            break  # both ranks train
        time.sleep(0.2)
    assert len(beats) == 2, "the group never trained"
    import psutil

    launchers = {psutil.Process(b.pid).ppid() for b in beats.values() if b.pid}  # the ranks' launcher
    assert psutil.Process(*launchers).ppid() == supervisor.pid
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait()
    pids = [b.pid for b in beats.values() if b.pid] + list(launchers)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids)  # nor their launcher


def test_a_rank_still_loading_is_judged_by_the_start_timeout_though_rank_0_trains(tmp_path):
    """Rank 0 has built its part (FSDP2: it shards alone, then waits in its first all-gather) while
    rank 1 still loads the cut: rank 1 is starting, not silent, until the start timeout (it was
    judged by the 4 s timeout, and a clean FSDP run was fenced three times)."""
    import json

    from ckptlib.store import Store
    from trainrun.watchdog import assess_run

    store = Store.from_url(str(tmp_path))
    now = 1_000_000.0

    def beat(key: str, t: float, part: str, rank: int | None, round_step: int | None, **kw) -> None:
        doc = {"format": 1, "part": part, "generation": 0, "round": 1, "step": 0, "round_step": round_step,
               "steps_per_round": 40, "status": "running", "time": t, "started": t - 1, "beats": 3, "host": "h",
               "pid": 1, "attempt": 1, "loss": None, "meta": {}, "rank": rank, **kw}
        store.put(key, json.dumps(doc).encode())

    meta = {"spec": {"shards": 1, "ranks_per_shard": 2}, "phase": "shards", "phase_time": now - 5, "cut": {"step": 0}}
    beat("heartbeats/coordinator.json", now - 0.5, "coordinator", None, None, meta=meta, started=now - 100)
    beat("heartbeats/shard-0.json", now - 0.2, "shard-0", 0, 0)
    beat("heartbeats/ranks/shard-0/1.json", now - 9, "shard-0", 1, None)  # loading for 9 s
    v = assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=now)
    assert [p.state for p in v.shards] == ["running"], v.shards[0].reason
    beat("heartbeats/ranks/shard-0/1.json", now - 41, "shard-0", 1, None)  # past the start timeout
    v = assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=now)
    assert [p.state for p in v.shards] == ["silent"]
    assert v.shards[0].reason.startswith("no heartbeat for 41.0 s (start timeout 40 s): rank 1 of shard-0")
