"""End to end through the local stack, as an operator meets it: ``deployments.stack up`` (on
PostgreSQL), ``deployments.deploy``, training runs executed by the worker, checkpoints in the
bucket, artifacts and report links in Prefect, an API that refuses every call without the stack's
credentials, a killed worker started again by the stack's supervisor with no command typed, the
worker and its supervisor killed mid-run (the run completes; one command restarts them), a hang
healed by the long-lived watchdog (the fenced task run says so), a dead flow-run process resumed by
the watchdog, Retry of a failed run resuming it, the keeper starting a killed watchdog again,
notifications to a webhook, a re-validation whose report index plot and table agree, gc as a
deployment, ``deployments.stack down`` leaving nothing behind (and starting no worker again). And the
Prefect UI in a real browser (headless Chromium, tests/browser.py): a training run started from the
deployment's typed form and its validation found, a fenced shard shown on its run.

Everything is real and on loopback: a Prefect server on a PostgreSQL cluster this module starts
(Debian's ``postgresql``: ``initdb``/``pg_ctl`` as the ``postgres`` user when run as root; SQLite,
saying so, where there is none), SeaweedFS S3, a process work pool and worker, started by the same
command as ``make stack`` in a temporary stack folder on free ports (never 4200/8333/8888, so a
developer's own stack is not disturbed), and a webhook receiver (a thread here). The stack tests
run in order and share one stack (module fixture); the first test (the gc flow on local stores)
uses the session's Prefect test harness instead. Waits follow events, not fixed sleeps (a flow run's
state events through ``PrefectAPI.wait``, the worker's heartbeats, the supervisor's log), and the
keeper's 30 s window passes while two tests that need no watchdog run. With the UI tests, 4.2
minutes alone on 2 cores and 6 minutes inside `make test` (2026-12-07); most of it is flow-run
processes starting and training.

Select with ``pytest tests/test_stack.py`` (marks: slow, prefect, s3).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prefect.client.schemas.filters import LogFilter, LogFilterLevel, LogFilterTaskRunId
from prefect.client.schemas.sorting import LogSort

from ckptlib.testing import document_json
from deployments.client import PrefectAPI
from deployments.stack import Stack, free_port, stack_processes
from flows.resume import RESWEEP_AFTER_S
from tests import browser

# slow, all of them: they share a real stack (a Prefect server on PostgreSQL, S3, a worker) that takes
# 8-25 s to start, and the drills (Retry, the dead run, the killed worker, the hang) each wait on
# flow-run processes that start and train: 20-60 s at load 4-9, more on a busier machine.
pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.s3]

REPO = Path(__file__).resolve().parent.parent
# Small enough for 2 cores, long enough to kill a run after step 0 with rounds still to go.
SMALL = {"shards": 1, "rounds": 2, "steps_per_round": 2}
FINAL = SMALL["rounds"]
# A run whose test is not about the validation worker validates in the flow's threads: a worker
# process costs 6-8 CPU-seconds of imports (test_training_run_on_the_worker and
# test_a_dead_run_is_resumed_by_the_watchdog run the default, a process).
QUICK = {**SMALL, "validation_runner": "threads"}
WATCHDOG = {"timeout_s": 8, "poll_s": 1}  # quick detection for tests (the default is 30 s)
KEEPER_WITHIN_S = 30  # 3 missed signs of life: under CI's load a watchdog can miss one and still live


def _clean_env() -> dict[str, str]:
    """Our environment without client settings that could point the commands elsewhere."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PREFECT_API_URL", "PREFECT_UI_URL", "CKPT_STORE", "CKPT_WORK_POOL", "CKPT_STACK_DIR")}


def stack_cli(*args: str, timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.stack", *args], cwd=REPO,
                          env={**_clean_env(), **(env or {})}, capture_output=True, text=True, timeout=timeout)


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
    assert res[f"{root}/a"]["deferred"] is None and res[f"{root}/a"]["deleted_chunks"] > 0  # no save beside it
    assert res[f"{root}/team/b"]["kept_steps"] == [2]
    assert sorted(p.name for p in (root / "a" / "manifests").iterdir()) == ["2.json", "4.json"]
    with Checkpointer(str(root / "a")) as ck:  # what is kept still restores, bit for bit
        assert torch.equal(ck.restore(2)["w"], torch.full((4096,), 2.0))
        assert ck.verify(4) == []
    assert gc_store(str(tmp_path / "empty"), dry_run=True) == []


def test_database_urls_are_parsed_and_a_bad_one_is_one_error(tmp_path):
    """The server's database URL as SQLAlchemy parses it: postgres(ql):// gets the async driver, the
    password is masked where the URL is shown, and a value that is no URL - or whose password has a
    bare "@", which would make its end the host - is one error naming the variable and the fix, with
    no part of the password (before: passed on to the server as it was)."""
    from deployments.stack import _masked, database_url

    url = database_url({"DATABASE_URL": "postgres://u:p%40ss@db:5432/prefect"})
    assert url == "postgresql+asyncpg://u:p%40ss@db:5432/prefect"
    assert _masked(url) == "postgresql+asyncpg://u:***@db:5432/prefect"
    assert database_url({}, sqlite_path=tmp_path / "p.db") == f"sqlite+aiosqlite:///{tmp_path}/p.db"
    for bad in ("prefect:hunter2@db/prefect", "postgresql://prefect:hunter2@db:port/prefect",
                "postgresql://prefect:hun@ter2@db/prefect"):
        with pytest.raises(ValueError, match=r"PREFECT_SERVER_DATABASE_CONNECTION_URL is not a database URL.*%40"):
            database_url({"PREFECT_SERVER_DATABASE_CONNECTION_URL": bad})
        with pytest.raises(ValueError) as refused:
            database_url({"DATABASE_URL": bad})
        assert "DATABASE_URL" in str(refused.value) and "ter2" not in str(refused.value)


# --------------------------------------------------------------------------- PostgreSQL, a webhook receiver

