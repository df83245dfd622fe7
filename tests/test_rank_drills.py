"""`--ranks-per-shard 2` in real training runs (Prefect, the watchdog beside them, 2 shards of 2
gloo ranks each = 4 rank processes per round): a clean run, a SIGKILL of one rank and a hang of
one rank end on the clean run's digests; a resume with one rank per shard continues."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ckpt.cli import app
from ckpt.cmd_watchdog import status_of
from ckptlib import Checkpointer
from ckptlib.distributed import GroupFragment
from tests.drills import check_run, fenced, params, train_with_watchdog
from tests.runs import cli_env, digests, worker_env
from trainrun.layout import COORDINATOR
from trainrun.resume import stored_config
from trainrun.spec import RunSpec

R2 = {"ranks_per_shard": 2, "rounds": 2, "steps_per_round": 8}
# A group's beats are rank 0's, among 4 rank processes on 2 busy cores: the drills keep twice the
# 2 s the threads' drills use (tests/drills.py).
TIMEOUT = 4.0


@pytest.fixture(scope="module")
def clean_r2(prefect_harness, clean_digests):
    """The reference digests, by plain calls (a group of 2 ranks per shard). That the watchdog raises
    no false alarm while a clean run's groups start is test_fences_and_validation's first test."""
    spec = params(**R2)
    return clean_digests(RunSpec(**{k: getattr(spec, k) for k in RunSpec.model_fields}), R2["rounds"])


@pytest.mark.prefect
@pytest.mark.slow
def test_a_killed_rank_and_a_hung_rank_reach_the_clean_digest_and_a_resume_with_one_rank_continues(clean_r2, tmp_path):
    # the groups checkpoint every 3 steps (a collective write): each recovery continues from one
    p = params(store=str(tmp_path), run_id="kh", **R2, shard_checkpoint_every=3,
               chaos=["kill:shard=1,round=1,rank=1", "hang:shard=0,round=2,rank=1"])
    s, ds = train_with_watchdog(p, timeout_s=TIMEOUT)
    rows = {(r["shard"], r["round"]): r for r in s["recoveries"]}
    assert sorted(rows) == [(0, 2), (1, 1)], s["recoveries"]
    # the hung rank: its group went silent, the watchdog's rerun continued from the fence's checkpoint
    assert rows[(0, 2)]["kind"] == "silent" and rows[(0, 2)]["resumed_at_step"] == 3, rows
    # the killed rank: its group failed (a crash to Prefect, which retried it); a kill -9 may take the
    # checkpoint still being written with it: fewer than 2N steps recomputed
    assert rows[(1, 1)]["kind"] == "crash" and rows[(1, 1)]["steps_recomputed"] < 6, rows
    # the kill: rank 1's process died, its group failed at its next collective, Prefect retried the
    # task (a fresh group); the hang: rank 0 waited in its all-reduce, the group's beats stopped, the
    # watchdog fenced shard-0 and reran it, the fenced group's four processes were ended
    check_run(s["run_url"], None, clean_r2, struck={"shard-0": 2})
    hang = fenced(ds, "shard-0")
    assert hang["detection_latency_s"] >= TIMEOUT
    assert not [d for d in ds if d["part"] == "shard-1" and d["kind"] == "fenced"], ds  # the retry was enough
    with Checkpointer(s["run_url"]) as ck:
        assert ck.manifest(1).parts["shard-1"].generation == 0 and ck.manifest(2).parts["shard-0"].generation == 1
        assert stored_config(ck, 2)["ranks_per_shard"] == 2
    # `ckpt show` of a step whose shards are groups (it raised AttributeError: no skeleton) and `ckpt verify`
    for args in (["show", s["run_url"], "--step", "2"], ["verify", s["run_url"], "--step", "2"]):
        out = CliRunner().invoke(app, args)
        assert out.exit_code == 0, out.output
    assert "shard-0: generation 1, 2 ranks" in CliRunner().invoke(app, ["show", s["run_url"], "--step", "2"]).output
    runs = status_of(str(tmp_path))  # `ckpt status --json`: a row per rank, with its part and rank
    ranks = [[(k["part"], k["rank"], k["status"]) for k in p["ranks"]] for p in runs[0]["parts"]]
    assert ranks == [[(part, 0, "finished"), (part, 1, "finished")] for part in ("shard-0", "shard-1")]
    # resize: one process per shard from the last healthy step on, as `ckpt train` is told (a form
    # cannot say 1: a value equal to the default reads as not given, and a resume keeps the run's)
    cmd = [sys.executable, "-m", "ckpt", "train", "--store", str(tmp_path), "--run-id", "kh", "--resume",
           "--ranks-per-shard", "1", "--rounds", "3", "--no-watchdog", "--validation-runner", "threads"]
    p2 = subprocess.run(cmd, env=cli_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    with Checkpointer(s["run_url"]) as ck:
        assert ck.steps()[-1] == 3 and digests(s["run_url"])[2] == clean_r2[2]
        assert "ranks_per_shard" not in stored_config(ck, 3)
        assert ck.read_fragment(3, COORDINATOR, select=["round"])["round"] == 3
        assert not isinstance(ck.fragment(3, "shard-0"), GroupFragment)  # one process wrote it


@pytest.mark.prefect
@pytest.mark.slow  # over 60 s on CI: a clean FSDP run (its no-false-alarm check), the drilled run, a resume
def test_fsdp_groups_with_a_killed_rank_and_a_hung_rank_reach_the_clean_fsdp_digest_and_resume_as_ddp(
        prefect_harness, tmp_path):
    """`--parallelism fsdp`: each shard's 2 ranks hold half of every parameter and moment. The kill
    and the hang of one rank (as above) end on the clean FSDP run's digest at every step; a resume
    with --parallelism ddp continues from the FSDP shards (read whole, sharded no more)."""
    fsdp = {**R2, "parallelism": "fsdp"}
    clean, decisions = train_with_watchdog(params(store=str(tmp_path / "clean"), run_id="clean", **fsdp), timeout_s=30)
    assert decisions == [], decisions
    clean_digests = digests(clean["run_url"])
    p = params(store=str(tmp_path / "kh"), run_id="kh", **fsdp,
               chaos=["kill:shard=1,round=1,rank=1", "hang:shard=0,round=2,rank=1"])
    s, ds = train_with_watchdog(p, timeout_s=TIMEOUT)
    check_run(s["run_url"], None, clean_digests, struck={"shard-0": 2})
    fenced(ds, "shard-0")
    with Checkpointer(s["run_url"]) as ck:
        assert stored_config(ck, 2)["parallelism"] == "fsdp"
        assert isinstance(ck.fragment(2, "shard-0"), GroupFragment)
    cmd = [sys.executable, "-m", "ckpt", "train", "--store", str(tmp_path / "kh"), "--run-id", "kh", "--resume",
           "--parallelism", "ddp", "--rounds", "3", "--no-watchdog", "--validation-runner", "threads"]
    p2 = subprocess.run(cmd, env=cli_env(tmp_path / "kh"), capture_output=True, text=True, timeout=600)
    assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
    with Checkpointer(s["run_url"]) as ck:
        assert ck.steps()[-1] == 3 and "parallelism" not in stored_config(ck, 3)
        assert stored_config(ck, 3)["ranks_per_shard"] == 2


@pytest.mark.prefect
@pytest.mark.slow
def test_groups_in_dask_worker_processes_survive_a_killed_rank_and_reach_the_clean_digest(clean_r2, tmp_path):
    """`--task-runner dask --ranks-per-shard 2`: each shard task runs in a Dask worker process, which
    starts and supervises its group's 2 rank processes; a kill -9 of one rank fails the group, the
    task's retry (in a worker process again) continues from the group's shard checkpoint."""
    p = params(store=str(tmp_path), run_id="dask", task_runner="dask", **R2, shard_checkpoint_every=3,
               chaos=["kill:shard=1,round=1,rank=1"])
    s, ds = train_with_watchdog(p, timeout_s=TIMEOUT)
    check_run(s["run_url"], None, clean_r2)
    rows = {(r["shard"], r["round"]): r for r in s["recoveries"]}
    assert sorted(rows) == [(1, 1)] and rows[(1, 1)]["kind"] == "crash", s["recoveries"]
    assert rows[(1, 1)]["steps_recomputed"] < 6, rows  # from a checkpoint of the group, not the cut
    assert not [d for d in ds if d["kind"] == "fenced"], ds  # Prefect's retry was enough
    assert _rank_rows(tmp_path) == [(part, r, "finished") for part in ("shard-0", "shard-1") for r in (0, 1)]


@pytest.mark.prefect
@pytest.mark.slow  # over 60 s on CI: every shard round is a fresh flow-run process that starts 2 rank processes
def test_groups_as_flow_runs_of_a_work_pool_reach_the_clean_digest(clean_r2, tmp_path):
    """`--task-runner pool:train-shard/<name> --ranks-per-shard 2`: each shard's round is a flow run a
    Prefect worker starts in a fresh process, which starts its group's 2 rank processes."""
    from deployments.shard_pool import PrefectWorkers, deploy_shard_flow

    runner = deploy_shard_flow("test-rank-shards", name="ranks")
    with PrefectWorkers.start(tmp_path / "workers", "test-rank-shards", workers=1, limit=2, env=worker_env({})):
        s, ds = train_with_watchdog(params(store=str(tmp_path), run_id="pool", task_runner=runner, **R2,
                                           validate_checkpoints=False), timeout_s=30)
    assert s["final_digest"] == clean_r2[2] and digests(s["run_url"]) == clean_r2, (s["final_digest"], clean_r2)
    assert not [d for d in ds if d["kind"] == "fenced"], ds
    with Checkpointer(s["run_url"]) as ck:
        assert isinstance(ck.fragment(2, "shard-0"), GroupFragment)
    assert _rank_rows(tmp_path) == [(part, r, "finished") for part in ("shard-0", "shard-1") for r in (0, 1)]


def _rank_rows(root) -> list[tuple[str, int, str]]:
    """`ckpt status --json`'s rank rows of the one run under ``root``: (part, rank, status)."""
    return [(k["part"], k["rank"], k["status"]) for part in status_of(str(root))[0]["parts"] for k in part["ranks"]]
