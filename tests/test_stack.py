"""End to end through the local stack: ``deployments.stack up``, ``deployments.deploy``, a training
run executed by the worker, checkpoints in the bucket, artifacts in Prefect, the heartbeat
automation, a hang drill healed by the watchdog deployment, gc as a deployment,
``deployments.stack down`` leaving nothing behind.

Everything is real and on loopback: a Prefect server (SQLite), SeaweedFS S3, a process work pool
and worker, started by the same command as ``make stack`` in a temporary stack folder on free
ports (never 4200/8333/8888, so a developer's own stack is not disturbed). The stack tests run in
order and share one stack (module fixture); the first test (the gc flow on local stores) uses the
session's Prefect test harness instead. About 2.5 minutes on 2 cores.

Select with ``pytest tests/test_stack.py`` (marks: slow, prefect, s3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from deployments.client import PrefectAPI
from deployments.stack import Stack, free_port, stack_processes

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.s3]

REPO = Path(__file__).resolve().parent.parent
# Small enough for 2 cores, big enough to commit and validate two checkpoints (steps 0 and 1).
SMALL = {"shards": 1, "rounds": 1, "steps_per_round": 2}


def _clean_env() -> dict[str, str]:
    """Our environment without client settings that could point the commands elsewhere."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PREFECT_API_URL", "PREFECT_UI_URL", "CKPT_STORE", "CKPT_WORK_POOL", "CKPT_STACK_DIR")}


def stack_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.stack", *args], cwd=REPO, env=_clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def deploy_cli(stack_dir: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.deploy", "--stack-dir", str(stack_dir),
                           "--schedules-inactive", *args], cwd=REPO, env=_clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def s3_client(info: dict):
    import boto3
    from botocore.config import Config

    env = info["env"]
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                        config=Config(retries={"max_attempts": 3}))


