"""Preemption and cancellation lose nothing, and a cancel is a state, not an error (issues 39 and 42).

* A shard round training in its own process gets a real SIGTERM mid-round (a spot instance, an
  eviction): it writes a shard checkpoint at the step it was at, and the process ends; the rerun
  continues from there (0 steps recomputed) and writes the clean round's fragment.
* ``ckpt train --chaos preempt:...`` (SIGTERM to the run's own process, threads): every shard
  checkpoints where it is, the process ends; ``--resume`` recomputes 0 steps, ends on the clean digest.
* A ``ckpt train`` cancelled through the Prefect API of a real server: its shards checkpoint, the
  flow run ends Cancelled with no ERROR record, the CLI says what it committed; ``--resume``
  recomputes 0 steps, ends on the clean digest, and says its predecessor ended cancelled.

Tiny settings: tinylm of width 32 (``slow_steps``: each step sleeps, so a signal lands mid-round),
2 shards, 40 steps a round, shard checkpoints only on a stop (every 1000 steps: never by cadence).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptlib import Checkpointer
from ckptlib.heartbeat import read_heartbeat
from ckptlib.store import Store
from tests.runs import (
    ENV,
    EXTRA,
    NEVER,
    SLOW_SPEC,
    digests,
    end_session,
    newest_checkpoint,
    resume,
    stopped_where,
    train_args,
    wait_for_round,
)
from trainrun.documents import Cut
from trainrun.recovery import read_recoveries
from trainrun.shard_round import train_shard_round
from trainrun.step_zero import write_step_zero

SPEC = SLOW_SPEC

# One shard's round in a process of its own, training in its main thread (a rank process, a shard
# flow run); it installs the preemption handler where the code has one.
_SHARD = """
import sys, time
from ckptlib import Checkpointer
from trainrun.documents import Cut
from trainrun.shard_round import train_shard_round
from trainrun.spec import RunSpec
try:
    from trainrun import preemption
    preemption.install(10.0)
except ImportError:
    pass
root, spec = sys.argv[1], RunSpec.model_validate_json(sys.argv[2])
ck = Checkpointer(root)
try:
    train_shard_round(ck, spec, 0, 1, Cut.of_step(0), checkpoint_every=int(sys.argv[3]), heartbeat_every_s=0.1)
except Exception as e:
    print(type(e).__name__, e, flush=True)
    time.sleep(30)  # the process ends from the signal, once the loop stopped
