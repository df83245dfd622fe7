"""A cancel stops every shard at once, wherever it runs (issue: cancel everywhere).

``ckpt train --task-runner dask`` cancelled through the Prefect API mid-round: the flow writes the
run's stop document (``control/stop.json``); each shard, in its own Dask worker process, reads it at
its next beat, checkpoints where it is and stops, seconds after the cancel, long before its round
would have ended. The run ends Cancelled, commits nothing more, and ``--resume`` recomputes 0 steps
and reaches the clean run's digests. (Before: the workers finished the round, and it was committed.)
"""

from __future__ import annotations

import subprocess
import time

import pytest

from ckptlib.heartbeat import read_heartbeats
from ckptlib.store import Store
from tests.runs import SLOW_SPEC, digests, end_session, resume, stopped_where, train_args, wait_for_round
from trainrun.preemption import STOP_KEY

STEP_S = 0.3  # a step's sleep: the 35 steps left of round 2 take 10 s, a stop a beat (0.2 s) and a step
SLEEP_FROM = 40  # the data position of round 2's first step: round 1 does not sleep


@pytest.mark.prefect
@pytest.mark.slow  # over 60 s on CI: two `ckpt train` processes, each starting a Dask cluster that imports torch
def test_a_dask_run_cancelled_through_the_api_stops_every_shard_within_seconds_and_resumes_recomputing_nothing(
        api_env, clean_digests, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Cancelling

    args = train_args(str(tmp_path / "store"), "dask-cancelled") + ["--task-runner", "dask"]
    run = tmp_path / "store" / "dask-cancelled"
    env = {**api_env, "CKPT_TEST_STEP_SLEEP": str(STEP_S), "CKPT_TEST_STEP_SLEEP_FROM": str(SLEEP_FROM)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for_round(proc, run)
        with get_client(sync_client=True) as client:
            (fr,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                name=FlowRunFilterName(any_=["train-dask-cancelled"])))
            cancelled_at = time.time()
            client.set_flow_run_state(fr.id, Cancelling(message="cancelled by the test"), force=True)
        out = proc.communicate(timeout=120)[0]
    finally:
        end_session(proc)
    assert "ended CANCELLED" in out and "Traceback" not in out, out[-3000:]
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(fr.id).state
    assert state is not None and state.is_cancelled(), state
    assert not (run / "manifests" / "2.json").exists()  # the round was not finished, nor committed
    beats = read_heartbeats(Store.from_url(str(run)))
    stopped_after = {p: round(beats[p].time - cancelled_at, 2) for p in ("shard-0", "shard-1")}
    print(f"shards stopped (final beats) {stopped_after} s after the cancel")
    assert all(s < 5.0 for s in stopped_after.values()), stopped_after  # vs ~10 s the round had left
    assert all(beats[p].pid != proc.pid for p in stopped_after)  # each trained in a Dask worker process
    where = stopped_where(run)  # each checkpointed at the step it stopped at
    assert (run / STOP_KEY).exists()
    s = resume(args, api_env, tmp_path, where)  # 0 steps recomputed
    assert not (run / STOP_KEY).exists()  # the resumed session cleared it, and trained on
    assert digests(str(run)) == clean_digests(SLOW_SPEC, 3)
    assert s["predecessor"]["status"] == "cancelled", s["predecessor"]


def test_a_shard_beat_takes_the_stop_document_as_its_process_request_and_forgets_it_after(tmp_path):
    """The watch reads ``control/stop.json`` at a running beat: its reason becomes this process's
    request (an unknown reason reads as a cancel); an oversized document is refused unread; the
    request is forgotten after the attempt, one of the process's own stays."""
    from ckptlib.heartbeat import Beat
    from trainrun import preemption

    store = Store.from_url(str(tmp_path))
    watch = preemption.StopWatch(store)
    running = Beat(part="shard-0", generation=0, round=2, status="running", time=0.0, started=0.0)
    preemption.reset()
    try:
        store.put(STOP_KEY, b'{"format": 1, "reason": "' + b"x" * (20 << 10) + b'", "time": 1, "by": "b"}')
        watch(running)
        assert preemption.requested() is None  # over the 16 KiB cap: no stop
        preemption.write_stop(store, "SIGTERM", by="flow-run", round_no=2)
        watch(running)
        assert preemption.requested() == "SIGTERM" and not preemption.ending()  # not this process's own signal
        preemption.forget_stop_document()
        assert preemption.requested() is None
        store.put(STOP_KEY, b'{"format": 1, "reason": "__import__(\'os\')", "time": 1, "by": "b"}')
        watch(running)
        assert preemption.requested() == "cancel"
        preemption.reset()
        preemption.request("cancel")  # the coordinator's own (the threads' process): never forgotten
        preemption.forget_stop_document()
        assert preemption.requested() == "cancel"
        preemption.clear_stop(store)
        assert preemption.read_stop(store) is None
    finally:
        preemption.reset()
