"""No storage secret in Prefect, the store, a process list or an error, whatever kind of run.

A SeaweedFS of this module's own whose admin secret is unique to the session. Every kind of run
reaches it: ``ckpt train`` with its watchdog (which fences and reruns a hung shard) given the options
as ``--storage-options @file``, ``ckpt watchdog`` the same way, the ``validate-checkpoint`` flow and
a ``train-run`` flow run given a Prefect Secret block. Then the secret is looked for in Prefect's
database file, in what its API returns (flow runs, task runs, logs, artifacts, events), in every
object of the bucket, in the commands' output and in ``ps`` snapshots taken while they ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.prefect_records import api_text

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.s3]

EXTRA = {"d_model": 32, "n_layers": 1, "ctx": 16, "corpus_bytes": 65536}
BUCKET = "vault"
BLOCK = "ckpt-test-vault"


@pytest.fixture(scope="module")
def vault(tmp_path_factory):
    """(server, secret): a SeaweedFS whose admin secret exists nowhere else."""
    from deployments.local_services import SeaweedFS

    secret = f"sEcReT{uuid.uuid4().hex}"
    server = SeaweedFS.start(tmp_path_factory.mktemp("vault"), admin=("ckpt-vault-admin", secret))
    try:
        server.create_bucket(BUCKET)
        yield server, secret
    finally:
        server.stop(grace=1.0)


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """A training run in this process sets torch's (process-wide) thread count; later tests compare
    with fresh processes, so put it back."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


class ProcessList(threading.Thread):
    """``ps`` snapshots (every process's command line) every 0.1 s until stopped."""

    def __init__(self):
        super().__init__(daemon=True)
        self.snapshots: list[str] = []
        self.halt = threading.Event()

    def run(self):
        while not self.halt.wait(0.1):
            self.snapshots.append(subprocess.run(["ps", "-eo", "pid,args", "ww"], capture_output=True,
                                                 text=True).stdout)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.halt.set()
        self.join(10)


def cli_env(tmp_path: Path) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    home = tmp_path / "prefect-home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPT_STORAGE"))}
    return {**env, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}