class Postgres:
    """A throwaway PostgreSQL cluster on a free loopback port (Debian's postgresql binaries). Root cannot
    run postgres: as root the cluster belongs to the ``postgres`` system user (``runuser``)."""

    def __init__(self):
        self.bindir = _pg_bindir()
        self.dir = Path(tempfile.mkdtemp(prefix="ckpt-test-pg-"))
        self.port = free_port()
        self.password = f"pw{uuid.uuid4().hex}"
        self.user = "postgres" if os.geteuid() == 0 else None
        if self.user:
            shutil.chown(self.dir, self.user)
        pwfile = self.dir / "pw"
        pwfile.write_text(self.password + "\n")
        if self.user:
            shutil.chown(pwfile, self.user)
        self._run("initdb", "-D", str(self.dir / "data"), "-U", "prefect", "--auth=scram-sha-256",
                  f"--pwfile={pwfile}", "-E", "UTF8")
        pwfile.unlink()
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w", "-t", "60", "-o",
                  f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir}", "start")
        self.psql("CREATE DATABASE prefect", db="postgres")

    @property
    def url(self) -> str:
        return f"postgresql://prefect:{self.password}@127.0.0.1:{self.port}/prefect"

    def _run(self, tool: str, *args: str) -> str:
        cmd = [str(self.bindir / tool), *args]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=self.dir)
        assert res.returncode == 0, f"{' '.join(cmd)}: {res.stdout}{res.stderr}"
        return res.stdout

    def psql(self, sql: str, db: str = "prefect") -> str:
        res = subprocess.run([str(self.bindir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "prefect",
                              "-d", db, "-tA", "-c", sql], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PGPASSWORD": self.password})
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _pg_bindir() -> Path | None:
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / "initdb").exists():
            return d
    found = shutil.which("initdb")
    return Path(found).parent if found else None


class Webhook(ThreadingHTTPServer):
    """Collects every POST it receives: (path, JSON body or text)."""

    def __init__(self):
        self.received: list[tuple[str, object]] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(h):  # noqa: N805
                body = h.rfile.read(int(h.headers.get("Content-Length") or 0)).decode(errors="replace")
                try:
                    parsed: object = json.loads(body)
                except ValueError:
                    parsed = body
                self.received.append((h.path, parsed))
                h.send_response(200)
                h.end_headers()

            def log_message(h, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/hook"

    def wait_for(self, what: str, timeout: float = 90, where=lambda body: True) -> dict:
        """The first notification of automation ``what`` whose body ``where`` accepts."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, body in self.received:
                if isinstance(body, dict) and body.get("ckpt") == what and where(body):
                    return body
            time.sleep(0.5)
        raise AssertionError(f"no {what} notification within {timeout:.0f} s; received {self.received}")


# --------------------------------------------------------------------------- the stack

@pytest.fixture(scope="module")
def webhook():
    server = Webhook()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def postgres():
    if _pg_bindir() is None:
        yield None  # the stack falls back to SQLite; test_postgres_holds_the_server_state says why it skips
        return
    pg = Postgres()
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, postgres):
    d = tmp_path_factory.mktemp("stack")
    t0 = time.monotonic()
    env = {"DATABASE_URL": postgres.url} if postgres else {}
    up = stack_cli("up", "--dir", str(d), "--api-port", str(free_port()), "--s3-port", "0", "--filer-port", "0",
                   "--reports-port", "0", "--poll-seconds", "1", "--timeout", "150", env=env)
    info = Stack(d).info()
    try:
        assert up.returncode == 0, f"stack up failed:\n{up.stdout}\n{up.stderr}"
        info["up_output"] = up.stdout + up.stderr
        info["up_seconds"] = time.monotonic() - t0
        info["postgres"] = postgres
        yield info
    finally:
        stack_cli("down", "--dir", str(d), "--grace", "3")  # no-op if the last test stopped it


def test_up_answers_and_tells_where_everything_is(stack):
    out = stack["up_output"]
    for what in (stack["ui_url"], stack["api_url"], stack["s3_endpoint"], "checkpoints", stack["logs"],
                 "PREFECT_API_URL", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 stack["env_file"], f"set -a; . {stack['env_file']}; set +a"):  # (the stack is outside the cwd)
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
    # No secret in what the commands print (terminals and CI logs keep it): before, `up` printed
    # `export AWS_SECRET_ACCESS_KEY=<the admin secret>`.
    for secret in (stack["env"]["AWS_SECRET_ACCESS_KEY"], stack["reader"][1]):
        assert secret not in out and secret not in st.stdout + st.stderr
    status = json.loads(st.stdout)
    assert all(s["answers"] and s["running"] for s in status["services"].values()), status["services"]
    for name in ("prefect-server.log", "worker.log", "seaweedfs.log"):
        assert (Path(stack["logs"]) / name).exists()
    assert "checkpoints" in [b["Name"] for b in s3_client(stack).list_buckets()["Buckets"]]
    # Flow runs of the pool do not pipe their output to the worker (they must outlive it).
    with _api(stack) as api:
        template = api.client.read_work_pool(stack["pool"]).base_job_template
        assert template["variables"]["properties"]["stream_output"]["default"] is False
    # A second `up` of a running stack is a no-op.
    again = stack_cli("up", "--dir", stack["dir"], "--api-port", str(stack["api_port"]))
    assert again.returncode == 0 and "already running" in again.stdout
    assert stack["s3_http_base"] == f"http://127.0.0.1:{stack['reports_port']}/buckets"  # the report server
    # Every port the stack's processes listen on is one the docs name (docs/security.md says how each is closed).
    import psutil

    listening = set()
    for pid in stack_processes(stack["stack_id"]):
        with contextlib.suppress(psutil.Error):
            listening |= {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
                          if c.status == psutil.CONN_LISTEN}
    named = {stack["api_port"], stack["reports_port"], *stack["seaweedfs_ports"].values()}
    assert listening == named, f"ports nobody named: {listening - named}; named but closed: {named - listening}"


def test_every_file_holding_a_secret_is_this_users_only(stack):
    """The S3 secrets and the API's password are the stack's own (random, not the source code's), and
    every file holding one is 0600 in a 0700 folder (before: .stack/env, stack.json and
    seaweedfs/s3.json were 0644); no log holds one."""
    from deployments.local_services import ADMIN_SECRET, READER_SECRET

    secrets = [stack["env"]["AWS_SECRET_ACCESS_KEY"].encode(), stack["reader"][1].encode(),
               stack["env"]["PREFECT_API_AUTH_STRING"].split(":", 1)[1].encode()]  # the API's password
    assert ADMIN_SECRET.encode() not in secrets and READER_SECRET.encode() not in secrets
    holding = []
    root = Path(stack["dir"])
    files = [f for f in root.rglob("*") if f.is_file() and not f.is_symlink() and f.stat().st_size < 50_000_000
             and "data" not in f.relative_to(root).parts]  # (SeaweedFS's volumes: the bucket's objects)
    for f in files:
        if any(x in f.read_bytes() for x in secrets):
            holding.append(f.relative_to(root).as_posix())
            assert f.stat().st_mode & 0o777 == 0o600, (f, oct(f.stat().st_mode))
            for folder in [f.parent, *f.parent.parents]:
                if folder == root.parent:
                    break
                assert folder.stat().st_mode & 0o777 == 0o700, (folder, oct(folder.stat().st_mode))
    assert {"env", "stack.json", "seaweedfs/s3.json"} <= set(holding), holding
    logs = [h for h in holding if h.startswith("logs/") or h.endswith(".log")]
    assert not logs, f"a log holds a secret: {logs}"  # (the output of `up` is checked by the test above)
    assert (root / "seaweedfs" / "tls" / "key.pem").stat().st_mode & 0o777 == 0o600
    assert (root / "seaweedfs" / "security.toml").stat().st_mode & 0o777 == 0o600


def test_postgres_holds_the_server_state(stack):
    pg = stack["postgres"]
    if pg is None:
        pytest.skip("PostgreSQL's initdb is not installed (apt-get install postgresql; .ci/run does): the stack "
                    "ran on SQLite")
    assert stack["database"].startswith("postgresql+asyncpg://prefect:***@127.0.0.1:"), stack["database"]
    assert int(pg.psql("SELECT count(*) FROM work_pool WHERE name = 'local-pool'")) == 1
    # the password is in no file of the stack's but its private database-url, nor in what `up` printed
    assert pg.password not in stack["up_output"]
    for f in Path(stack["dir"]).rglob("*"):
        if f.is_file() and f.name != "database-url" and f.stat().st_size < 50_000_000:
            assert pg.password.encode() not in f.read_bytes(), f
    assert oct((Path(stack["dir"]) / "prefect" / "database-url").stat().st_mode & 0o777) == "0o600"


def test_deploy_registers_typed_deployments(stack, webhook):
    res = deploy_cli(Path(stack["dir"]), "--watchdog-timeout", str(WATCHDOG["timeout_s"]), "--watchdog-poll",
                     str(WATCHDOG["poll_s"]), "--keeper-within", str(KEEPER_WITHIN_S), "--webhook", webhook.url)
    assert res.returncode == 0, res.stdout + res.stderr
    with _api(stack) as api:
        deps = {d["name"]: d for d in api.deployments()}
        assert {"train", "validate", "gc", "watchdog"} <= set(deps), res.stdout
        train = api.deployment("train-run/train")
        assert train["work_pool_name"] == stack["pool"]
        assert train["parameters"]["params"]["store"] == stack["store"] == "s3://checkpoints/runs"
        assert all(d["job_variables"] == {"stream_output": False} for d in deps.values())
        defs = train["parameter_openapi_schema"]["definitions"]
        props = defs["TrainParams"]["properties"]
        assert props["rounds"]["type"] == "integer" and props["store"]["description"]
        # typed sub-forms, and no credentials field in the form
        assert defs["ValidationThresholds"]["properties"]["max_rel_change"]["type"] == "number"
        assert "run_id" in defs["StartFrom"]["properties"] and "storage_options" not in props
        gc = api.deployment("gc-store/gc")
        assert gc["parameters"]["store"] == stack["store"]
        assert gc["parameter_openapi_schema"]["properties"]["keep_last"]["minimum"] == 1
        assert gc["schedules"] and not any(s["active"] for s in gc["schedules"])  # --schedules-inactive
        validate = api.deployment("validate-checkpoint/validate")
        assert validate["parameters"]["run_url"] == stack["store"] + "/"
        watchdog = api.deployment("watchdog/watchdog")
        limit = watchdog.get("concurrency_limit") or (watchdog.get("global_concurrency_limit") or {}).get("limit")
        assert limit == 1 and not watchdog["schedules"], watchdog
        assert watchdog["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"
        assert watchdog["parameters"]["duration_s"] == 0 and watchdog["parameters"]["timeout_s"] == 8
        automations = {a.name for a in api.client.read_automations()}
        assert {"ckpt-watchdog-keeper", "ckpt-notify-validation-failed", "ckpt-notify-watchdog-gave-up",
                "ckpt-notify-run-not-completed"} <= automations, automations
        # the long-lived watchdog runs (started by deploy); deploying again starts no second one
        run = _wait_state(api, _only_live_watchdog(api)["id"], "RUNNING", 120)
        stack["watchdog_run"] = run["id"]
    again = deploy_cli(Path(stack["dir"]), "--only", "watchdog", "--watchdog-timeout", "8", "--watchdog-poll", "1",
                       "--keeper-within", str(KEEPER_WITHIN_S))
    assert again.returncode == 0 and "already running" in again.stdout, again.stdout + again.stderr


def test_the_api_answers_only_the_stacks_credentials(stack):
    """Every call of the Prefect API without the stack's credentials is refused (401: before, any local
    process could): reading the deployments, running gc-store (which deletes checkpoints), registering
    a flow and a deployment (whose code the worker would run); a wrong password or another scheme too.
    With them each works. What stays open: the API's health and readiness probes and the UI's own
    settings (which tell the UI to ask for a login); the credentials are never printed."""
    import base64

    import httpx

    auth = stack["env"].get("PREFECT_API_AUTH_STRING") or ""
    user, _, password = auth.partition(":")
    assert user and len(password) >= 24, "the stack has no credentials of its own"
    with _api(stack) as api:
        gc = api.deployment("gc-store/gc")
    later = {"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": "2100-01-01T00:00:00Z"}}}
    calls = [("GET", "/admin/version", None), ("POST", "/deployments/filter", {}),
             ("POST", f"/deployments/{gc['id']}/create_flow_run", later),
             ("POST", "/flows/", {"name": "planted"}),
             ("POST", "/deployments/", {"name": "planted", "flow_id": gc["flow_id"], "entrypoint": "x:planted",
                                        "work_pool_name": stack["pool"]})]
    basic = base64.b64encode(auth.encode()).decode()
    refused = [{}, {"Authorization": "Basic " + base64.b64encode(f"{user}:wrong".encode()).decode()},
               {"Authorization": "Bearer " + password}, {"Authorization": "Basic " + basic[:-4]}]
    with httpx.Client(base_url=stack["api_url"], timeout=30) as http:
        for headers in refused:
            for method, path, body in calls:
                r = http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers.keys(), r.status_code, r.text[:200])
        assert http.get("/health").json() is True and http.get("/ready").status_code == 200
        ok = {"Authorization": "Basic " + basic}
        created = {}
        for method, path, body in calls:
            r = http.request(method, path, json=body, headers=ok)
            assert r.status_code in (200, 201), (method, path, r.status_code, r.text[:300])
            created[path] = r.json()
        run = created[f"/deployments/{gc['id']}/create_flow_run"]
        assert run["deployment_id"] == gc["id"] and run["state_type"] == "SCHEDULED"
        for path in (f"/flow_runs/{run['id']}", f"/deployments/{created['/deployments/']['id']}",
                     f"/flows/{created['/flows/']['id']}"):  # nothing of this test stays behind
            assert http.delete(path, headers=ok).status_code == 204, path
    with urllib.request.urlopen(f"{stack['ui_url']}/ui-settings", timeout=10) as r:
        assert json.load(r)["auth"] == "BASIC"  # the UI shows its login form
    st = stack_cli("status", "--dir", stack["dir"], "--json")
    for shown in (stack["up_output"], st.stdout + st.stderr):
        assert password not in shown and basic not in shown
    assert json.loads(st.stdout)["env"]["PREFECT_API_AUTH_STRING"].startswith("***")
    # our clients, without the credentials or with wrong ones: one error naming what to set
    env = {**_clean_env(), "PREFECT_API_URL": stack["api_url"]}
    env.pop("PREFECT_API_AUTH_STRING", None)
    for cmd, extra in ((["deployments.client", "run", "gc-store/gc"], {}),
                       (["deployments.deploy", "--only", "gc"], {"PREFECT_API_AUTH_STRING": f"{user}:wrong"})):
        res = subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, env={**env, **extra}, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
        assert "refused" in res.stderr and "set PREFECT_API_AUTH_STRING" in res.stderr, res.stderr


def test_a_killed_worker_is_started_again_by_the_stack(stack):
    """kill -9 of the worker and no command typed: the stack's supervisor starts another within seconds,
    which polls the pool (a heartbeat after the kill, in the API) and picks up a flow run created after
    the kill (before: it stayed Late until someone ran `make stack`). The restart is in the supervisor's
    log."""
    st = Stack(stack["dir"])
    old = st.pid("worker")
    assert old and _running(old)
    os.kill(old, signal.SIGKILL)
    t_kill, t0 = time.time(), time.monotonic()
    with _api(stack) as api:
        fr = api.run_deployment("gc-store/gc", {"store": f"{stack['store']}/no-such-run", "dry_run": True},
                                name=f"test-after-kill-{uuid.uuid4().hex[:6]}")
        while not _beat_after(api, stack, t_kill):
            assert time.monotonic() - t0 < 60, f"no worker polls the pool 60 s after the kill\n{logs_tail(stack)}"
            time.sleep(0.5)
        polling_s = time.monotonic() - t0
        new = st.pid("worker")
        assert new != old and _running(new), (old, new)
        fr = api.wait(fr["id"], timeout=240)
        picked_s = time.monotonic() - t0
        assert fr["state_type"] == "COMPLETED", f"{fr['state_name']}: {fr['state']['message']}\n{logs_tail(stack)}"
    log = (Path(stack["logs"]) / "supervisor.log").read_text()
    assert f"worker (pid {old}) exited: killed by SIGKILL" in log and f"started worker (pid {new})" in log, log
    assert polling_s < 30, f"a worker polled again only {polling_s:.1f} s after the kill"
    print(f"worker killed: another one polled the pool {polling_s:.1f} s after the kill; a run created after "
          f"the kill completed {picked_s:.1f} s after it")


def test_training_run_on_the_worker(stack):
    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    with _api(stack) as api:
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
        assert {f"runs/{run_id}/manifests/{i}.json" for i in range(FINAL + 1)} <= set(keys), keys
        assert any(k.startswith(f"runs/{run_id}/chunks/") for k in keys)
        verdict = json.loads(
            s3.get_object(Bucket="checkpoints", Key=f"runs/{run_id}/validations/1.json")["Body"].read())
        assert verdict["passed"], verdict

        # Artifacts in Prefect: the validation verdicts, the run's checkpoints, a progress bar per shard attempt.
        arts = api.artifacts(fr["id"])
        by_key: dict = {}
        for a in arts:
            by_key.setdefault(a["key"], []).append(a)
        tables = [a for k, v in by_key.items() if k and k.startswith("ckpt-validation-") and
                  not k.endswith(("-report", "-link")) for a in v]
        rows = [row for a in tables for row in json.loads(a["data"])]
        assert {r["step"] for r in rows} == set(range(FINAL + 1)) and all(r["verdict"] == "passed" for r in rows)
        assert f"train-{run_id}" in by_key
        progress = [a for a in arts if a["type"] == "progress"]
        assert len(progress) == SMALL["shards"] * SMALL["rounds"] and all(a["data"] == 100.0 for a in progress)

        # Every report is one click away: links (not s3:// text) that open over the stack's HTTP.
        report = f"{stack['s3_http_base']}/checkpoints/runs/{run_id}/reports/1/index.html"
        links = [a["data"] for a in arts if a["type"] == "markdown" and a["key"] and a["key"].endswith("-link")]
        assert any(f"]({report})" in link for link in links), links
        md = next(a["data"] for a in arts if a["key"] and a["key"].endswith("-report") and "step 1" in a["data"])
        assert f"]({report})" in md and "](" + report.replace("/1/index.html", "/index.html") + ")" in md, md
        summary = by_key[f"train-{run_id}-summary"][0]["data"]
        assert f"({stack['s3_http_base']}/checkpoints/runs/{run_id}/reports/index.html)" in summary, summary
        for page in ("1/index.html", "1/tensors.html", "1/parts.html", "index.html"):
            html = _get(report.replace("1/index.html", page))
            assert not re.findall(r"""(?:src|href)=["']https?://""", html), f"{page} fetches from elsewhere"
            for target in re.findall(r"""(?:src|href)=["']([^"'#]+)["']""", html):  # every link works
                with urllib.request.urlopen(urllib.parse.urljoin(report.replace("1/index.html", page), target),
                                            timeout=10) as r:
                    assert r.status == 200, (page, target)
        assert "PASSED" in _get(report)
    print(f"training run {run_id}: {seconds:.1f} s from trigger to Completed")
    stack["run_id"] = run_id
    stack["digest"] = digest(stack, run_id)


def test_the_supervisor_starts_its_command_again_with_backoff_and_stops_cleanly(tmp_path):
    """deployments/supervisor.py alone (what runs the stack's worker): kill -9 of its command -> started
    again after the first delay; a command that dies at once waits twice as long each time, up to the
    longest delay; SIGTERM -> the command gets it, nothing is started again, the supervisor exits 0."""
    pid_file, log = tmp_path / "cmd.pid", tmp_path / "supervisor.log"
    cmd = ["sh", "-c", f"test -e {tmp_path}/die && exit 3; exec sleep 60"]
    sup = subprocess.Popen([sys.executable, str(REPO / "deployments" / "supervisor.py"), "--name", "sleeper",
                            "--pid-file", str(pid_file), "--log", str(log), "--output", str(tmp_path / "out.log"),
                            "--backoff", "0.2", "--max-backoff", "0.8", "--stable", "30", "--", *cmd])

    def next_pid(old: int | None) -> int:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError, ValueError):
                pid = int(pid_file.read_text())
                if pid != old and _running(pid):
                    return pid
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.05)

    try:
        first = next_pid(None)
        os.kill(first, signal.SIGKILL)
        t0 = time.monotonic()
        second = next_pid(first)
        again_s = time.monotonic() - t0
        (tmp_path / "die").touch()
        os.kill(second, signal.SIGKILL)
        deadline = time.monotonic() + 10  # 0.4, 0.8, 0.8: exits at once, each after a longer delay
        while log.read_text().count("starting it again in") < 4:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        (tmp_path / "die").unlink()
        third = next_pid(second)
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=15) == 0
    finally:
        sup.kill()
    assert not _running(third) and not pid_file.exists()
    text = log.read_text()
    delays = [float(d) for d in re.findall(r"starting it again in ([0-9.]+) s", text)]
    assert delays[:4] == [0.2, 0.4, 0.8, 0.8] and "exit code 3" in text, text
    assert f"sleeper (pid {first}) exited: killed by SIGKILL" in text and text.rstrip().endswith(
        f"sleeper (pid {third}) stopped: killed by SIGTERM"), text  # nothing started after the stop
    assert again_s < 2, f"started again {again_s:.1f} s after the kill (first delay 0.2 s)"