def keys_under(client, bucket: str, prefix: str) -> list[str]:
    keys, token = [], {}
    while True:
        page = client.list_objects_v2(Bucket=bucket, Prefix=prefix, **token)
        keys += [o["Key"] for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return keys
        token = {"ContinuationToken": page["NextContinuationToken"]}


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def logs_tail(info: dict, lines: int = 60) -> str:
    out = []
    for name in ("worker.log", "prefect-server.log"):
        p = Path(info["logs"]) / name
        if p.exists():
            out.append(f"--- {name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(out)


def test_gc_flow_collects_every_run_under_a_root(tmp_path, prefect_harness):
    """gc-store on a root with two runs (one nested): each keeps its newest step and its latest
    healthy one; a run URL given directly is collected alone; dry run deletes nothing."""
    import torch

    from ckptlib import Checkpointer
    from ckptlib.store import Store
    from flows.gc import gc_store
    from trainrun.layout import find_runs

    keys = ("a/manifests/1.json", "a/chunks/x", "t/b/manifests/0.json", "c/fragments/1/x.json",
            "d/heartbeats/shard-0.json", "e/f/g/h/manifests/1.json")
    for name, extra in (("flat", ()), ("rooted", ("manifests/3.json",))):
        layout = Store.from_url(str(tmp_path / name))
        for key in keys + extra:
            layout.put(key, b"{}")
    # a run holds manifests/ or heartbeats/, at most 3 levels down; below a run nothing is looked at
    assert find_runs(Store.from_url(str(tmp_path / "flat"))) == ["a", "d", "t/b"]
    assert find_runs(Store.from_url(str(tmp_path / "rooted"))) == [""]
    root = tmp_path / "runs"
    for name, steps in (("a", 5), ("team/b", 3)):
        with Checkpointer(str(root / name), chunk_bytes=4096) as ck:
            for step in range(steps):
                ck.save(step, {"w": torch.full((4096,), float(step))})
    (root / "a" / "validations").mkdir()
    (root / "a" / "validations" / "2.json").write_text('{"passed": true}')

    dry = gc_store(str(root), keep_last=1, grace_seconds=0, dry_run=True)
    assert {r["run"]: r["dropped_steps"] for r in dry} == {f"{root}/a": [0, 1, 3], f"{root}/team/b": [0, 1]}
    assert sorted(p.name for p in (root / "a" / "manifests").iterdir()) == [f"{i}.json" for i in range(5)]

    only_b = gc_store(f"{root}/team/b", keep_last=2, grace_seconds=0)
    assert [(r["kept_steps"], r["dropped_steps"]) for r in only_b] == [([1, 2], [0])]
    res = {r["run"]: r for r in gc_store(str(root), keep_last=1, grace_seconds=0)}
    assert res[f"{root}/a"]["kept_steps"] == [2, 4] and res[f"{root}/a"]["latest_healthy"] == 2
    assert res[f"{root}/team/b"]["kept_steps"] == [2]
    assert sorted(p.name for p in (root / "a" / "manifests").iterdir()) == ["2.json", "4.json"]
    with Checkpointer(str(root / "a")) as ck:  # what is kept still restores, bit for bit
        assert torch.equal(ck.restore(2)["w"], torch.full((4096,), 2.0))
        assert ck.verify(4) == []
    assert gc_store(str(tmp_path / "empty"), dry_run=True) == []


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("stack")
    t0 = time.monotonic()
    up = stack_cli("up", "--dir", str(d), "--api-port", str(free_port()), "--s3-port", "0", "--filer-port", "0",
                   "--poll-seconds", "1", "--timeout", "150")
    info = Stack(d).info()
    try:
        assert up.returncode == 0, f"stack up failed:\n{up.stdout}\n{up.stderr}"
        info["up_output"] = up.stdout
        info["up_seconds"] = time.monotonic() - t0
        yield info
    finally:
        stack_cli("down", "--dir", str(d), "--grace", "3")  # no-op if the last test stopped it


def test_up_answers_and_tells_where_everything_is(stack):
    out = stack["up_output"]
    for what in (stack["ui_url"], stack["api_url"], stack["s3_endpoint"], "checkpoints", stack["logs"],
                 "PREFECT_API_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert what in out, f"`stack up` does not print {what!r}:\n{out}"
    assert not stack["api_url"].endswith(":4200/api")  # tests never take the developer's port
    # The env file is sourceable and carries what a client needs.
    env = subprocess.run(["bash", "-c", f". {stack['env_file']} && env"], capture_output=True, text=True,
                         check=True).stdout
    assert f"PREFECT_API_URL={stack['api_url']}" in env
    assert f"AWS_ENDPOINT_URL={stack['s3_endpoint']}" in env
    # The UI is told the port it is served from (env settings, not only the --port flag).
    with urllib.request.urlopen(f"{stack['ui_url']}/ui-settings", timeout=10) as r:
        assert json.load(r)["api_url"] == stack["api_url"]
    st = stack_cli("status", "--dir", stack["dir"], "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    status = json.loads(st.stdout)
    assert all(s["answers"] for s in status["services"].values()), status["services"]
    for name in ("prefect-server.log", "worker.log", "seaweedfs.log"):
        assert (Path(stack["logs"]) / name).exists()
    assert "checkpoints" in [b["Name"] for b in s3_client(stack).list_buckets()["Buckets"]]
    # A second `up` of a running stack is a no-op.
    again = stack_cli("up", "--dir", stack["dir"], "--api-port", str(stack["api_port"]))
    assert again.returncode == 0 and "already running" in again.stdout


def test_deploy_registers_typed_deployments(stack):
    res = deploy_cli(Path(stack["dir"]))
    assert res.returncode == 0, res.stdout + res.stderr
    with PrefectAPI(stack["api_url"]) as api:
        deps = {d["name"]: d for d in api.deployments()}
        assert {"train", "validate", "gc"} <= set(deps), res.stdout
        train = api.deployment("train-run/train")
        assert train["work_pool_name"] == stack["pool"]
        assert train["parameters"]["params"]["store"] == stack["store"] == "s3://checkpoints/runs"
        props = train["parameter_openapi_schema"]["definitions"]["TrainParams"]["properties"]
        assert props["rounds"]["type"] == "integer" and props["store"]["description"]
        gc = api.deployment("gc-store/gc")
        assert gc["parameters"]["store"] == stack["store"]
        assert gc["parameter_openapi_schema"]["properties"]["keep_last"]["minimum"] == 1
        assert gc["schedules"] and not any(s["active"] for s in gc["schedules"])  # --schedules-inactive
        validate = api.deployment("validate-checkpoint/validate")
        assert validate["parameters"]["run_url"] == stack["store"] + "/"
        if (REPO / "flows" / "watchdog.py").exists():
            assert "watchdog" in deps, res.stdout
        else:
            assert "skipped watchdog" in res.stdout


def test_training_run_on_the_worker(stack):
    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    with PrefectAPI(stack["api_url"]) as api:
        dep = api.deployment("train-run/train")
        params = {**dep["parameters"]["params"], **SMALL, "run_id": run_id}
        t0 = time.monotonic()
        fr = api.run_deployment(dep, {"params": params}, name=f"test-{run_id}")
        fr = api.wait(fr["id"], timeout=300)
        seconds = time.monotonic() - t0
        assert fr["state_type"] == "COMPLETED", f"{fr['state_name']}: {fr['state']['message']}\n{logs_tail(stack)}"
        assert fr["work_pool_name"] == stack["pool"]
        tasks = {t["name"].split("-")[0] for t in api.task_runs(fr["id"])}
        assert {"shard", "validate"} <= tasks, tasks

        # Checkpoints in the bucket, seen by an independent S3 client.
        s3 = s3_client(stack)
        keys = keys_under(s3, "checkpoints", f"runs/{run_id}/")
        assert {f"runs/{run_id}/manifests/0.json", f"runs/{run_id}/manifests/1.json"} <= set(keys), keys
        assert any(k.startswith(f"runs/{run_id}/chunks/") for k in keys)
        verdict = json.loads(
            s3.get_object(Bucket="checkpoints", Key=f"runs/{run_id}/validations/1.json")["Body"].read())
        assert verdict["passed"], verdict
        # ... and its HTML report opens in a browser, over the filer's plain HTTP (no S3 signature).
        with urllib.request.urlopen(f"{stack['s3_http_base']}/checkpoints/runs/{run_id}/reports/1/index.html",
                                    timeout=10) as r:
            assert "PASSED" in r.read().decode()

        # Artifacts in Prefect: the validation verdict table and the run's checkpoint table.
        arts = api.artifacts(fr["id"])
        by_key = {}
        for a in arts:
            by_key.setdefault(a["key"], []).append(a)
        validation = [a for k, v in by_key.items() if k and k.startswith("ckpt-validation-") and
                      not k.endswith("-report") for a in v]
        assert validation, sorted(by_key)
        rows = [row for a in validation for row in json.loads(a["data"])]
        assert {r["step"] for r in rows} == {0, 1} and all(r["verdict"] == "passed" for r in rows), rows
        assert any(a["type"] == "markdown" and "PASSED" in a["data"] for a in arts)
        assert f"train-{run_id}" in by_key
    print(f"training run {run_id}: {seconds:.1f} s from trigger to Completed")
    stack["run_id"] = run_id


def test_automation_starts_the_watchdog_when_heartbeats_stop(stack):
    """The automation `make deploy` creates for the watchdog, on a real server: one shard heartbeat
    event, then silence -> the proactive trigger fires -> a run of the watchdog deployment (here for
    3 s, on the store root), which the worker executes. Without flows/watchdog.py the gc deployment
    stands in (its defaults delete nothing here: keep_last 3, grace 600 s)."""
    with PrefectAPI(stack["api_url"]) as api:
        names = {d["name"] for d in api.deployments()}
        if "watchdog" in names:
            target, params = f"{_flow_of(api, 'watchdog')}/watchdog", {"duration_s": 3, "poll_s": 1}
        else:
            target, params = "gc-store/gc", {"dry_run": True}
        dep = api.deployment(target)
        env = {**_clean_env(), **stack["env"]}
        code = ("import json, sys; from deployments.deploy import watchdog_automation; "
                "print(watchdog_automation(sys.argv[1], within_s=10, parameters=json.loads(sys.argv[2])))")
        res = subprocess.run([sys.executable, "-c", code, dep["id"], json.dumps(params)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        t0 = time.time()
        before = {r["id"] for r in api.flow_runs(dep["id"])}
        api.emit_event("ckpt.shard.heartbeat", {"prefect.resource.id": "ckpt.shard.automation-test.shard-0",
                                                "ckpt.run-id": "automation-test", "ckpt.part": "shard-0"},
                       payload={"round": 1, "step": 1})
        deadline = time.monotonic() + 90
        started = []
        while not started and time.monotonic() < deadline:
            time.sleep(1)
            started = [r for r in api.flow_runs(dep["id"]) if r["id"] not in before]
        assert started, f"no run of {target} within 90 s of the last heartbeat"
        latency = time.time() - t0
        run = api.wait(started[0]["id"], timeout=180)
        assert run["state_type"] == "COMPLETED", f"{run['state_name']}: {run['state']['message']}\n{logs_tail(stack)}"
        print(f"automation: {target} started {latency:.1f} s after the last heartbeat (window 10 s)")


def test_hang_drill_through_the_stack(stack):
    """A failure drill through the stack: shard 0 of a run started from the train deployment hangs
    (no beats, no steps, its thread alive); its heartbeat events stop; the automation starts the
    watchdog deployment; the watchdog fences the shard and reruns it; the run completes, and its
    final digest equals the clean run's (test_training_run_on_the_worker, same parameters)."""
    if not (REPO / "flows" / "watchdog.py").exists():
        pytest.skip("flows/watchdog.py does not exist yet: nothing to fence and rerun the hung shard")
    clean = stack.get("run_id")
    if clean is None:
        pytest.skip("needs the clean run of test_training_run_on_the_worker")
    run_id = f"drill-{uuid.uuid4().hex[:8]}"
    with PrefectAPI(stack["api_url"]) as api:
        watchdog = api.deployment(f"{_flow_of(api, 'watchdog')}/watchdog")
        # Quick detection for a test: 10 s of silence (the automation), 8 s without a beat (the watchdog).
        params = {"timeout_s": 8, "poll_s": 1, "until_done": True, "duration_s": 240}
        code = ("import json, sys; from deployments.deploy import watchdog_automation; "
                "print(watchdog_automation(sys.argv[1], within_s=10, parameters=json.loads(sys.argv[2])))")
        res = subprocess.run([sys.executable, "-c", code, watchdog["id"], json.dumps(params)], cwd=REPO,
                             env={**_clean_env(), **stack["env"]}, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        before = {r["id"] for r in api.flow_runs(watchdog["id"])}
        t0 = time.monotonic()
        fr = api.run_deployment("train-run/train", {"params": {
            **SMALL, "run_id": run_id, "heartbeat_events": True, "chaos": ["hang:shard=0,round=1"]}},
            name=f"test-{run_id}")
        fr = api.wait(fr["id"], timeout=400)
        seconds = time.monotonic() - t0
        assert fr["state_type"] == "COMPLETED", f"{fr['state_name']}: {fr['state']['message']}\n{logs_tail(stack)}"
        dogs = [r for r in api.flow_runs(watchdog["id"]) if r["id"] not in before]
        assert dogs, "the automation started no watchdog run"
        s3 = s3_client(stack)
        fences = keys_under(s3, "checkpoints", f"runs/{run_id}/fences/shard-0/")
        assert fences, "shard 0 was never fenced"

        def digest(run: str) -> str:
            return json.loads(s3.get_object(Bucket="checkpoints", Key=f"runs/{run}/manifests/1.json")["Body"]
                              .read())["digest"]

        assert digest(run_id) == digest(clean)
        reruns = [t["name"] for d in dogs for t in api.task_runs(d["id"]) if t["name"].startswith("rerun-shard-0")]
        assert reruns, [t["name"] for d in dogs for t in api.task_runs(d["id"])]
    print(f"hang drill {run_id}: completed in {seconds:.1f} s with the clean digest; fences {fences}")


def _flow_of(api: PrefectAPI, deployment_name: str) -> str:
    dep = next(d for d in api.deployments() if d["name"] == deployment_name)
    return api._call("GET", f"/flows/{dep['flow_id']}")["name"]


def test_gc_deployment_through_the_cli(stack):
    """`prefect deployment run` (the CLI a user types) of gc-store/gc on the run just trained."""
    run_id = stack.get("run_id")
    if run_id is None:
        pytest.skip("needs the training run of test_training_run_on_the_worker")
    env = {**_clean_env(), **stack["env"]}
    res = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "deployment", "run", "gc-store/gc",
         "--param", f"store={stack['store']}/{run_id}", "--param", "keep_last=1",
         "--param", "grace_seconds=0", "--watch", "--watch-timeout", "240"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + logs_tail(stack)
    keys = keys_under(s3_client(stack), "checkpoints", f"runs/{run_id}/manifests/")
    assert keys == [f"runs/{run_id}/manifests/1.json"], keys  # step 0 dropped, the newest (healthy) kept


def test_down_leaves_nothing_running(stack):
    info = Stack(stack["dir"]).info()
    pids = [Stack(stack["dir"]).pid(s) for s in ("server", "seaweedfs", "worker")]
    assert all(pids) and stack_processes(info["stack_id"])
    res = stack_cli("down", "--dir", stack["dir"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no process of it is left" in res.stdout
    assert stack_processes(info["stack_id"]) == []
    assert not [p for p in pids if _running(p)]
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    assert stack["dir"] not in ps, ps
    assert not any(f":{stack['api_port']}" in line and "prefect" in line for line in ps.splitlines()), ps
    for port in (stack["api_port"], stack["s3_port"], stack["filer_port"]):
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
    again = stack_cli("down", "--dir", stack["dir"])
    assert again.returncode == 0
