"""The local stack: a Prefect server, a SeaweedFS S3 server, a process work pool and its worker.

    python -m deployments.stack up     [--dir .stack] [--api-port 4200] [--s3-port 8333] ...
    python -m deployments.stack status [--dir .stack] [--json]
    python -m deployments.stack down   [--dir .stack] [--purge]

(``make stack`` / ``make stack-down`` call these.) Contract:

* ``up`` starts, on loopback and in the background, each service as its own process (own session,
  so a Ctrl-C in the terminal does not reach them), and returns only when every one answers:
  the Prefect API (``GET /api/health``), S3 (a signed ListBuckets), the worker (a heartbeat in its
  pool, through the API). It creates the bucket (``checkpoints``) and the process work pool
  (``local-pool``), writes ``<dir>/stack.json`` (everything below, machine-readable) and
  ``<dir>/env`` (``. .stack/env`` exports what a client needs), and prints where everything is.
  If any service fails to start, ``up`` stops what it started, prints the log tail, exits 1.
  ``up`` on a stack that is already running prints its status and exits 0.
* Database: SQLite at ``<dir>/prefect/prefect.db``, unless ``PREFECT_SERVER_DATABASE_CONNECTION_URL``
  or ``DATABASE_URL`` is set (``postgresql://...`` becomes ``postgresql+asyncpg://...``).
* Ports: the API on ``PREFECT_SERVER_API_HOST``:``PREFECT_SERVER_API_PORT`` (default 127.0.0.1:4200)
  or ``--host``/``--api-port``; the server gets them as *environment* settings, not only CLI
  flags, so the UI (``/ui-settings``) calls the port it is served from. S3 on ``--s3-port``
  (default 8333; 0 picks a free port). A port in use is an error naming the fix.
* Telemetry is off everywhere (``PREFECT_SERVER_ANALYTICS_ENABLED=false``, ``DO_NOT_TRACK=1``,
  weed ``-master.telemetry=false``). Inherited ``PREFECT_*`` and ``AWS_*`` variables of the calling
  shell are not passed to the services: the stack is self-contained.
* The worker (and every flow run it starts) sees ``PREFECT_API_URL``, ``PREFECT_API_AUTH_STRING`` and
  the S3 variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), so flows
  reach the API and the bucket (plain ``s3://checkpoints/...`` URLs) with no credentials in parameters.
* The API takes the stack's credentials only: the server runs with ``PREFECT_SERVER_API_AUTH_STRING``
  (Prefect's basic auth, ``ckpt:<random>``), and answers 401 to every call without it but ``GET
  /api/health`` and ``/api/ready``; clients send ``PREFECT_API_AUTH_STRING`` (in ``env``); the UI
  shows a login form. A stack made before it had credentials runs on without them.
* The worker runs under a supervisor (``deployments/supervisor.py``, service ``supervisor``) that
  starts it again whenever it dies, after 1 s, doubling up to 60 s for one that keeps dying; each
  start and death is a line of ``supervisor.log``. ``worker.pid`` is the worker's own pid (the
  supervisor writes it at each start). ``down`` stops the supervisor first, so it starts nothing more.
* Every process of the stack carries ``CKPT_STACK_ID=<uuid of this stack>`` in its environment,
  and so does everything they start (flow-run processes run in sessions of their own). ``down``
  stops the services (pid files ``<dir>/*.pid``; a pid is trusted only if its process carries the
  marker, so a recycled pid is never signalled), then every remaining process with the marker:
  SIGTERM, ``--grace`` seconds, SIGKILL. It exits 0 only when no process of the stack is left.
  Data (database, bucket) stays for the next ``up``; ``--purge`` deletes ``<dir>``.
* Logs, all in ``<dir>/logs/``: ``prefect-server.log``, ``worker.log``, ``supervisor.log``, ``seaweedfs.log``.
* Reports over HTTP: the stack's own report server (``deployments/report_server.py``, service
  ``reports``, ``--reports-port``, default 8888, on the stack's host) serves the validation reports,
  and nothing else, read-only, as ``http://127.0.0.1:8888/buckets/<bucket>/<key>``
  (``s3://checkpoints/runs/<run>/reports/<step>/index.html``), reading them with the stack's
  read-only S3 identity. ``CKPT_S3_HTTP_BASE`` (in ``env``) is that base: ``s3://X/Y`` is at
  ``$CKPT_S3_HTTP_BASE/X/Y``.
* Doors: S3 (signed requests only) and the report server (GET and HEAD of reports only) are the
  stack's doors to the bucket. SeaweedFS's other ports (master, volume server, filer
  (``--filer-port``, default free), every gRPC port) answer only a peer holding the certificate of
  a CA made at each start (``SeaweedFS.start(locked=True)``, ``docs/security.md``).
* Secrets: the S3 admin and read-only identities and the API's password are random per stack (made by
  the ``up`` that starts it);
  every file holding one (``stack.json``, ``env``, ``seaweedfs/s3.json``, ``seaweedfs/security.toml``,
  ``seaweedfs/tls/key.pem``, ``prefect/database-url``) is 0600 and the stack's folder and its
  subfolders are 0700. No secret is ever printed (terminals and CI logs keep what they show): ``up``
  prints the path of ``env`` and the command that loads it, ``status --json`` masks the secrets, and
  none is in a command line (``ps`` shows those to every user): services get them in their environment.

Linux and macOS. Processes are psutil's (a dependency of the pipeline); the Prefect API is
Prefect's own client (``deployments/client.py``), imported only where the API is called, so ``down``
needs psutil alone; the database URL is SQLAlchemy's (``make_url``, which masks its password).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from deployments.local_services import prefect_cli

if TYPE_CHECKING:
    from deployments.client import PrefectAPI

DEFAULT_DIR = ".stack"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_API_PORT = 4200
DEFAULT_S3_PORT = 8333
DEFAULT_REPORTS_PORT = 8888
DEFAULT_FILER_PORT = 0  # internal (closed to any peer without the stack's certificate): any free port
DEFAULT_BUCKET = "checkpoints"
DEFAULT_PREFIX = "runs"
DEFAULT_POOL = "local-pool"
MARKER = "CKPT_STACK_ID"
AUTH_VAR = "PREFECT_API_AUTH_STRING"  # the API's credentials, user:password, as Prefect's clients read them
# Stop order (of the pid files). The supervisor first: once it is gone, nothing starts the worker again.
SERVICES = ("supervisor", "worker", "reports", "server", "seaweedfs")
RESTART_BACKOFF_S = (1.0, 60.0)  # the supervisor's first and longest delay before it starts the worker again


@dataclass(frozen=True)
class Service:
    """One service as ``up`` and ``restart`` name it: the process the stack starts for it (its pid file:
    the supervisor for the worker) and the ``Stack`` method that starts it and waits until it answers."""

    name: str
    process: str
    start: str


# In start order. The report server binds its port before SeaweedFS picks its own internal ports, so
# they cannot take it. "worker" is started as its supervisor, which starts it again whenever it dies.
SPECS = {s.name: s for s in (Service("server", "server", "_start_server"),
                             Service("reports", "reports", "_start_reports"),
                             Service("seaweedfs", "seaweedfs", "_start_seaweedfs"),
                             Service("worker", "supervisor", "_start_worker"))}
START_ORDER = tuple(SPECS)


# --------------------------------------------------------------------------- small helpers

def _log(msg: str) -> None:
    print(msg, flush=True)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _api(info: dict[str, Any], timeout: float = 30.0) -> PrefectAPI:  # a busy server is slow
    """Prefect's client of the stack's API, with the stack's credentials (none for a stack made before it
    had any)."""
    from deployments.client import PrefectAPI

    return PrefectAPI(info["api_url"], timeout=timeout, auth=info.get("env", {}).get(AUTH_VAR) or "")


def database_url(env: Mapping[str, str] | None = None, sqlite_path: Path | None = None) -> str:
    """The server's database: the configured URL (Postgres via asyncpg) or SQLite under the stack."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    given: Mapping[str, str] = os.environ if env is None else env
    name = next((n for n in ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "DATABASE_URL") if given.get(n)), None)
    if name is None:
        if sqlite_path is None:
            raise ValueError("no database URL configured and no SQLite path given")
        return f"sqlite+aiosqlite:///{sqlite_path}"
    try:
        url = make_url(given[name])
    except (ArgumentError, ValueError):  # (a message that may quote the URL, password and all)
        url = None
    if url is None or "@" in (url.host or ""):  # a bare "@" in the password: its end would be taken for the host
        raise ValueError(f"{name} is not a database URL: write it as postgresql://user:password@host:port/db "
                         "(an @ in the password as %40), or unset it for SQLite in the stack folder")
    if url.drivername in ("postgres", "postgresql"):  # Prefect's server needs the async driver
        url = url.set(drivername="postgresql+asyncpg")
    return url.render_as_string(hide_password=False)