def test_the_report_server_is_up_only_when_it_answers_on_its_port(tmp_path):
    """Another process holding the report server's port (CI saw a browser get SeaweedFS's gRPC bytes
    there: weed had picked the port after the stack had) fails the start, named, instead of making a
    stack whose report links answer garbage; on a free port the same start answers."""
    stack = Stack(tmp_path / "stack")
    (stack.dir / "logs").mkdir(parents=True)
    info = {"stack_id": uuid.uuid4().hex, "host": "127.0.0.1", "bucket": "checkpoints", "prefix": "runs",
            "reader": ["ckpt-reader", "unused"], "s3_endpoint": "http://127.0.0.1:9"}
    with socket.socket() as other:  # not a report server, but it accepts connections
        other.bind(("127.0.0.1", 0))
        other.listen()
        info["reports_port"] = port = other.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"report server exited(.|\n)*cannot listen on 127.0.0.1:{port}"):
            stack._start("reports", info, timeout=60)
    info["reports_port"] = free_port()
    stack._start("reports", info, timeout=60)
    try:
        assert _status("HEAD", f"http://127.0.0.1:{info['reports_port']}/buckets/checkpoints/runs/") == 404
    finally:
        stack._procs["reports"].kill()
        stack._procs["reports"].wait()


def test_the_report_server_serves_reports_read_only_and_nothing_else(stack):
    """Reports over HTTP, and only them: GET and HEAD of a report answer; a manifest, a chunk, a verdict,
    another bucket or a path climbing out of reports/ is 404; PUT, POST and DELETE are 405, and the
    objects are untouched. SeaweedFS's own filer, which served every object and took PUT (201) and
    DELETE (204) from any local process, speaks only HTTPS to the stack's own certificate (400 to plain
    HTTP; every door of SeaweedFS without it: tests/test_local_services.py)."""
    run_id = _need(stack, "run_id")
    base = f"{stack['s3_http_base']}/checkpoints/runs/{run_id}"
    assert _status("GET", f"{base}/reports/1/index.html") == 200
    assert _status("HEAD", f"{base}/reports/index.html") == 200
    assert _status("GET", f"{base}/reports/1/") == 200  # a folder: its index.html
    for path in ("manifests/1.json", "validations/1.json", "heartbeats/coordinator.json", "reports/../manifests/1.json",
                 "reports/%2e%2e/manifests/1.json", "reports/manifests/1.json", "ckptlib.json"):
        assert _status("GET", f"{base}/{path}") == 404, path
    assert _status("GET", f"{stack['s3_http_base']}/other-bucket/runs/{run_id}/reports/index.html") == 404
    before = s3_client(stack).get_object(Bucket="checkpoints", Key=f"runs/{run_id}/manifests/1.json")["Body"].read()
    for method in ("PUT", "POST", "DELETE", "PATCH"):
        assert _status(method, f"{base}/manifests/1.json", b"{}") == 405, method
        assert _status(method, f"{base}/reports/index.html", b"x") == 405, method
    filer = f"http://127.0.0.1:{stack['filer_port']}/buckets/checkpoints/runs/{run_id}"
    # HTTPS only: Go answers 400 to plain HTTP it recognises (GET, PUT, POST) and hangs up on the rest (DELETE)
    for method, body in (("GET", None), ("PUT", b"{}"), ("POST", b"{}"), ("DELETE", None)):
        assert _plain_refused(method, f"{filer}/manifests/1.json", body), method
    assert _plain_refused("PUT", f"{filer}/manifests/99.json", b"{}")
    s3 = s3_client(stack)
    assert s3.get_object(Bucket="checkpoints", Key=f"runs/{run_id}/manifests/1.json")["Body"].read() == before
    assert not keys_under(s3, "checkpoints", f"runs/{run_id}/manifests/99.json")
    with pytest.raises(Exception, match="Access Denied|AccessDenied|denied"):  # the server's own identity reads only
        _reader(stack).put_object(Bucket="checkpoints", Key=f"runs/{run_id}/reports/planted.html", Body=b"x")


