"""The ``train-run`` flow for real: Prefect (one test server per session), real training (a tiny
tinylm), stores both local and on SeaweedFS S3, ``ckpt train`` subprocesses killed with SIGKILL.

Every run here uses the same tiny settings (``TINY``), so the clean run's digests (computed once per
session) are the reference for every other way of reaching the same steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptlib import Checkpointer
from tests.runs import cli_env, digests

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

EXTRA = {"d_model": 32, "n_layers": 1, "ctx": 16, "corpus_bytes": 65536}
TINY = {"workload": "tinylm", "workload_extra": EXTRA, "shards": 2, "rounds": 3, "steps_per_round": 4, "seed": 0,
        "heartbeat_every_s": 0.2, "retry_delay_s": 0.2, "validation_runner": "threads"}


def params(**kw):
    from flows.params import TrainParams

    return TrainParams(**{**TINY, **kw})


def cli_args(store: str, run_id: str, *more: str) -> list[str]:
    return [sys.executable, "-m", "ckpt", "train", "--store", store, "--run-id", run_id, "--shards", "2",
            "--rounds", str(TINY["rounds"]), "--steps-per-round", str(TINY["steps_per_round"]),
            "--workload-extra", json.dumps(EXTRA), *more]


@pytest.fixture(scope="session")
def clean(prefect_harness, tmp_path_factory):
    """The reference: one clean run on a local store."""
    from flows.train import train_run

    store = str(tmp_path_factory.mktemp("train-store"))
    summary = train_run(params(store=store, run_id="clean"))
    return {"store": store, "summary": summary, "digests": digests(summary["run_url"])}


def test_clean_run_commits_and_validates_every_round(clean):
    s = clean["summary"]
    url = s["run_url"]
    assert s["committed"] == [0, 1, 2, 3] == s["validated"] and s["failed_validation"] == []
    assert s["final_step"] == 3 and s["final_digest"] == clean["digests"][3]
    assert s["bytes_written"] > 0 and s["full_copy_bytes"] > 0
    assert all(c["validation"]["passed"] for c in s["checkpoints"])
    with Checkpointer(url) as ck:
        assert ck.healthy_steps() == [0, 1, 2, 3]
        assert ck.manifest(3).meta["run_id"] == "clean" and ck.manifest(3).meta["params"]["rounds"] == 3
    for i in range(2):
        beat = json.loads(Path(url, "heartbeats", f"shard-{i}.json").read_text())
        assert beat["status"] == "finished" and beat["round"] == 3 and beat["step"] == 12
        assert {"time", "host", "pid", "generation", "round_step"} <= set(beat)
    assert s["seconds"]["train"] > 0 and s["rounds_log"][0]["seconds"]["save"] > 0


def test_identical_run_on_s3_reaches_the_same_digest_at_every_step(clean, s3_url):
    from flows.train import train_run

    store, so = s3_url
    s = train_run(params(store=store, run_id="again", storage_options=so))
    assert digests(s["run_url"], so) == clean["digests"]
    with Checkpointer(s["run_url"], so) as ck:
        assert ck.healthy_steps() == [0, 1, 2, 3]


def test_crash_chaos_is_retried_and_reaches_the_clean_digest(clean, tmp_path):
    from flows.train import train_run

    s = train_run(params(store=str(tmp_path), run_id="chaos", chaos=["crash:shard=1,round=2"],
                         heartbeat_events=True))
    assert s["final_digest"] == clean["digests"][3]
    round2 = {x["shard"]: x for x in s["rounds_log"][1]["shards"]}
    assert round2[1]["attempt"] == 2 and round2[0]["attempt"] == 1


def test_resume_refuses_a_changed_config_and_an_existing_run_id(clean, monkeypatch):
    from typer.testing import CliRunner

    from ckpt.cli import app
    from flows.train import train_run
    from trainrun.errors import RunRefused

    base = ["train", "--store", clean["store"], "--run-id", "clean", "--rounds", "3",
            "--workload-extra", json.dumps(EXTRA)]
    r = CliRunner().invoke(app, base + ["--resume", "--steps-per-round", "5", "--seed", "1"])
    assert r.exit_code == 2, r.output
    assert "seed: 0 -> 1" in r.output and "steps_per_round: 4 -> 5" in r.output
    r = CliRunner().invoke(app, base + ["--steps-per-round", "4"])
    assert r.exit_code == 2 and "already has committed checkpoints" in r.output and "--resume" in r.output
    r = CliRunner().invoke(app, ["train", "--store", clean["store"], "--workload", "nosuchpkg.mod:build"])
    assert r.exit_code == 2 and "cannot import module 'nosuchpkg.mod'" in r.output
    # A resume takes the run's own trajectory: only the option typed again is checked (before: every
    # option left out fell back to its default and was refused), and before Prefect is even started.
    import flows.api

    def no_prefect(*a, **k):
        raise AssertionError("a refusal must not start or contact Prefect")

    monkeypatch.setattr(flows.api.PrefectAPI, "__init__", no_prefect)
    r = CliRunner().invoke(app, ["train", "--store", clean["store"], "--run-id", "clean", "--resume", "--seed", "1"])
    assert r.exit_code == 2 and "seed: 0 -> 1" in r.output and "steps_per_round" not in r.output, r.output
    monkeypatch.undo()
    # the flow itself refuses too (deployments); another shard count alone would reshard (test_reshard.py)
    with pytest.raises(RunRefused, match="seed: 0 -> 1"):
        train_run(params(store=clean["store"], run_id="clean", resume=True, shards=3, seed=1))
    assert digests(clean["summary"]["run_url"]) == clean["digests"]  # nothing was written


def test_kill_9_mid_run_then_resume_reaches_the_clean_digest(clean, tmp_path):
    """SIGKILL of the `ckpt train` process alone (not its group) after a commit (step 2 of 3): every process it
    started ends with it (its validation worker and multiprocessing's resource tracker lived on
    before). `ckpt train --resume --run-id R --store S` alone continues it (the trajectory and the
    rounds are the run's) to the clean digests, names the session it continues, and its watchdog
    does not take that dead predecessor for this run (before: "run killed is dead")."""
    import psutil

    store, env = str(tmp_path / "store"), cli_env(tmp_path)
    url = Path(store, "killed")
    proc = subprocess.Popen(cli_args(store, "killed"), env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    children: list = []
    try:
        deadline = time.monotonic() + 180
        while not (url / "manifests" / "2.json").exists() or not children:  # the resume trains round 3 only
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint committed in 180 s"
            children = psutil.Process(proc.pid).children(recursive=True)  # the validation worker, ...
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
    finally:  # what this test started, by pid: a failed check must not leave them running
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for p in children:
            try:
                p.kill()
            except psutil.Error:
                pass
    assert proc.returncode == -signal.SIGKILL
    assert not (url / "manifests" / "3.json").exists(), "the run finished before it could be killed"
    resume = [sys.executable, "-m", "ckpt", "train", "--resume", "--run-id", "killed", "--store", store,
              "--json", str(tmp_path / "summary.json"), "--validation-runner", "threads"]
    out = subprocess.run(resume, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"digest: {clean['digests'][3]}" in out.stdout.splitlines()
    assert digests(str(url)) == clean["digests"]
    with Checkpointer(str(url)) as ck:
        assert ck.healthy_steps()[-1] == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["predecessor"]["status"] == "running", summary["predecessor"]  # it died mid-run
    assert not [d for d in summary.get("watchdog", []) if d["kind"] == "run-dead"], summary["watchdog"]
    assert "is dead" not in out.stdout + out.stderr and "continues" in out.stdout, out.stdout[-2000:]


def test_a_diverging_run_fails_cleanly(clean, tmp_path):
    """`ckpt train --lr 1e30`: NaN losses (before: a 60-line traceback, "Out of range float values are
    not JSON compliant"). The checkpoints are committed with null metrics, validation fails them,
    the run ends Failed with one line naming the step, its checks and the last healthy step, and
    `ckpt train` exits 1 without a traceback."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    store, env = str(tmp_path / "store"), cli_env(tmp_path)
    # validations on threads: what a failed one does to the run is the same on either runner, and the
    # worker process (8 CPU-seconds of imports) is the kill-9 drill's
    out = subprocess.run(cli_args(store, "div", "--lr", "1e30", "--rounds", "2", "--validation-runner", "threads"),
                         env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "Traceback" not in text and "JSON compliant" not in text, text[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: run div: step 1 failed validation") and "no_nan" in line, line
    assert f"the last healthy step is 0: resume from it with `ckpt train --resume --run-id div --store {store}`" in line
    with Checkpointer(str(Path(store, "div"))) as ck:
        m = ck.manifest(1)
        assert m.meta["loss"] is None and "loss" in m.meta["non_finite"]  # JSON has no NaN: null and a flag
        assert ck.healthy_steps() == [0]
    with get_client(sync_client=True) as c:
        run = c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["train-div"])))[0]
        assert run.state.is_failed() and run.state.message in line, run.state
        tasks = {t.name: t.state for t in c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))}
    assert tasks["validate-step-1"].is_failed() and "no_nan" in tasks["validate-step-1"].message
    assert tasks["validate-step-0"].is_completed()