def _masked(url: str) -> str:
    """``url`` with its password as ``***``: never print a database password."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


# --------------------------------------------------------------------------- processes

def _environ_of(pid: int) -> dict[str, str] | None:
    """Environment of process ``pid`` (None if gone or unreadable)."""
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return None


def _ancestors() -> set[int]:
    """This process and its ancestors: never signalled, even if they carry the marker."""
    return {os.getpid(), *(p.pid for p in psutil.Process().parents())}


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is gone for our purposes; one we may not look at, alive)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def stack_processes(stack_id: str) -> list[int]:
    """Pids of every live process carrying ``CKPT_STACK_ID=<stack_id>`` (not this one or its parents)."""
    mine = _ancestors()
    return sorted(p.pid for p in psutil.process_iter(["environ", "status"])
                  if p.pid not in mine and (p.info["environ"] or {}).get(MARKER) == stack_id
                  and p.info["status"] != psutil.STATUS_ZOMBIE)


def _owned(pid: int, stack_id: str) -> bool:
    env = _environ_of(pid)
    return env is not None and env.get(MARKER) == stack_id and _alive(pid)


def _terminate(pids: list[int], grace: float) -> list[int]:
    """SIGTERM ``pids``, wait up to ``grace`` s, SIGKILL the rest; return those still alive after that.
    (psutil signals a ``Process`` only while it is the process it was: a pid reused since is left alone.)"""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
            procs[-1].terminate()
        except psutil.NoSuchProcess:
            pass
    left = _wait_gone(procs, grace)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in _wait_gone(left, 10.0)]


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` still running after up to ``timeout`` s. A zombie is gone for us: ``wait_procs``
    alone waits until its parent reaps it, and an init that reaps orphans late (this container's: about
    once a second) would add that to every service ``down`` stops."""
    deadline = time.monotonic() + timeout
    left = procs
    while left:
        _, left = psutil.wait_procs(left, timeout=max(0.0, min(0.1, deadline - time.monotonic())))
        left = [p for p in left if _alive(p.pid)]
        if time.monotonic() >= deadline:
            break
    return left