def test_prefect_cli_runs_the_documented_parameters_and_a_diverging_run_fails(stack, webhook):
    """`prefect deployment run train-run/train --param params='{...}'`, the documented form: the fields
    given go over the deployment's (before: the whole object was replaced and the run trained with the
    flow's defaults, a local ./runs, and showed green). The run diverges (lr 1e30): its checkpoints are
    in the bucket, its validate task run and the flow run end Failed with one message naming the step,
    the check and the last healthy step, and both notifications arrive, typed and with HTTP links."""
    run_id = f"div-{uuid.uuid4().hex[:8]}"
    given = {"shards": 1, "rounds": 2, "steps_per_round": 2, "lr": 1e30, "run_id": run_id,
             "validation_runner": "threads"}
    prefect, env = str(Path(sys.executable).parent / "prefect"), {**_clean_env(), **stack["env"]}
    wrong = subprocess.run([prefect, "deployment", "run", "train-run/train", "--param", "rounds=2"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)  # not a field of the form: loud
    assert wrong.returncode != 0 and "not found on the deployment" in wrong.stdout + wrong.stderr, wrong.stdout
    res = subprocess.run(
        [prefect, "deployment", "run", "train-run/train",
         "--param", f"params={json.dumps(given)}", "--watch", "--watch-timeout", "400"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=450)
    assert res.returncode != 0, res.stdout[-3000:] + res.stderr[-3000:]  # --watch fails on a Failed run
    assert not (REPO / "runs" / run_id).exists()
    keys = keys_under(s3_client(stack), "checkpoints", f"runs/{run_id}/manifests/")
    assert f"runs/{run_id}/manifests/1.json" in keys, keys  # the deployment's store: the bucket
    with _api(stack) as api:
        fr = next(r for r in api.flow_runs(api.deployment("train-run/train")["id"]) if r["name"] == f"train-{run_id}")
        assert fr["state_type"] == "FAILED", fr["state"]
        message = fr["state"]["message"]
        assert "step 1 failed validation" in message and "no_nan" in message, message
        assert "the last healthy step is 0: resume from it" in message, message
        typed = fr["parameters"]["params"]  # what was typed (the CLI sends 1e30 as an int); the run merged the rest
        assert {**typed, "lr": float(typed["lr"])} == given, typed
        validate = next(t for t in api.task_runs(fr["id"]) if t["name"] == "validate-step-1")
        assert validate["state_type"] == "FAILED" and "no_nan" in validate["state"]["message"], validate["state"]
    # every committed step is validated, newest first: step 1's notification comes, maybe after step 2's
    what = webhook.wait_for("ckpt-notify-validation-failed",
                            where=lambda b: run_id in b["what"]["run"] and b["what"]["step"] == 1)["what"]
    assert what["step"] == 1 and "no_nan" in what["failed"], what  # typed: an int, a list
    assert what["report"].startswith("http://") and _status("GET", what["report"]) == 200, what
    ended = webhook.wait_for("ckpt-notify-run-not-completed", where=lambda b: b["what"]["flow_run"] == fr["name"])
    assert ended["what"]["state"] == "Failed" and "step 1 failed validation" in ended["what"]["message"], ended
    assert ended["what"]["url"].endswith(f"/runs/flow-run/{fr['id']}"), ended


def test_a_killed_worker_takes_no_run_with_it_and_one_command_restarts_it(stack):
    """kill -9 of the worker and of its supervisor (so nothing starts it again) while a run the worker
    started trains: the run completes with the clean digest; `stack status` says the worker is dead
    (though the API still lists it ONLINE); `stack up` starts the worker (under a supervisor) alone
    again, leaving the server, S3 and the run alone."""
    clean = _need(stack, "digest")
    run_id = f"workerkill-{uuid.uuid4().hex[:8]}"
    st = Stack(stack["dir"])
    server_pid, worker_pid, supervisor_pid = st.pid("server"), st.pid("worker"), st.pid("supervisor")
    with _api(stack) as api:
        fr = api.run_deployment("train-run/train", {"params": {**QUICK, "rounds": FINAL + 1, "run_id": run_id}},
                                name=f"test-{run_id}")
        _wait_state(api, fr["id"], "RUNNING", 180)
        _wait_key(stack, f"runs/{run_id}/heartbeats/coordinator.json")  # it trains
        os.kill(supervisor_pid, signal.SIGKILL)
        os.kill(worker_pid, signal.SIGKILL)
        t_kill = time.monotonic()
        status = json.loads(stack_cli("status", "--dir", stack["dir"], "--json").stdout)
        assert not status["running"] and not status["services"]["worker"]["running"]
        assert not status["services"]["supervisor"]["running"]
        assert status["services"]["worker"]["api_status"] == "ONLINE"  # what the API still believes
        text = stack_cli("status", "--dir", stack["dir"]).stdout
        assert "worker" in text and "DEAD" in text and "make stack" in text, text
        up = stack_cli("up", "--dir", stack["dir"])
        assert up.returncode == 0, up.stdout + up.stderr
        assert "started again worker;" in up.stdout, up.stdout  # the worker alone
        restarted_s = time.monotonic() - t_kill
        assert st.pid("server") == server_pid and st.pid("worker") != worker_pid
        assert st.pid("supervisor") != supervisor_pid
        status = st.status()  # what `status --json` prints (its output is checked above and in the first test)
        assert status["running"], status["services"]
        fr = api.wait(fr["id"], timeout=300)
        assert fr["state_type"] == "COMPLETED", f"{fr['state_name']}: {fr['state']['message']}\n{logs_tail(stack)}"
        assert fr["run_count"] == 1  # it went on, it was not run again
    assert digest(stack, run_id) == clean
    print(f"worker killed: the run completed; the worker answered again {restarted_s:.1f} s after the kill")


def test_hang_drill_through_the_stack(stack):
    """Shard 0 of a run hangs (no beats, no steps, its thread alive). The long-lived watchdog fences it
    within its timeout and reruns it; the run completes with the clean digest, and its fenced task run
    says what happened and links the watchdog's flow run."""
    clean = _need(stack, "digest")
    run_id = f"drill-{uuid.uuid4().hex[:8]}"
    with _api(stack) as api:
        t0 = time.monotonic()
        fr = api.run_deployment("train-run/train", {"params": {**QUICK, "run_id": run_id,
                                                               "chaos": ["hang:shard=0,round=1"]}},
                                name=f"test-{run_id}")
        fr = api.wait(fr["id"], timeout=400)
        seconds = time.monotonic() - t0
        assert fr["state_type"] == "COMPLETED", f"{fr['state_name']}: {fr['state']['message']}\n{logs_tail(stack)}"
        s3 = s3_client(stack)
        fence = json.loads(s3.get_object(Bucket="checkpoints", Key=f"runs/{run_id}/fences/shard-0/1")["Body"].read())
        strike = json.loads(s3.get_object(Bucket="checkpoints", Key=f"runs/{run_id}/chaos/shard-0.r1.a1.json")
                            ["Body"].read())
        latency = fence["detected"] - strike["time"]
        assert latency < WATCHDOG["timeout_s"] + 3 * WATCHDOG["poll_s"] + 5, fence  # within the timeout, not minutes
        assert fence["by_flow_run_id"] == _live_watchdog(stack, api)
        assert digest(stack, run_id) == clean
        hung = next(t for t in api.task_runs(fr["id"]) if t["name"] == "shard-0-round-1")
        assert hung["state_type"] == "CANCELLED" and hung["state_name"] == "Fenced", hung["state"]
        assert "rerun-shard-0-round-1-g1" in hung["state"]["message"] and "watchdog" in hung["state"]["message"]
        note = next(a["data"] for a in api.artifacts(fr["id"]) if a["task_run_id"] == hung["id"]
                    and a["type"] == "markdown")
        assert f"/runs/flow-run/{stack['watchdog_run']})" in note, note
        reruns = [t["name"] for t in api.task_runs(stack["watchdog_run"]) if t["name"].startswith("rerun-shard-0")]
        assert reruns == ["rerun-shard-0-round-1-g1"], reruns
    print(f"hang drill {run_id}: fenced {latency:.1f} s after the strike (timeout {WATCHDOG['timeout_s']} s); "
          f"completed in {seconds:.1f} s with the clean digest")


# --- the UI in a real browser (tests/browser.py) ------------------------------------------------------
# What a user does, click by click: open the UI (3.9 serves the V2 UI at ``/v2``), log in (the
# stack's API takes no call without its credentials, so the UI shows its login form: a wrong
# password is refused, the stack's ``PREFECT_API_AUTH_STRING`` lets the user in), go to Deployments,
# open ``train``, Run > Custom run, check the typed form (descriptions, the store defaulting to the
# stack's bucket), set a small run, submit, follow "View run", come back once the run is Completed,
# open its Artifacts tab, find the validation artifact and open it (verdict "passed"). Every SPA path
# answers 200 with the same index.html, so every check is on rendered text. Screenshots of each step
# go to ``test-output/ui/``. On this module's stack since 2026-12-07: a stack of their own cost 19
# CPU-seconds more (its server 12.8, worker 2.0, S3 1.7, deploy 2.8) and 32 s of setup.

UI_RUN_TIMEOUT_S = 300


@pytest.fixture
def page(stack, tmp_path):
    with browser.open_page(tmp_path / "chromium-profile") as pg:
        yield pg


def test_start_a_training_run_from_the_ui_and_find_its_validation(stack, page):
    sync_api = browser.need_browser()
    expect = sync_api.expect
    run_id = f"ui-{uuid.uuid4().hex[:8]}"
    run_name = f"ui-test-{run_id}"
    try:
        # 1. The UI's front door redirects to the V2 app, which asks for a login; once in, Deployments
        # lists the training deployment.
        page.goto(stack["ui_url"] + "/")
        page.wait_for_url(re.compile(r".*/v2/.*"))
        browser.log_in(page, stack, expect, wrong_first=True)
        page.get_by_role("link", name="Deployments", exact=True).first.click()
        train_link = page.get_by_role("link", name="train", exact=True)
        expect(train_link).to_be_visible()
        expect(page.get_by_text("train-run", exact=True).first).to_be_visible()
        browser.shot(page, "01-deployments")

        # 2. The deployment page: flow, pool; Run > Custom run opens the typed form.
        train_link.click()
        expect(page.get_by_text("local-pool").first).to_be_visible()
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Custom run").click()
        store = page.get_by_label("Store (Optional)", exact=True)
        expect(store).to_have_value(stack["store"])  # the stack's bucket is the default
        expect(page.get_by_text("Where runs live:").first).to_be_visible()  # field descriptions render
        # ... whole: a placeholder in angle brackets was taken for an HTML tag ("checkpoints are at /.")
        expect(page.get_by_text("checkpoints are at store/run_id, e.g.").first).to_be_visible()
        expect(page.get_by_text("(heartbeats/shard-N.json for shard N)").first).to_be_visible()
        expect(page.get_by_label("Rounds (Optional)", exact=True)).to_have_value("8")
        # typed sub-forms, filled in: the validation thresholds (no free dict), start from a checkpoint
        expect(page.get_by_label("Max Rel Change (Optional)", exact=True)).to_have_value("10")
        expect(page.get_by_text("Start from a chosen committed checkpoint").first).to_be_visible()
        expect(page.get_by_text("Storage Options", exact=True)).to_have_count(0)  # secrets go in a Secret block
        page.get_by_label("Run Name", exact=True).fill(run_name)
        page.get_by_label("Shards (Optional)", exact=True).fill("1")
        page.get_by_label("Steps Per Round (Optional)", exact=True).fill("2")
        page.get_by_label("Rounds (Optional)", exact=True).fill("1")
        run_id_field = page.locator("xpath=//label[normalize-space()='Run Id (Optional)']"
                                    "/ancestor::div[contains(concat(' ', @class, ' '), ' group ')][1]")
        run_id_field.get_by_role("tab", name="str", exact=True).click()  # the str | None field: choose str
        run_id_field.locator("fieldset input, fieldset textarea").first.fill(run_id)
        browser.shot(page, "02-run-form")
        page.get_by_label("Max Rel Change (Optional)", exact=True).scroll_into_view_if_needed()
        browser.shot(page, "02-run-form-thresholds", full_page=False)
        browser.submit(page, sync_api)

        # 3. The toast links to the new run; its page shows the run until it is Completed.
        expect(page.get_by_text(f"{run_name} scheduled to start now")).to_be_visible()
        page.get_by_role("link", name="View run").first.click()
        page.wait_for_url(re.compile(r".*/runs/flow-run/[0-9a-f-]{36}.*"))
        flow_run_id = re.search(r"/flow-run/([0-9a-f-]{36})", page.url).group(1)
        # train-run names its runs train-<run id> once it starts; before that the name given in the form
        shown_name = re.compile(rf"^({re.escape(run_name)}|train-{re.escape(run_id)})$")
        expect(page.get_by_text(shown_name).first).to_be_visible()
        # Wait for the run through the API on a blank page: a running run's page redraws its graph (a
        # WebGL canvas, drawn in software here) all the time, which cost 12 CPU-seconds of a loaded
        # 2-core machine per run; then its page again, as a user comes back to it.
        run_url = page.url
        page.goto("about:blank")
        with _api(stack) as api:
            fr = api.wait(flow_run_id, timeout=UI_RUN_TIMEOUT_S)
        if fr["state_type"] != "COMPLETED":
            log = (Path(stack["logs"]) / "worker.log").read_text(errors="replace")[-4000:]
            pytest.fail(f"the run ended {fr['state_type']}: {fr['state']['message']}\n{log}")
        page.goto(run_url)
        expect(page.get_by_text("Completed", exact=True).first).to_be_visible()
        page.wait_for_load_state("networkidle")
        browser.shot(page, "03-run-completed")
        # Its task runs (the graph is a canvas: read the Task Runs tab): shards, cut, validations.
        page.get_by_role("tab", name="Task Runs").click()
        for name in ("shard-0-round-1", "validate-step-0", "validate-step-1"):
            expect(page.get_by_text(name, exact=True).first).to_be_visible(timeout=30_000)

        # 4. Artifacts tab: the validation verdict of each checkpoint, keyed per run.
        page.get_by_role("tab", name="Artifacts").click()
        cards = page.get_by_role("link").filter(has_text="ckpt-validation-").filter(has_text="TABLE")
        expect(cards.first).to_be_visible()
        expect(page.get_by_text(re.compile(r"Validation of checkpoint step 1 of s3://checkpoints/runs/" + run_id))
               .first).to_be_visible()
        browser.shot(page, "04-run-artifacts")

        # The report is one click away: the "-link" artifact (a markdown artifact holding one link:
        # Prefect's create_link_artifact) opens the HTML report over the stack's report server.
        link = page.get_by_role("link").filter(has_text="-link").filter(has_text="LINK").first
        expect(link).to_be_visible()

        # 5. The validation artifact itself: a table whose verdict is "passed".
        cards.filter(has_text="step 1").first.click()
        page.wait_for_url(re.compile(r".*/artifacts/artifact/.*"))
        expect(page.get_by_text("verdict", exact=True).first).to_be_visible()
        expect(page.get_by_role("cell", name="passed", exact=True).first).to_be_visible()
        expect(page.get_by_text(shown_name).first).to_be_visible()  # linked to our flow run
        expect(page.get_by_text("validate-step-1", exact=True).first).to_be_visible()  # ... and its task run
        browser.shot(page, "05-validation-artifact")

        # 6. Its HTML report, as a browser gets it from the stack (no network: nothing from a CDN).
        report = f"{stack['s3_http_base']}/checkpoints/runs/{run_id}/reports/1/index.html"
        outside: list[str] = []
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(
            ("http://127.0.0.1", "data:", "about:")) else None)
        page.goto(report)
        expect(page.get_by_text("Checkpoint step 1: PASSED")).to_be_visible()
        browser.shot(page, "06-report")
        page.get_by_role("link", name="Great Expectations Data Docs: tensors suite").click()
        expect(page.get_by_text("Expectation Validation Result").first).to_be_visible()
        browser.shot(page, "07-data-docs", full_page=False)
        page.get_by_role("link", name="Home").first.click()  # back to the step's report, not a 404
        expect(page.get_by_text("Checkpoint step 1: PASSED")).to_be_visible()
        page.goto(report.replace("1/index.html", "index.html"))
        expect(page.get_by_text("Checkpoints of").first).to_be_visible()
        browser.shot(page, "08-report-index")
        assert not outside, f"the reports fetched from elsewhere: {outside}"
    except BaseException:
        browser.record_failure(page)
        raise

    # The same run through the API: the UI did start it, on the stack's pool, and it wrote to S3.
    with _api(stack) as api:
        fr = api.flow_run(flow_run_id)
        assert shown_name.match(fr["name"]) and fr["state_type"] == "COMPLETED"
        assert fr["parameters"]["params"]["run_id"] == run_id and fr["parameters"]["params"]["rounds"] == 1
        keys = {a["key"] for a in api.artifacts(flow_run_id)}
        assert any(k and k.startswith("ckpt-validation-") for k in keys), keys
    (browser.OUT / "run.json").write_text(json.dumps({"flow_run_id": flow_run_id, "run_id": run_id}, indent=2))


def test_a_fenced_shard_shows_on_the_training_run(stack, page):
    """A run whose shard hangs (started through the API): on its page, the hung shard's task run is
    Fenced (not a green Completed), says by whom and which rerun took over, and its artifact links
    the watchdog's flow run."""
    sync_api = browser.need_browser()
    expect = sync_api.expect
    run_id = f"ui-hang-{uuid.uuid4().hex[:8]}"
    with _api(stack) as api:
        fr = api.run_deployment("train-run/train", {"params": {"shards": 1, "rounds": 1, "steps_per_round": 2,
                                                               "run_id": run_id, "chaos": ["hang:shard=0,round=1"],
                                                               "validation_runner": "threads"}})
        fr = api.wait(fr["id"], timeout=UI_RUN_TIMEOUT_S)
        assert fr["state_type"] == "COMPLETED", fr["state"]
    try:
        page.goto(f"{stack['ui_url']}/v2/runs/flow-run/{fr['id']}")
        browser.log_in(page, stack, expect)  # then the UI goes on to the page asked for
        page.wait_for_url(re.compile(rf".*/runs/flow-run/{fr['id']}.*"))
        expect(page.get_by_text("Completed", exact=True).first).to_be_visible()
        page.wait_for_load_state("networkidle")
        browser.shot(page, "09-fenced-run-graph")
        page.get_by_role("tab", name="Task Runs").click()
        expect(page.get_by_text("Fenced", exact=True).first).to_be_visible()
        browser.shot(page, "10-fenced-task-runs")
        page.get_by_role("link", name="shard-0-round-1", exact=True).first.click()
        page.wait_for_url(re.compile(r".*/runs/task-run/.*"))
        expect(page.get_by_text(re.compile("fenced by watchdog@")).first).to_be_visible()
        page.get_by_role("tab", name="Artifacts").click()
        # the tab shows each artifact as a card with its description; the card opens the markdown
        page.get_by_text(re.compile(r"round 1 fenced and rerun")).first.click()
        expect(page.get_by_text("Fenced by the watchdog").first).to_be_visible()
        browser.shot(page, "11-fenced-task-run")
    except BaseException:
        browser.record_failure(page)
        raise


def test_a_dead_run_is_resumed_by_the_watchdog(stack, webhook):
    """kill -9 of a training run's flow-run process (that process alone) after step 0: every process
    it started ends with it (before: its validation worker, 585 MB, and a resource tracker lived on
    until `make stack-down`); the watchdog finds its coordinator silent, marks the flow run and its
    task runs Crashed, and starts the deployment again with resume; that run says which one it
    continues (tags, its summary artifact) and completes with the clean digest. The crash is notified."""
    import psutil

    clean = _need(stack, "digest")
    run_id = f"dead-{uuid.uuid4().hex[:8]}"
    with _api(stack) as api:
        # more rounds than the clean run (rounds are not part of the trajectory): still training when killed
        fr = api.run_deployment("train-run/train", {"params": {**SMALL, "rounds": FINAL + 2, "run_id": run_id}},
                                name=f"test-{run_id}")
        _wait_key(stack, f"runs/{run_id}/manifests/0.json")
        pid = _flow_run_pid(stack, fr["id"])
        deadline = time.monotonic() + 60
        while not (children := psutil.Process(pid).children(recursive=True)):  # the validation worker, ...
            assert time.monotonic() < deadline, "the flow-run process started no validation worker"
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        _, alive = psutil.wait_procs(children, timeout=20)
        assert not alive, [" ".join(p.cmdline())[:100] for p in alive]
        deadline = time.monotonic() + 120
        resumed = []
        while not resumed and time.monotonic() < deadline:
            time.sleep(0.5)
            resumed = [r for r in api.flow_runs(fr["deployment_id"]) if r["id"] != fr["id"]
                       and r["parameters"]["params"].get("run_id") == run_id]
        assert resumed, f"no resumed run within 120 s of the kill\n{logs_tail(stack)}"
        started_s = time.monotonic() - t_kill
        assert resumed[0]["parameters"]["params"]["resume"] is True
        new = api.wait(resumed[0]["id"], timeout=300)
        done_s = time.monotonic() - t_kill
        assert new["state_type"] == "COMPLETED", f"{new['state_name']}: {new['state']['message']}\n{logs_tail(stack)}"
        old = api.flow_run(fr["id"])
        assert old["state_type"] == "CRASHED", old["state"]
        # its task runs end too: at once, or at the watchdog's later sweeps for states Prefect's
        # task-run recorder wrote after the first one (flows/resume.py RESWEEP_AFTER_S)
        until = t_kill + max(RESWEEP_AFTER_S) + 30
        while live := [t["name"] for t in api.task_runs(fr["id"]) if t["state_type"] in ("RUNNING", "PENDING")]:
            if time.monotonic() >= until:
                trs = [t for t in api.task_runs(fr["id"]) if t["name"] in live]
                hist = {t["name"]: [(x.type.value, x.timestamp, x.message) for x in
                                    api.client.read_task_run_states(uuid.UUID(t["id"]))] for t in trs}
                logs = api.client.read_logs(LogFilter(level=LogFilterLevel(ge_=20)), limit=40,
                                            sort=LogSort.TIMESTAMP_DESC)
                msgs = "\n".join(f"{x.timestamp} {x.message[:200]}" for x in logs)
                raise AssertionError(f"task runs of the dead run still live: {live}\nstates: {hist}\nlogs:\n{msgs}")
            time.sleep(0.5)
        # the new run links the one it continues: tags, and its summary artifact (a link to its page)
        assert "resumed" in new["tags"] and f"resumes:{fr['id'][:8]}" in new["tags"], new["tags"]
        summary = next(a["data"] for a in api.artifacts(new["id"]) if a["key"] == f"train-{run_id}-summary")
        assert "continues flow run" in summary and f"/runs/flow-run/{fr['id']})" in summary, summary
        assert not [p for p in stack_processes(Stack(stack["dir"]).info()["stack_id"])
                    if psutil.Process(p).environ().get("PREFECT__FLOW_RUN_ID") == fr["id"]]
    assert digest(stack, run_id) == clean
    print(f"dead run {run_id}: resumed run created {started_s:.1f} s after the kill, completed {done_s:.1f} s "
          f"after it, with the clean digest")
    body = webhook.wait_for("ckpt-notify-run-not-completed", where=lambda b: b["what"]["flow_run"] == old["name"])
    assert body["event"] == "prefect.flow-run.Crashed" and body["what"]["state"] == "Crashed", body


def test_retry_of_a_failed_run_resumes_it(stack):
    """A run whose shard crashes with no retries left fails after step 0; Retry (what the UI's button
    does: AwaitingRetry) runs the same flow run again, which resumes instead of refusing the run id."""
    clean = _need(stack, "digest")
    run_id = f"retry-{uuid.uuid4().hex[:8]}"
    with _api(stack) as api:
        fr = api.run_deployment("train-run/train", {"params": {
            **QUICK, "run_id": run_id, "shard_retries": 0, "chaos": ["crash:shard=0,round=2"]}}, name=f"test-{run_id}")
        fr = api.wait(fr["id"], timeout=300)
        assert fr["state_type"] == "FAILED", fr["state"]
        api.set_state(fr["id"], "SCHEDULED", "Retry from the UI", name="AwaitingRetry")
        fr = api.wait(fr["id"], timeout=300)
        assert fr["state_type"] == "COMPLETED", f"{fr['state_name']}: {fr['state']['message']}\n{logs_tail(stack)}"
        assert fr["run_count"] == 2
        plan = next(t for t in api.task_runs(fr["id"]) if t["name"].startswith("plan-run")
                    and t["state_type"] == "COMPLETED")
        logs = api.client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[uuid.UUID(plan["id"])])), limit=50)
        assert any("resuming from healthy step" in entry.message or "recomputed identically" in entry.message
                   for entry in logs), [entry.message for entry in logs]
    assert digest(stack, run_id) == clean