"""


def test_a_sigterm_mid_round_checkpoints_where_it_was_and_the_rerun_recomputes_nothing(tmp_path):
    clean_root, root = str(tmp_path / "clean"), str(tmp_path / "run")
    for r in (clean_root, root):
        with Checkpointer(r) as ck:
            write_step_zero(ck, SPEC)
    with Checkpointer(clean_root) as ck:
        clean = train_shard_round(ck, SPEC, 0, 1, Cut.of_step(0), checkpoint_every=0)
    proc = subprocess.Popen([sys.executable, "-c", _SHARD, root, SPEC.model_dump_json(), str(NEVER)],
                            env={**ENV, "CKPT_TEST_STEP_SLEEP": "0.05"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while (beat := read_heartbeat(Store.from_url(root), "shard-0")) is None or (beat.round_step or 0) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.02)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
        stopped_s = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM, out[-3000:]  # it ended as SIGTERM ends a process
    assert stopped_s < 10, (stopped_s, out[-3000:])  # at once, not after the grace
    last = read_heartbeat(Store.from_url(root), "shard-0")
    assert last is not None and last.status == "failed" and "Preempted" in (last.error or "")
    k = newest_checkpoint(root, 1, "shard-0")
    assert k is not None and k == last.round_step and 5 <= k < 40, (k, last)  # at the very step it was at
    with Checkpointer(root) as ck:
        again = train_shard_round(ck, SPEC, 0, 1, Cut.of_step(0), attempt=2, checkpoint_every=NEVER)
    assert (again.resumed_at_step, again.start_source) == (k, "store")  # 0 steps recomputed
    assert again.digest == clean.digest
    [row] = read_recoveries(Store.from_url(root), 1)  # recorded as what it was: a preemption, not a crash
    assert (row.kind, row.failed_at_step, row.steps_recomputed) == ("preempted", k, 0), row


# --- real Prefect: ckpt train preempted, and cancelled through the API ------------------------------

@pytest.fixture(scope="module")
def clean(prefect_harness, clean_digests):
    """The same run undisturbed (a step sleeps only with CKPT_TEST_STEP_SLEEP set), by plain calls."""
    return clean_digests(SPEC, 3)


def _start_and_wait_for_round_2(args: list[str], env: dict, run: Path) -> subprocess.Popen:
    """``ckpt train`` started; returns once both shards train round 2 (5 steps in)."""
    proc = subprocess.Popen(args, env={**env, "CKPT_TEST_STEP_SLEEP": "0.05"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    wait_for_round(proc, run)
    return proc


@pytest.mark.prefect
@pytest.mark.slow  # over 60 s on CI: `ckpt train` preempted, then `--resume`: two processes that start Prefect and torch
def test_a_preempted_run_checkpoints_every_shard_and_its_resume_recomputes_nothing(api_env, clean,
                                                                                  tmp_path):
    store = str(tmp_path / "store")
    args = train_args(store, "preempted")
    run = Path(store, "preempted")
    proc = subprocess.Popen(args + ["--chaos", "preempt:shard=0,round=2,step=10"],
                            env={**api_env, "CKPT_TEST_STEP_SLEEP": "0.05"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out = proc.communicate(timeout=300)[0]
    finally:
        end_session(proc)
    assert proc.returncode != 0 and not (run / "manifests" / "2.json").exists(), out[-3000:]
    where = stopped_where(run)
    assert where["shard-0"] == 10  # the drill's shard stopped at its strike step
    s = resume(args, api_env, tmp_path, where)
    assert digests(str(run)) == clean
    assert s["predecessor"]["status"] == "crashed", s["predecessor"]  # the flow run's real state, not the beat's


@pytest.mark.prefect
@pytest.mark.slow  # over 60 s on CI: `ckpt train` cancelled, then `--resume`: two processes that start Prefect and torch
def test_a_run_cancelled_through_the_api_checkpoints_ends_cancelled_and_resumes_recomputing_nothing(
        api_env, clean, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId
    from prefect.states import Cancelling

    store = str(tmp_path / "store")
    args = train_args(store, "cancelled")
    run = Path(store, "cancelled")
    proc = _start_and_wait_for_round_2(args, api_env, run)
    try:
        with get_client(sync_client=True) as client:
            (fr,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["train-cancelled"])))
            client.set_flow_run_state(fr.id, Cancelling(message="cancelled by the test"), force=True)
        out = proc.communicate(timeout=120)[0]
    finally:
        end_session(proc)
    assert "ended CANCELLED" in out and "Traceback" not in out, out[-3000:]
    assert "cancelled after round 1: this session committed steps 0..1" in out, out[-3000:]
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(fr.id).state
        errors = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))
    assert state is not None and state.is_cancelled(), state
    assert [r.message for r in errors if r.level >= 40] == []  # no ERROR record, no traceback
    assert not (run / "manifests" / "2.json").exists()
    where = stopped_where(run)
    s = resume(args, api_env, tmp_path, where)
    assert digests(str(run)) == clean
    assert s["predecessor"]["status"] == "cancelled", s["predecessor"]


@pytest.mark.prefect
@pytest.mark.slow
def test_a_preempted_dask_worker_checkpoints_and_dask_reruns_its_shard_recomputing_nothing(clean, tmp_path):
    """``--task-runner dask``: SIGTERM to shard 1's worker process at step 10 of round 2; the worker
    checkpoints there and ends, Dask runs the task again in another worker, which continues at step 10."""
    from flows.params import TrainParams
    from flows.train import train_run

    s = train_run(TrainParams(store=str(tmp_path), run_id="dask", workload=SPEC.workload, workload_extra=EXTRA,
                              shards=2, rounds=3, steps_per_round=40, validation_runner="threads",
                              shard_checkpoint_every=NEVER, task_runner="dask", preempt_grace_s=10,
                              chaos=["preempt:shard=1,round=2,step=10"]))
    assert digests(s["run_url"]) == clean
    (round2,) = [r for r in s["rounds_log"] if r["round"] == 2]
    # no cadence checkpoint in a round (every 1000 steps): step 10's is the one the SIGTERM wrote
    assert [(x["shard"], x["resumed_at_step"]) for x in round2["shards"]] == [(0, 0), (1, 10)]  # 0 recomputed