# --------------------------------------------------------------------------- the stack

class Stack:
    """One stack folder: its config (``stack.json``), pid files, logs and data."""

    def __init__(self, directory: str | os.PathLike = DEFAULT_DIR):
        self.dir = Path(directory).absolute()
        self.logs = self.dir / "logs"
        self.info_path = self.dir / "stack.json"
        self.env_path = self.dir / "env"
        self._procs: dict[str, subprocess.Popen] = {}  # services this object started (to notice early exits)

    # ----------------------------------------------------------- state

    def info(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.info_path.read_text())
        except (OSError, ValueError):
            return None

    def pid_path(self, service: str) -> Path:
        return self.dir / f"{service}.pid"

    def _lives(self, service: str, stack_id: str) -> bool:
        """The process in ``service``'s pid file lives and is this stack's."""
        pid = self.pid(service)
        return bool(pid) and _owned(pid, stack_id)

    def pid(self, service: str) -> int | None:
        try:
            return int(self.pid_path(service).read_text().strip())
        except (OSError, ValueError):
            return None

    def status(self) -> dict[str, Any]:
        """Per service: pid, whether its process lives (``running``), whether it answers (``answers``:
        only a live process can); plus the URLs from stack.json. For the worker, ``api_status`` is what
        the API says (a killed worker stays ONLINE there until its heartbeats expire, about 90 s):
        ``answers`` needs both a live process and ONLINE. The supervisor answers when it lives."""
        info = self.info()
        if info is None:
            return {"dir": str(self.dir), "running": False, "services": {}}
        sid = info["stack_id"]
        services: dict[str, dict[str, Any]] = {}
        for name in SERVICES:
            pid = self.pid(name)
            services[name] = {"pid": pid, "running": bool(pid) and _owned(pid, sid)}
        services["server"]["answers"] = services["server"]["running"] and _api_healthy(info)
        services["seaweedfs"]["answers"] = services["seaweedfs"]["running"] and _tcp_open(
            info["host"], info["s3_port"])
        services["reports"]["answers"] = services["reports"]["running"] and _reports_answer(
            info["host"], info.get("reports_port") or 0)
        services["supervisor"]["answers"] = services["supervisor"]["running"]
        api_status = None
        if services["server"]["answers"]:
            with _api(info) as api:
                api_status = _worker_status(api, info["pool"], info["worker_name"])
        services["worker"]["api_status"] = api_status
        services["worker"]["answers"] = services["worker"]["running"] and api_status == "ONLINE"
        running = all(s["running"] and s["answers"] for s in services.values())
        return {**info, "dir": str(self.dir), "running": running, "services": services,
                "processes": stack_processes(sid)}

    # ----------------------------------------------------------- up

    def up(self, *, host: str = DEFAULT_HOST, api_port: int = DEFAULT_API_PORT, s3_port: int = DEFAULT_S3_PORT,
           filer_port: int = DEFAULT_FILER_PORT, reports_port: int = DEFAULT_REPORTS_PORT,
           bucket: str = DEFAULT_BUCKET, prefix: str = DEFAULT_PREFIX, pool: str = DEFAULT_POOL,
           worker_limit: int | None = None, poll_seconds: float = 5.0, timeout: float = 120.0) -> dict[str, Any]:
        """Start everything, or what is dead of a stack that partly runs; return the stack's info (as
        in stack.json). See the module docstring."""
        current = self.status()
        if current["running"]:
            _log(f"stack in {self.dir} is already running")
            return current
        if current.get("processes"):
            return self.repair(current, timeout=timeout)
        # Ports left to us are picked together, so no two coincide (one at a time, the OS may hand
        # out a port it just gave back).
        from deployments.local_services import _free_ports

        picked = iter(_free_ports(host, [s3_port, filer_port, reports_port].count(0)))
        s3_port, filer_port, reports_port = (p or next(picked) for p in (s3_port, filer_port, reports_port))
        for what, port, flag in (("Prefect API", api_port, "--api-port / PREFECT_SERVER_API_PORT"),
                                 ("S3", s3_port, "--s3-port"), ("SeaweedFS filer", filer_port, "--filer-port"),
                                 ("report server", reports_port, "--reports-port")):
            if not _port_free(host, port):
                raise RuntimeError(
                    f"{what} port {host}:{port} is already in use (another stack or Prefect server?): stop it "
                    f"(`make stack-down`, `prefect server stop`) or choose another port with {flag}")

        for sub in ("", "logs", "prefect", "seaweedfs"):  # this user's only: they hold its secrets
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir / sub, 0o700)
        (self.dir / ".gitignore").write_text("*\n")  # the stack folder never shows up in git status
        stack_id = uuid.uuid4().hex
        api_url = f"http://{host}:{api_port}/api"
        ui_url = f"http://{host}:{api_port}"
        db_url = database_url(sqlite_path=self.dir / "prefect" / "prefect.db")
        # The server's database URL may hold a password: kept for restarts in a file only we may read,
        # never in stack.json, env or the output.
        _write_private(self.db_url_path, db_url)

        import secrets

        # this stack's own identities: a secret written in the source code would be no secret
        admin = ("ckpt-admin", secrets.token_urlsafe(24))
        reader = ("ckpt-reader", secrets.token_urlsafe(24))
        s3_endpoint = f"http://{host}:{s3_port}"
        client_env = {  # what a client (a shell, the worker, a flow run) needs; written to <dir>/env
            "PREFECT_API_URL": api_url,
            AUTH_VAR: f"ckpt:{secrets.token_urlsafe(24)}",  # the server takes no call without it
            "PREFECT_UI_URL": ui_url,
            "AWS_ENDPOINT_URL": s3_endpoint,
            "AWS_ACCESS_KEY_ID": admin[0],
            "AWS_SECRET_ACCESS_KEY": admin[1],
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "CKPT_STORE": f"s3://{bucket}/{prefix}",
            "CKPT_S3_HTTP_BASE": f"http://{host}:{reports_port}/buckets",
            "CKPT_WORK_POOL": pool,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
        }
        info: dict[str, Any] = {
            "stack_id": stack_id, "dir": str(self.dir), "host": host,
            "api_port": api_port, "api_url": api_url, "ui_url": ui_url,
            "database": _masked(db_url), "s3_port": s3_port, "s3_endpoint": s3_endpoint,
            "filer_port": filer_port, "reports_port": reports_port,
            "s3_http_base": f"http://{host}:{reports_port}/buckets", "reader": list(reader), "prefix": prefix,
            "bucket": bucket, "store": f"s3://{bucket}/{prefix}", "pool": pool, "worker_name": worker_name(pool),
            "worker_limit": worker_limit, "poll_seconds": poll_seconds,
            "logs": str(self.logs), "env_file": str(self.env_path), "env": client_env,
        }
        started: list[str] = []
        try:
            # the server boots (imports, migrations) while SeaweedFS starts
            self._start("server", info, timeout, wait=False)
            started.append("server")
            self._start("reports", info, timeout)
            started.append("reports")
            self._start("seaweedfs", info, timeout)
            started.append("seaweedfs")
            self._write_info(info)  # its ports, for `down` and restarts
            self._wait_api(info, timeout)
            self._start("worker", info, timeout)
            started.append("worker")
        except BaseException:
            if started:
                self._write_info(info)  # so that down finds everything by its marker
                self.down(grace=3.0, quiet=True)
            raise
        self._write_info(info)
        return info

    def repair(self, current: dict[str, Any] | None = None, *, timeout: float = 120.0,
               restart: tuple[str, ...] = ()) -> dict[str, Any]:
        """Start again every service of this stack whose process is dead (and those in ``restart``,
        stopped first), with the stack's own settings (ports, database, bucket, pool); the others go
        on untouched, and so do flow runs in flight (their processes do not depend on the worker's).
        Returns the stack's info with ``restarted``: the services started."""
        current = current or self.status()
        info = self.info()
        if info is None:
            raise RuntimeError(f"no stack in {self.dir}: start one with `make stack`")
        for service in restart:
            for name in ("supervisor", "worker") if service == "worker" else (service,):
                pid = self.pid(name)
                if pid and _owned(pid, info["stack_id"]):
                    _log(f"stopping {name} (pid {pid})")
                    # SIGKILL on purpose for the worker: a worker that shuts down gracefully cancels the
                    # flow runs it started; killed, it leaves them running (they talk to the API themselves).
                    # Its supervisor first (killed, it does not pass the signal on), or it would start it again.
                    _terminate([pid], 0.0 if service == "worker" else 10.0)
        # a worker lives as long as its supervisor does: one that died is the supervisor's to start again
        dead = [s for s in START_ORDER if s in restart or not self._lives(SPECS[s].process, info["stack_id"])]
        if not dead:
            return {**current, "restarted": []}
        for service in dead:
            _log(f"starting {service} (its {SPECS[service].process if service == 'worker' else 'process'} is not "
                 "running)")
            self._start(service, info, timeout)
        self._write_info(info)
        return {**self.status(), "restarted": dead}

    # ----------------------------------------------------------- one service

    @property
    def db_url_path(self) -> Path:
        return self.dir / "prefect" / "database-url"

    def _base_env(self, info: dict[str, Any]) -> dict[str, str]:
        """The environment of every service: ours without client settings (the stack is self-contained),
        plus the stack's marker, no telemetry, and unbuffered output."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PREFECT_", "AWS_")) and k != "DATABASE_URL"}  # the server gets the DB URL
        env.update({MARKER: info["stack_id"], "DO_NOT_TRACK": "1", "PREFECT_HOME": str(self.dir / "prefect"),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1"})
        return env

    def _wait_api(self, info: dict[str, Any], timeout: float) -> None:
        with _api(info, timeout=2) as api:
            self._wait("Prefect API", api.healthy, timeout, "server", self.logs / "prefect-server.log")

    def _start(self, service: str, info: dict[str, Any], timeout: float, wait: bool = True) -> None:
        """Start one service of ``info``'s stack and (``wait``) wait until it answers."""
        if service not in SPECS:
            raise ValueError(f"unknown service {service!r}: one of {list(START_ORDER)}")
        getattr(self, SPECS[service].start)(info, timeout, wait)

    def _start_server(self, info: dict[str, Any], timeout: float, wait: bool) -> None:
        host = info["host"]
        try:
            db_url = self.db_url_path.read_text().strip()
        except OSError:  # a stack from before the file existed: SQLite unless the environment says otherwise
            db_url = database_url(sqlite_path=self.dir / "prefect" / "prefect.db")
        env = {**self._base_env(info), "PREFECT_SERVER_API_HOST": host,
               "PREFECT_SERVER_API_PORT": str(info["api_port"]),
               "PREFECT_SERVER_DATABASE_CONNECTION_URL": db_url, "PREFECT_UI_API_URL": info["api_url"]}
        if info["env"].get(AUTH_VAR):  # every call but /health and /ready needs it; the UI asks for it
            env["PREFECT_SERVER_API_AUTH_STRING"] = env[AUTH_VAR] = info["env"][AUTH_VAR]
        self._spawn("server", [*prefect_cli(), "server", "start", "--host", host, "--port",
                               str(info["api_port"])], env, self.logs / "prefect-server.log")
        if wait:
            self._wait_api(info, timeout)

    def _start_seaweedfs(self, info: dict[str, Any], timeout: float, wait: bool) -> None:
        from deployments.local_services import SeaweedFS

        env = info["env"]
        os.environ[MARKER] = info["stack_id"]  # its process inherits our environment: mark it
        try:
            s3 = SeaweedFS.start(self.dir / "seaweedfs", host=info["host"], s3_port=info["s3_port"], timeout=timeout,
                                 filer_port=info["filer_port"], ports=info.get("seaweedfs_ports"),
                                 admin=(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]),
                                 reader=tuple(info["reader"]) if info.get("reader") else s3_reader(), locked=True)
        finally:
            os.environ.pop(MARKER, None)
        self.pid_path("seaweedfs").write_text(str(s3.detach()))
        info["seaweedfs_ports"] = s3.ports
        link = self.logs / "seaweedfs.log"
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to(os.path.relpath(s3.log_path, self.logs))
        s3.create_bucket(info["bucket"])

    def _start_reports(self, info: dict[str, Any], timeout: float, wait: bool) -> None:
        host = info["host"]
        key, secret = info["reader"] if info.get("reader") else s3_reader()
        env = {**self._base_env(info), "AWS_ENDPOINT_URL": info["s3_endpoint"], "AWS_ACCESS_KEY_ID": key,
               "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
        self._spawn("reports", [sys.executable, "-m", "deployments.report_server", "--host", host,
                                "--port", str(info["reports_port"]), "--bucket", info["bucket"],
                                "--prefix", info.get("prefix") or DEFAULT_PREFIX],
                    env, self.logs / "reports.log", cwd=Path(__file__).resolve().parent.parent)
        # Its own answer, not just an open port: a port taken by another process (CI saw a browser
        # get SeaweedFS's gRPC bytes there) must fail the start, not make a stack with dead report links.
        self._wait("report server", lambda: _reports_answer(host, info["reports_port"]), timeout, "reports",
                   self.logs / "reports.log")

    def _start_worker(self, info: dict[str, Any], timeout: float, wait: bool = True) -> None:
        """The work pool (made if missing) and its worker, under a supervisor that starts it again
        whenever it dies (``deployments/supervisor.py``); wait until the worker polls the pool."""
        with _api(info) as api:
            self._start_supervised_worker(api, info, timeout)

    def _start_supervised_worker(self, api: PrefectAPI, info: dict[str, Any], timeout: float) -> None:
        pool = info["pool"]
        env = {**self._base_env(info), **info["env"]}
        ensure_process_pool(api, pool)
        orphan = self.pid("worker")  # a worker whose supervisor died: the new supervisor starts its own
        if orphan and _owned(orphan, info["stack_id"]):
            _terminate([orphan], 0.0)  # SIGKILL: its flow runs go on (see repair)
        cmd = [*prefect_cli(), "worker", "start", "--pool", pool, "--type", "process",
               "--name", info["worker_name"], "--install-policy", "never"]
        if info.get("worker_limit"):
            cmd += ["--limit", str(info["worker_limit"])]
        env["PREFECT_WORKER_QUERY_SECONDS"] = str(info.get("poll_seconds") or 5.0)
        first, longest = RESTART_BACKOFF_S
        # Run as a script (standard library only), so it works from whatever directory the worker runs in.
        supervisor = [sys.executable, str(Path(__file__).with_name("supervisor.py")), "--name", "worker",
                      "--pid-file", str(self.pid_path("worker")), "--log", str(self.logs / "supervisor.log"),
                      "--output", str(self.logs / "worker.log"), "--backoff", str(first),
                      "--max-backoff", str(longest), "--", *cmd]
        # The new worker's own heartbeat: the API still lists a worker killed a moment ago under the same
        # name as ONLINE, with a heartbeat that may be from the last second (CI saw `up` return before the
        # supervisor had started anything). So: a heartbeat newer than any before, from a worker that lives.
        since = max(time.time() - 1.0, _worker_beat_time(api, pool, info["worker_name"]) or 0.0)
        self.pid_path("worker").unlink(missing_ok=True)
        self._spawn("supervisor", supervisor, env, self.logs / "supervisor.log", cwd=Path.cwd())

        def started() -> bool:
            pid = self.pid("worker")
            return pid is not None and _owned(pid, info["stack_id"]) and \
                (_worker_beat_time(api, pool, info["worker_name"], online=True) or 0.0) > since

        self._wait("worker", started, timeout, "supervisor", self.logs / "worker.log")

    def _spawn(self, service: str, cmd: list[str], env: dict[str, str], log_path: Path,
               cwd: Path | None = None) -> None:
        with open(log_path, "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=cwd or self.dir, start_new_session=True)
        self.pid_path(service).write_text(str(proc.pid))
        self._procs[service] = proc

    def _wait(self, what: str, ready, timeout: float, service: str, log_path: Path) -> None:
        proc = self._procs.get(service)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode} while starting; "
                                   f"log {log_path}:\n{_tail(log_path)}")
            try:
                if ready():
                    return
            except Exception:  # noqa: BLE001 - not answering yet, whatever the probe raised
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{what} did not answer within {timeout:.0f} s; log {log_path}:\n{_tail(log_path)}")

    def _write_info(self, info: dict[str, Any]) -> None:
        """``stack.json`` and ``env``: both hold the S3 admin secret, so both are this user's only (0600)."""
        _write_private(self.info_path, json.dumps(info, indent=2))
        lines = ["# The local stack's client settings. Use them in a shell with:  . " + str(self.env_path),
                 f"# (written by `python -m deployments.stack up` for the stack in {self.dir})"]
        lines += [f"export {k}={_shell_quote(v)}" for k, v in info["env"].items()]
        _write_private(self.env_path, "\n".join(lines))

    # ----------------------------------------------------------- down

    def down(self, *, grace: float = 10.0, purge: bool = False, quiet: bool = False) -> list[int]:
        """Stop every process of the stack; return the pids still alive (empty on success)."""
        info = self.info()
        left: list[int] = []
        if info is not None:
            sid = info["stack_id"]
            # the supervisor first (nothing starts the worker again), the worker (no new runs), its runs,
            # the server, S3
            for service in SERVICES:
                pid = self.pid(service)
                if pid and _owned(pid, sid):
                    if not quiet:
                        _log(f"stopping {service} (pid {pid})")
                    # weed's graceful stop idles ~10 s; what S3 acknowledged is on disk already
                    left += _terminate([pid], min(grace, 3.0) if service == "seaweedfs" else grace)
                if service == "worker":
                    runs = stack_processes(sid)
                    runs = [p for p in runs if p not in {self.pid(s) for s in SERVICES}]
                    if runs:
                        if not quiet:
                            _log(f"stopping flow-run processes {runs}")
                        left += _terminate(runs, grace)
            stray = stack_processes(sid)  # anything else that carries the marker
            if stray:
                if not quiet:
                    _log(f"stopping leftover processes {stray}")
                left += _terminate(stray, grace)
            left = sorted(set(left) | set(stack_processes(sid)))
            for port in (info.get("seaweedfs_ports") or {}).values():  # weed's sockets, as SeaweedFS.stop does
                for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                    sock.unlink(missing_ok=True)
        for service in SERVICES:
            self.pid_path(service).unlink(missing_ok=True)
        if purge and not left and self.dir.exists():
            shutil.rmtree(self.dir)
        return left