def test_the_keeper_starts_a_killed_watchdog_again(stack):
    """kill -9 of the long-lived watchdog's process: no sign of life for the keeper's window -> its flow
    run is marked Crashed and another watchdog runs. The window (KEEPER_WITHIN_S) passes while the
    next two tests run (a re-validation, gc: neither needs the watchdog);
    test_the_keeper_marked_the_killed_watchdog_crashed_and_another_runs checks what the keeper did."""
    _need(stack, "watchdog_run")
    with _api(stack) as api:
        old = _live_watchdog(stack, api)
    pid = _flow_run_pid(stack, old)
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    stack["killed_watchdog"] = (old, time.monotonic())


def test_failed_revalidation_notifies_and_its_index_agrees(stack, webhook):
    """The validate deployment, with thresholds no checkpoint meets (the typed sub-form), fails step 1 of
    the clean run: a webhook notification, and the run's report index says failed in its table and in
    its plot (drawn with it), while step 1 had passed before."""
    run_id = _need(stack, "run_id")
    index = f"{stack['s3_http_base']}/checkpoints/runs/{run_id}/reports/index.html"
    assert _red_pixels(_get_bytes(index.replace("index.html", "run.png"))) == 0
    with _api(stack) as api:
        fr = api.run_deployment("validate-checkpoint/validate", {
            "run_url": f"{stack['store']}/{run_id}", "step": 1, "thresholds": {"max_norm": 1e-9}})
        fr = api.wait(fr["id"], timeout=300)
        assert fr["state_type"] == "FAILED" and "step 1 failed validation" in fr["state"]["message"], fr["state"]
    # every committed step is validated, newest first: step 1's notification comes, maybe after step 2's
    what = webhook.wait_for("ckpt-notify-validation-failed",
                            where=lambda b: run_id in b["what"]["run"] and b["what"]["step"] == 1)["what"]
    assert what["step"] == 1 and isinstance(what["failed"], list) and what["failed"], what  # typed: an int, a list
    assert what["report"].startswith("http://") and _status("GET", what["report"]) == 200, what
    html = _get(index)
    assert re.search(r"<td>1</td><td class='fail'>failed</td>", html), html
    assert _red_pixels(_get_bytes(index.replace("index.html", "run.png"))) > 0  # the plot shows it red too
    with _api(stack) as api:  # the gave-up notification (its event as the watchdog sends it)
        api.emit_event("ckpt.watchdog.gave-up", {"prefect.resource.id": "ckpt.shard.r.shard-0"},
                       payload={"run": "r", "part": "shard-0", "reason": 'reruns of round 2 "died" 3 times'})
    what = webhook.wait_for("ckpt-notify-watchdog-gave-up")["what"]
    assert what["part"] == "shard-0" and "died" in what["reason"], what