def test_no_secret_anywhere_after_every_kind_of_run(vault, prefect_harness, tmp_path):
    server, secret = vault
    opts = tmp_path / "opts.json"
    opts.write_text(json.dumps(server.storage_options))
    opts.chmod(0o600)
    env = cli_env(tmp_path)
    store = f"s3://{BUCKET}/runs"
    outputs = []
    with ProcessList() as ps:
        # ckpt train with its watchdog: a hung shard is fenced and rerun by the watchdog
        train = subprocess.run(
            [sys.executable, "-m", "ckpt", "train", "--store", store, "--run-id", "cli", "--shards", "2",
             "--rounds", "1", "--steps-per-round", "6", "--workload-extra", json.dumps(EXTRA),
             "--storage-options", f"@{opts}", "--heartbeat-every", "0.2", "--watchdog-timeout", "2",
             "--chaos", "hang:shard=0,round=1", "--json", str(tmp_path / "cli.json")],
            env=env, capture_output=True, text=True, timeout=400)
        outputs.append(train.stdout + train.stderr)
        assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
        decisions = json.loads((tmp_path / "cli.json").read_text())["watchdog"]
        assert any(d["kind"] == "fenced" and d["rerun"] for d in decisions), decisions
        # ckpt watchdog on the store root
        wd = subprocess.run([sys.executable, "-m", "ckpt", "watchdog", store, "--storage-options", f"@{opts}",
                             "--duration", "1", "--poll", "0.3", "--json"],
                            env=env, capture_output=True, text=True, timeout=300)
        outputs.append(wd.stdout + wd.stderr)
        assert wd.returncode == 0, wd.stdout[-3000:] + wd.stderr[-3000:]
    assert any("ckpt train" in s or "-m ckpt train" in s for s in ps.snapshots)  # the snapshots saw the runs

    # the flows, given a Prefect Secret block that holds the options
    from prefect.blocks.system import Secret

    from flows.params import TrainParams
    from flows.train import train_run
    from flows.validate import validate_checkpoint_flow

    Secret(value=server.storage_options).save(BLOCK, overwrite=True)
    verdict = validate_checkpoint_flow(f"{store}/cli", 1, credentials_block=BLOCK)
    assert verdict["passed"], verdict
    s = train_run(TrainParams(store=store, run_id="flow", credentials_block=BLOCK, workload_extra=EXTRA, shards=1,
                              rounds=1, steps_per_round=3, heartbeat_every_s=0.2, validation_runner="threads"))
    assert s["validated"] == [0, 1], s

    # Prefect: the database file, and what the API returns
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    db = Path(PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    time.sleep(1.0)  # let queued logs and events reach the database
    for f in db.parent.glob(db.name + "*"):
        assert secret.encode() not in f.read_bytes(), f"the secret is in {f}"
    for path in ("/flow_runs/filter", "/task_runs/filter", "/logs/filter", "/artifacts/filter", "/events/filter"):
        assert secret not in api_text(path), path
    # the store: every object of the bucket
    from ckptlib.store import Store

    bucket = Store.from_url(f"s3://{BUCKET}", server.storage_options)
    keys = bucket.list()
    assert any(k.startswith("runs/cli/heartbeats/") for k in keys) and any("/fences/" in k for k in keys)
    for key in keys:
        assert secret.encode() not in bucket.get(key), key
    # the process lists and the commands' output
    assert not [s for s in ps.snapshots if secret in s]
    assert not [o for o in outputs if secret in o]


def test_credentials_in_a_store_url_are_refused_and_never_echoed(tmp_path):
    from typer.testing import CliRunner

    from ckpt.cli import app

    secret = f"sEcReT{uuid.uuid4().hex}"
    url = f"s3://key:{secret}@{BUCKET}/runs"
    for args in (["train", "--store", url], ["watchdog", url, "--duration", "0.5"], ["ls", f"{url}/r"],
                 ["status", url], ["validate", f"{url}/r"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        assert "holds credentials" in r.output and secret not in r.output, (args, r.output)


def test_storage_options_reach_this_process_flows_as_a_file_path_not_its_content(tmp_path, monkeypatch):
    """``--storage-options @FILE`` reaches the flows ``ckpt train`` and ``ckpt watchdog`` run here (the
    watchdog's: no secret in its parameters) as the file's absolute path in CKPT_STORAGE_OPTIONS, with
    ``~`` expanded as the command itself reads it (a path made absolute as given, ``<cwd>/~/opts.json``,
    named a file that does not exist: the watchdog beside the run could not reach the store)."""
    from trainrun.credentials import STORAGE_OPTIONS_ENV, export_storage_options, storage_options_from_env

    secret = f"sEcReT{uuid.uuid4().hex}"
    (tmp_path / "opts.json").write_text(json.dumps({"key": "k", "secret": secret}))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.delenv(STORAGE_OPTIONS_ENV, raising=False)
    export_storage_options(None)
    export_storage_options("  ")
    assert STORAGE_OPTIONS_ENV not in os.environ  # nothing given: the environment as it was
    export_storage_options("@~/opts.json")
    assert os.environ[STORAGE_OPTIONS_ENV] == f"@{tmp_path / 'opts.json'}"
    assert storage_options_from_env() == {"key": "k", "secret": secret}
    export_storage_options("@../opts.json")  # relative to this process's directory, not the flow's
    assert os.environ[STORAGE_OPTIONS_ENV] == f"@{tmp_path / 'opts.json'}"
    export_storage_options(' {"endpoint_url": "http://127.0.0.1:8333"} ')  # inline JSON: as given
    assert storage_options_from_env() == {"endpoint_url": "http://127.0.0.1:8333"}