def _shell_quote(value: str) -> str:
    import shlex

    return shlex.quote(value)


def _api_healthy(info: dict[str, Any]) -> bool:
    with _api(info, timeout=2) as api:
        return api.healthy()


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _reports_answer(host: str, port: int) -> bool:
    """Whether the stack's report server (by its ``Server`` header) answers on ``host:port``."""
    import http.client

    from deployments.report_server import SERVER_NAME

    conn = http.client.HTTPConnection(host, port, timeout=2)
    try:
        conn.request("HEAD", "/")
        return (conn.getresponse().getheader("Server") or "").split(" ")[0] == SERVER_NAME
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def ensure_process_pool(api: PrefectAPI, pool: str) -> None:
    """The process work pool ``pool``, made (with Prefect's default template for the type) if missing,
    its flow runs detached from the worker (``detach_flow_runs``)."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        api.client.read_work_pool(pool)
    except ObjectNotFound:
        try:
            api.client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                                       base_job_template=ProcessWorker.get_default_base_job_template()))
        except ObjectAlreadyExists:
            pass  # another `up` made it meanwhile
    detach_flow_runs(api, pool)


def worker_name(pool: str) -> str:
    return f"{pool}-worker"


def _worker_record(api: PrefectAPI, pool: str, name: str) -> Any:
    """The API's record of worker ``name`` of ``pool`` (a ``Worker``), or None (unknown, or no API)."""
    import httpx

    try:
        workers = api.client.read_workers_for_work_pool(pool)
    except (httpx.HTTPError, RuntimeError, OSError):
        return None
    return next((w for w in workers if w.name == name), None)