def test_gc_deployment_through_the_cli(stack):
    """`prefect deployment run` (the CLI a user types) of gc-store/gc on the run just trained."""
    run_id = _need(stack, "run_id")
    env = {**_clean_env(), **stack["env"]}
    res = subprocess.run(
        [str(Path(sys.executable).parent / "prefect"), "deployment", "run", "gc-store/gc",
         "--param", f"store={stack['store']}/{run_id}", "--param", "keep_last=1",
         "--param", "grace_seconds=0", "--watch", "--watch-timeout", "240"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + logs_tail(stack)
    keys = keys_under(s3_client(stack), "checkpoints", f"runs/{run_id}/manifests/")
    assert keys == [f"runs/{run_id}/manifests/{FINAL}.json"], keys  # step 0 dropped, the newest (healthy) kept


def test_the_keeper_marked_the_killed_watchdog_crashed_and_another_runs(stack):
    """The second half of test_the_keeper_starts_a_killed_watchdog_again, once its window has passed."""
    old, t_kill = _need(stack, "killed_watchdog")
    with _api(stack) as api:
        _wait_state(api, old, "CRASHED", 120)
        crashed_s = time.monotonic() - t_kill
        new = _wait_state(api, _only_live_watchdog(api, exclude=old)["id"], "RUNNING", 120)
        running_s = time.monotonic() - t_kill
        cancelled = [r for r in api.flow_runs(new["deployment_id"]) if r["state_type"] == "CANCELLED"]
    stack["watchdog_run"] = new["id"]
    print(f"keeper: the killed watchdog was marked Crashed {crashed_s:.1f} s after the kill (window "
          f"{KEEPER_WITHIN_S} s), another one ran {running_s:.1f} s after it; {len(cancelled)} cancelled runs")


def test_down_leaves_nothing_running(stack):
    info = Stack(stack["dir"]).info()
    pids = [Stack(stack["dir"]).pid(s) for s in ("server", "seaweedfs", "supervisor", "worker")]
    assert all(pids) and stack_processes(info["stack_id"])
    supervisor_log = Path(stack["logs"]) / "supervisor.log"
    starts = supervisor_log.read_text().count("started worker")
    res = stack_cli("down", "--dir", stack["dir"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no process of it is left" in res.stdout
    assert supervisor_log.read_text().count("started worker") == starts  # no restart during down
    assert stack_processes(info["stack_id"]) == []
    assert not [p for p in pids if _running(p)]
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    assert stack["dir"] not in ps, ps
    assert not any(f":{stack['api_port']}" in line and "prefect" in line for line in ps.splitlines()), ps
    for port in (stack["api_port"], stack["s3_port"], stack["filer_port"], stack["reports_port"]):
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
    again = stack_cli("down", "--dir", stack["dir"])
    assert again.returncode == 0


def test_make_stack_and_deploy_reuse_a_venv_that_runs_the_project(tmp_path):
    """`make deploy` (and `make stack`) with a venv that runs the project but has no `.installed`
    stamp use it as it is (before: pip installed everything again into it); VENV= names another."""
    for f in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / f, tmp_path / f)
    venv = tmp_path / "elsewhere" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # this test's environment
    (venv / "python").chmod(0o755)
    res = subprocess.run(["make", "deploy", f"VENV={venv.parent}", "DEPLOY_ARGS=--list"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=_clean_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert "pip install" not in res.stdout + res.stderr and f"using {venv.parent} as it is" in res.stdout, res.stdout
    assert "flows.train.train_run" in res.stdout and not (venv.parent / ".installed").exists()


# --------------------------------------------------------------------------- helpers

def _api(stack: dict) -> PrefectAPI:
    """A client of the stack's API, with the stack's credentials."""
    return PrefectAPI(stack["api_url"], auth=stack["env"].get("PREFECT_API_AUTH_STRING"))


def _beat_after(api: PrefectAPI, stack: dict, since: float) -> bool:
    """The stack's worker is ONLINE with a heartbeat sent after ``since`` (wall time)."""
    record = next((w for w in api.client.read_workers_for_work_pool(stack["pool"]) if w.name == stack["worker_name"]),
                  None)
    return record is not None and record.status.value == "ONLINE" and record.last_heartbeat_time is not None \
        and record.last_heartbeat_time.timestamp() > since

def _need(stack: dict, key: str):
    if key not in stack:
        pytest.skip(f"needs {key} from an earlier test of this module")
    return stack[key]


def digest(stack: dict, run_id: str, step: int = FINAL) -> str:
    body = s3_client(stack).get_object(Bucket="checkpoints", Key=f"runs/{run_id}/manifests/{step}.json")["Body"]
    return document_json(body.read())["digest"]


def _status(method: str, url: str, body: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _plain_refused(method: str, url: str, body: bytes | None = None) -> bool:
    """Whether a plain-HTTP request to an HTTPS-only port is refused: 400, or a hang-up with no answer."""
    import http.client

    try:
        return _status(method, url, body) == 400
    except (http.client.RemoteDisconnected, ConnectionResetError):
        return True


def _reader(stack: dict):
    """An S3 client with the stack's read-only identity (the report server's)."""
    import boto3

    return boto3.client("s3", endpoint_url=stack["s3_endpoint"], region_name="us-east-1",
                        aws_access_key_id=stack["reader"][0], aws_secret_access_key=stack["reader"][1])


def _get(url: str) -> str:
    return _get_bytes(url).decode()


def _get_bytes(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _red_pixels(png: bytes) -> int:
    """Pixels of the plot's "failed" red (#c62828)."""
    import io

    import numpy as np
    from matplotlib.image import imread

    img = (imread(io.BytesIO(png), format="png")[..., :3] * 255).round().astype(int)
    return int((np.abs(img - np.array([0xC6, 0x28, 0x28])).sum(axis=-1) < 30).sum())


def _wait_state(api: PrefectAPI, flow_run_id: str, state_type: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    run = api.flow_run(flow_run_id)
    while run["state_type"] != state_type:
        assert time.monotonic() < deadline, f"flow run {run['name']} is {run['state_name']}, not {state_type}"
        time.sleep(0.5)
        run = api.flow_run(flow_run_id)
    return run


def _only_live_watchdog(api: PrefectAPI, exclude: str | None = None, timeout: float = 120) -> dict:
    dep = api.deployment("watchdog/watchdog")
    deadline = time.monotonic() + timeout
    while True:
        live = [r for r in api.flow_runs(dep["id"]) if r["state_type"] in ("SCHEDULED", "PENDING", "RUNNING")
                and r["id"] != exclude]
        if live:
            assert len(live) == 1, [(r["name"], r["state_name"]) for r in live]
            return live[0]
        assert time.monotonic() < deadline, "no watchdog run"
        time.sleep(0.5)


def _live_watchdog(stack: dict, api: PrefectAPI) -> str:
    """The id of the running long-lived watchdog, kept in ``stack``. It is the one deploy started unless
    the keeper replaced it (a busy machine that missed its signs of life): said, not failed on."""
    run = _wait_state(api, _only_live_watchdog(api)["id"], "RUNNING", 120)
    if run["id"] != stack["watchdog_run"]:
        print(f"the keeper had replaced watchdog run {stack['watchdog_run']} by {run['id']}")
        stack["watchdog_run"] = run["id"]
    return run["id"]


def _wait_key(stack: dict, key: str, timeout: float = 240) -> None:
    s3 = s3_client(stack)
    deadline = time.monotonic() + timeout
    while not keys_under(s3, "checkpoints", key):
        assert time.monotonic() < deadline, f"{key} did not appear within {timeout:.0f} s\n{logs_tail(stack)}"
        time.sleep(0.2)


def _flow_run_pid(stack: dict, flow_run_id: str) -> int:
    """The pid of the flow-run process (it carries the stack's marker and its flow run id)."""
    import psutil

    deadline = time.monotonic() + 30  # Prefect reports Running from inside the process: it exists by then
    while True:
        for pid in stack_processes(Stack(stack["dir"]).info()["stack_id"]):
            try:
                p = psutil.Process(pid)
                if (p.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id
                        and "prefect.engine" in " ".join(p.cmdline())):
                    return pid
            except psutil.Error:
                continue
        assert time.monotonic() < deadline, f"no process of flow run {flow_run_id}"
        time.sleep(0.5)