def test_user_supplied_workload_trains(prefect_harness, tmp_path):
    from flows.train import train_run

    s = train_run(params(store=str(tmp_path), run_id="mine", workload="workloads.example_user:build",
                         workload_extra={"hidden": 16}, rounds=2))
    assert s["committed"] == [0, 1, 2] == s["validated"]
    assert s["final_loss"] < s["rounds_log"][0]["loss"] * 1.5  # it trained (and nothing blew up)
    with Checkpointer(s["run_url"]) as ck:
        assert ck.restore(2, part="coordinator")["config"]["workload"] == "workloads.example_user:build"


def test_dask_runner_with_two_processes_reaches_the_clean_digest(clean, tmp_path):
    from flows.train import train_run

    s = train_run(params(store=str(tmp_path), run_id="dask", task_runner="dask"))
    assert s["final_digest"] == clean["digests"][3]
    assert digests(s["run_url"]) == clean["digests"]
    pids = {json.loads(Path(s["run_url"], "heartbeats", f"shard-{i}.json").read_text())["pid"] for i in range(2)}
    assert os.getpid() not in pids  # the shards ran in Dask worker processes


def _where_am_i() -> dict:
    import sys

    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().replace(b"\0", b" ").decode()
    return {"pid": os.getpid(), "parent": parent, "torch": "torch" in sys.modules,
            "mark": os.environ.get("CKPT_TEST_MARK")}