def _worker_status(api: PrefectAPI, pool: str, name: str) -> str | None:
    """What the API says of the worker: ONLINE, OFFLINE, or None (unknown to it, or no API)."""
    record = _worker_record(api, pool, name)
    return record.status.value if record else None


def _worker_beat_time(api: PrefectAPI, pool: str, name: str, online: bool = False) -> float | None:
    """The wall time of the worker's last heartbeat as the API has it (None: none, or not ONLINE when
    ``online``)."""
    record = _worker_record(api, pool, name)
    if record is None or not record.last_heartbeat_time or (online and record.status.value != "ONLINE"):
        return None
    return record.last_heartbeat_time.timestamp()


def detach_flow_runs(api: PrefectAPI, pool: str) -> None:
    """Make flow runs of ``pool`` independent of the worker that starts them: the default of the process
    pool's ``stream_output`` job variable becomes false. With output streamed (Prefect's default) a
    flow-run process writes into a pipe the worker reads; once the worker dies, its next write raises
    BrokenPipeError and the run crashes. Without, its output goes nowhere (its logs still reach the
    API: the UI and ``prefect flow-run logs`` show them) and it outlives the worker."""
    from prefect.client.schemas.actions import WorkPoolUpdate

    template = api.client.read_work_pool(pool).base_job_template
    prop = template.get("variables", {}).get("properties", {}).get("stream_output")
    if prop is None or prop.get("default") is False:
        return
    prop["default"] = False
    api.client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only (it may hold a password or a secret)."""
    from deployments.local_services import write_private

    write_private(path, text + "\n")


def s3_reader() -> tuple[str, str]:
    """The read-only identity of a stack made before stacks had their own (``stack.json`` without one)."""
    from deployments.local_services import READER_KEY, READER_SECRET

    return READER_KEY, READER_SECRET


# --------------------------------------------------------------------------- CLI

def masked_secrets(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` (as in stack.json) fit to print: each secret (S3's, the API's password) replaced by where it is."""
    where = f"*** (in {info.get('env_file')})"
    env = {**info.get("env", {})}
    for secret in ("AWS_SECRET_ACCESS_KEY", AUTH_VAR):
        if secret in env:
            env[secret] = where
    out = {**info, "env": env}
    if info.get("reader"):
        out["reader"] = [info["reader"][0], f"*** (in {info.get('dir')}/stack.json)"]
    return out


