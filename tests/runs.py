"""Runs the tests share, so that no test module imports another: the tiny trajectory, a run of
rounds with plain function calls (no Prefect), the clean run's digests computed once per test
session, and the environment and arguments of ``ckpt train`` subprocesses."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
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

TESTS = Path(__file__).resolve().parent
EXTRA = {"d_model": 32, "n_layers": 1, "ctx": 16, "corpus_bytes": 65536}  # tinylm, one layer of width 32
TINY = {"workload": "tinylm", "workload_extra": EXTRA, "shards": 2, "steps_per_round": 3}
# A subprocess that imports tests/slow_steps.py (the workload "slow_steps:build") finds it here.
ENV = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def run_rounds(url: str, spec: RunSpec, rounds: int, every: int = 1, start: int | None = None) -> dict[int, str]:
    """Train ``rounds`` rounds with plain function calls (a group of rank processes per shard where
    ``spec.ranks_per_shard`` > 1, as the shard task does); returns {committed step: digest}."""
    from trainrun.rank_group import train_shard_group

    digests = {}
    if start is None:
        with Checkpointer(url) as ck:
            digests[0] = write_step_zero(ck, spec).digest
        start = 0
    cut = Cut.of_step(start)
    for r in range(start + 1, rounds + 1):
        for i in range(spec.shards):
            with Checkpointer(url) as ck:
                if spec.ranks_per_shard > 1:
                    result = train_shard_group(ck, None, spec, i, r, cut, heartbeat_every_s=0.2)
                else:
                    result = train_shard_round(ck, spec, i, r, cut, heartbeat_every_s=0.05)
                assert result.status == "finished"
        with Checkpointer(url) as ck:
            result = cut_round(ck, spec, r, cut, publish=r % every == 0 or r == rounds, commit_timeout_s=30)
        if result.committed:
            digests[r] = result.digest
        cut = result.next_cut()
    return digests


def clean_digests(cache: Path, spec: RunSpec, rounds: int) -> dict[int, str]:
    """{step: digest} of the clean run of ``spec`` for ``rounds`` rounds, computed once per ``cache``
    folder (the ``clean_digests`` fixture's is one per test session, shared by the xdist workers; a
    lock keeps two of them from computing the same run at once). The runtime is deterministic: the
    digests are those of a Prefect run of the same spec (threads or Dask, with or without shard
    checkpoints or a watchdog), which is what the drills compare with."""
    key = hashlib.sha256(json.dumps([spec.to_dict(), rounds], sort_keys=True).encode()).hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    done = cache / f"{key}.json"
    with open(cache / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            digests = run_rounds(str(cache / key), spec, rounds)
            shutil.rmtree(cache / key)
            done.write_text(json.dumps(digests))
    return {int(step): digest for step, digest in json.loads(done.read_text()).items()}


def digests(url: str, storage_options: dict | None = None) -> dict[int, str]:
    """{committed step: digest} of the run at ``url``."""
    with Checkpointer(url, storage_options) as ck:
        return {s: ck.manifest(s).digest for s in ck.steps()}


def cli_env(tmp_path: Path) -> dict[str, str]:
    """Environment of a ``ckpt`` subprocess: the session's Prefect server, a throwaway home."""
    from prefect.settings import PREFECT_API_URL

    home = tmp_path / "prefect-home"
    home.mkdir(exist_ok=True)
    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


def worker_env(storage_options: dict) -> dict[str, str]:
    """A worker machine's environment: the project, the Prefect API, the store's credentials."""
    from prefect.settings import PREFECT_API_URL

    from bench.common import ROOT

    return {"PYTHONPATH": str(ROOT), "PREFECT_API_URL": PREFECT_API_URL.value(), "OMP_NUM_THREADS": "1",
            "CKPT_STORAGE_OPTIONS": json.dumps(storage_options), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1", "AWS_EC2_METADATA_DISABLED": "true"}


# --- a run stopped mid-round (preempted, cancelled) and resumed -----------------------------------------

NEVER = 1000  # shard checkpoint cadence: none by cadence in a 40-step round, so each one is a stop's
SLOW_SPEC = RunSpec(workload="slow_steps:build", workload_extra=EXTRA, shards=2, steps_per_round=40)


def train_args(store: str, run_id: str) -> list[str]:
    """``ckpt train`` of ``SLOW_SPEC`` for 3 rounds, shard checkpoints only on a stop, no watchdog,
    validations in its threads (a worker process would cost 6-8 CPU-seconds of imports a run)."""
    return [sys.executable, "-m", "ckpt", "train", "--store", store, "--run-id", run_id, "--workload",
            SLOW_SPEC.workload, "--shards", "2", "--rounds", "3", "--steps-per-round", "40", "--workload-extra",
            json.dumps(EXTRA), "--heartbeat-every", "0.2", "--shard-checkpoint-every", str(NEVER), "--no-watchdog",
            "--preempt-grace", "20", "--validation-runner", "threads"]


def newest_checkpoint(root: str, round_no: int, part: str) -> int | None:
    from ckptlib import commit

    keys = commit.substep_keys(Store.from_url(root), round_no, part, 0)
    return max(keys) if keys else None


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


def stopped_where(run: Path) -> dict[str, int]:
    """Each shard's last beat of round 2 (where it stopped) and its newest checkpoint of the round: the same."""
    beats = read_heartbeats(Store.from_url(str(run)))
    where = {}
    for part in ("shard-0", "shard-1"):
        b = beats[part]
        assert b.round == 2 and b.status == "failed" and "Preempted" in (b.error or ""), b
        assert newest_checkpoint(str(run), 2, part) == b.round_step, (part, b)
        where[part] = b.round_step
    return where


def end_session(proc: subprocess.Popen) -> None:
    """SIGKILL to every process left in the session ``proc`` leads (``start_new_session=True``); a
    session that ended whole (its run validated on threads: no worker process outlives it) is fine."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def resume(args: list[str], env: dict, tmp_path: Path, where: dict[str, int]) -> dict:
    """``--resume``: each shard continues round 2 from the step it stopped at; the summary."""
    out = subprocess.run(args + ["--resume", "--json", str(tmp_path / "s.json")], env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    s = json.loads((tmp_path / "s.json").read_text())
    (round2,) = [r for r in s["rounds_log"] if r["round"] == 2]
    assert {f"shard-{x['shard']}": x["resumed_at_step"] for x in round2["shards"]} == where  # 0 steps recomputed
    return s


# --- a shard trained by a group of rank processes -------------------------------------------------------

def rank_spec(ranks: int = 2, **kw) -> RunSpec:
    return RunSpec(**{"workload": "tinylm", "workload_extra": EXTRA, "shards": 2, "steps_per_round": 6,
                      "ranks_per_shard": ranks, **kw})


def step_zero(url: str, s: RunSpec) -> Checkpointer:
    ck = Checkpointer(url)
    write_step_zero(ck, s)
    return ck