def test_local_dask_workers_are_forked_from_a_server_that_imported_torch(prefect_harness, monkeypatch):
    """``--task-runner dask``: the cluster's worker processes are forked from multiprocessing's fork
    server, where torch, Prefect and the shard task were imported once (flows.runners.forked_workers),
    and each has this process's environment as it was when its cluster started, though the server
    started earlier (a second run in the same process sees a variable set between the two)."""
    from prefect import flow, task

    from flows.runners import shard_runner

    where = task(_where_am_i)

    @flow
    def probe() -> list[dict]:
        with shard_runner("dask", 2) as runner:
            return [runner.submit(where, {}).result() for _ in range(2)]

    for mark in ("first", "second"):
        monkeypatch.setenv("CKPT_TEST_MARK", mark)
        seen = probe()
        assert all(w["pid"] != os.getpid() and "multiprocessing.forkserver" in w["parent"] for w in seen), seen
        assert all(w["torch"] and w["mark"] == mark for w in seen), seen


def test_progress_display_reads_the_run_from_the_store(clean):
    from rich.console import Console

    from ckpt.progress import Progress

    p = Progress(clean["summary"]["run_url"], None, params(), every_s=0.05)
    p.started = 0  # show the finished run's heartbeats too
    p.poll()
    console = Console(record=True, width=120)
    console.print(p)
    text = console.export_text()
    assert "rounds 3/3" in text and "shard-1" in text and "finished" in text
    assert sorted(p.manifests) == [0, 1, 2, 3] and all(v.passed for v in p.verdicts.values())