def _print_up(info: dict[str, Any]) -> None:
    rel = os.path.relpath(info["dir"])
    rel = info["dir"] if rel.startswith("..") else rel
    env = info["env"]
    _log(f"""
Local stack is up ({rel}):
  Prefect UI     {info['ui_url']}
  Prefect API    {info['api_url']}   database: {info['database']}
  S3 endpoint    {info['s3_endpoint']}   bucket: {info['bucket']}   store root: {info['store']}
  Reports (HTTP) {info['s3_http_base']}/{info['store'][len('s3://'):]}/<run>/reports/<step>/index.html  (read-only)
  Work pool      {info['pool']} (process), worker {info['worker_name']}
  Logs           {info['logs']}/  (prefect-server.log, worker.log, supervisor.log, seaweedfs.log, reports.log)
  Settings       {info['env_file']}

Use it from a shell: load the settings and credentials (the file is yours only, 0600; the S3
secret and the API's password are in it and are never printed):
  set -a; . {os.path.join(rel, 'env')}; set +a
It sets PREFECT_API_URL={env['PREFECT_API_URL']}, PREFECT_API_AUTH_STRING (the API takes no call
without it), AWS_ENDPOINT_URL={env['AWS_ENDPOINT_URL']}, AWS_ACCESS_KEY_ID={env['AWS_ACCESS_KEY_ID']},
AWS_SECRET_ACCESS_KEY and CKPT_STORE={env['CKPT_STORE']}.

Next: `make deploy` registers the deployments; open {info['ui_url']} to run them (the UI asks for
a login: the value of PREFECT_API_AUTH_STRING in {os.path.join(rel, 'env')}).
Stop: `make stack-down`.""")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.stack", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = os.environ

    def add_dir(p):
        p.add_argument("--dir", default=env.get("CKPT_STACK_DIR", DEFAULT_DIR),
                       help="stack folder: pid files, logs, data, stack.json, env (default .stack)")

    p_up = sub.add_parser("up", help="start the stack in the background and wait until it answers")
    add_dir(p_up)
    p_up.add_argument("--host", default=env.get("PREFECT_SERVER_API_HOST", DEFAULT_HOST))
    p_up.add_argument("--api-port", type=int, default=int(env.get("PREFECT_SERVER_API_PORT", DEFAULT_API_PORT)))
    p_up.add_argument("--s3-port", type=int, default=int(env.get("CKPT_STACK_S3_PORT", DEFAULT_S3_PORT)),
                      help="S3 port (default 8333; 0 = any free port)")
    p_up.add_argument("--reports-port", type=int,
                      default=int(env.get("CKPT_STACK_REPORTS_PORT", DEFAULT_REPORTS_PORT)),
                      help="the report server's port: the validation reports, read-only, over plain HTTP "
                           "(default 8888; 0 = any free port)")
    p_up.add_argument("--filer-port", type=int, default=int(env.get("CKPT_STACK_FILER_PORT", DEFAULT_FILER_PORT)),
                      help="SeaweedFS filer's internal HTTPS port, closed to clients without the stack's "
                           "certificate (default 0: any free port)")
    p_up.add_argument("--bucket", default=DEFAULT_BUCKET)
    p_up.add_argument("--prefix", default=DEFAULT_PREFIX, help="folder of runs in the bucket (default runs)")
    p_up.add_argument("--pool", default=DEFAULT_POOL, help="process work pool name (default local-pool)")
    p_up.add_argument("--worker-limit", type=int, default=None, help="most flow runs the worker runs at once")
    p_up.add_argument("--poll-seconds", type=float, default=5.0, help="how often the worker asks for runs")
    p_up.add_argument("--timeout", type=float, default=120.0, help="seconds each service may take to answer")

    p_down = sub.add_parser("down", help="stop every process of the stack (data stays)")
    add_dir(p_down)
    p_down.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p_down.add_argument("--purge", action="store_true", help="also delete the stack folder (database, bucket data)")

    p_status = sub.add_parser("status", help="what runs, what answers")
    add_dir(p_status)
    p_status.add_argument("--json", action="store_true")

    p_restart = sub.add_parser("restart", help="stop and start services of a running stack (flow runs go on)")
    add_dir(p_restart)
    p_restart.add_argument("services", nargs="+", choices=START_ORDER)
    p_restart.add_argument("--timeout", type=float, default=120.0)

    args = parser.parse_args(argv)
    stack = Stack(args.dir)
    if args.command == "up":
        try:
            info = stack.up(host=args.host, api_port=args.api_port, s3_port=args.s3_port,
                            filer_port=args.filer_port, reports_port=args.reports_port, bucket=args.bucket,
                            prefix=args.prefix.strip("/"), pool=args.pool, worker_limit=args.worker_limit,
                            poll_seconds=args.poll_seconds, timeout=args.timeout)
        except (RuntimeError, OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if "restarted" in info:
            _log(f"stack in {stack.dir}: started again {', '.join(info['restarted'])}; the rest ran on")
            _print_status(info)
            return 0 if info["running"] else 1
        _print_up(info)
        return 0
    if args.command == "restart":
        try:
            info = stack.repair(timeout=args.timeout, restart=tuple(args.services))
        except (RuntimeError, OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        _print_status(info)
        return 0 if info["running"] else 1
    if args.command == "down":
        if stack.info() is None:
            _log(f"no stack in {stack.dir} (nothing to stop)")
            return 0
        left = stack.down(grace=args.grace, purge=args.purge)
        if left:
            print(f"error: processes of the stack still alive: {left}", file=sys.stderr)
            return 1
        _log(f"stack in {stack.dir} stopped; no process of it is left" + (" (folder deleted)" if args.purge else ""))
        return 0
    st = stack.status()
    if args.json:
        print(json.dumps(masked_secrets(st), indent=2))
    elif not st.get("services"):
        _log(f"no stack in {stack.dir}")
    else:
        _print_status(st)
    return 0 if st["running"] else 1


def _print_status(st: dict[str, Any]) -> None:
    for name, s in st["services"].items():
        if s.get("answers"):
            state = "running, answers"
        elif s["running"]:
            state = "running, not answering"
        else:
            state = "DEAD (no process)" if s["pid"] else "stopped"
            if name == "worker" and s.get("api_status") == "ONLINE":
                state += "; the API still lists it ONLINE until its heartbeats expire"
        _log(f"{name:10s} pid {s['pid'] or '-':>8}  {state}")
    if not st["running"] and any(s["running"] for s in st["services"].values()):
        _log("start what is dead, leaving the rest running: `make stack` (python -m deployments.stack up)")
    _log(f"UI {st['ui_url']}   API {st['api_url']}   S3 {st['s3_endpoint']} ({st['store']})")


if __name__ == "__main__":
    sys.exit(main())
