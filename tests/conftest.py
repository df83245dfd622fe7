"""Shared fixtures: real stores (local, memory, SeaweedFS S3) and a Prefect test backend.

Fixtures:

* ``seaweedfs`` (session): one real SeaweedFS S3 server on loopback for the whole session, started
  on first use (about 4 s) and stopped at the end. Yields ``deployments.local_services.SeaweedFS``
  (``.endpoint``, ``.storage_options``, ``.readonly_storage_options``, ``.create_bucket(name)``).
* ``s3_url`` (function): an :class:`S3Location` ``(url, storage_options)`` for a fresh, empty prefix
  ``s3://ckpt-test/<test name>-<random>`` in one session bucket (a bucket per test would make
  SeaweedFS allocate volumes for each).
* ``store_factory`` (function): ``store_factory(kind)`` -> a fresh, empty Store of kind
  ``"local"`` (under tmp_path), ``"memory"`` (unique name, removed after the test) or ``"s3"``.
* ``any_store`` (function, parametrised local / memory / s3): a fresh Store of each kind; the s3
  case carries ``pytest.mark.s3``. Tests using ``seaweedfs`` or ``s3_url`` get the mark too, so
  ``-m "not s3"`` runs without starting SeaweedFS.
* ``group`` (module): a gloo process group of one rank in this process, for a collective Checkpointer.
* ``prefect_harness`` (session, not autouse): a temporary Prefect API (SQLite, own server process)
  for tests that run flows; request it explicitly.
* ``api_env`` (session): the environment of a ``ckpt`` subprocess that reaches that API (and finds
  the tests' workloads, ``slow_steps:build``), with a throwaway Prefect home.
* ``clean_digests`` (session): ``clean_digests(spec, rounds)`` -> {step: digest} of the clean run,
  computed once per test session (``tests/runs.py``), whichever xdist worker asks first.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import tempfile
import uuid
from typing import NamedTuple

# Before anything imports prefect: no telemetry, and a throwaway PREFECT_HOME (never the user's).
_PREFECT_HOME = tempfile.mkdtemp(prefix="ckpt-test-prefect-home-")
atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
# One OpenMP thread per process: three xdist workers and the processes their tests start share two
# cores, and torch's default (a thread per core, each spinning between parallel regions) spends CPU
# on contention. A test that measures threads sets its own (``torch.set_num_threads``).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# botocore would otherwise probe the EC2 metadata endpoint for credentials (slow, off-network).
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"

import pytest  # noqa: E402

from ckptlib.store import Store  # noqa: E402

S3_TEST_BUCKET = "ckpt-test"


class S3Location(NamedTuple):
    """Where an S3 test may write: ``Store.from_url(loc.url, loc.storage_options)``."""

    url: str
    storage_options: dict


@pytest.fixture(autouse=True)
def _storage_options_env_stays_as_it_was():
    """``ckpt train``/``ckpt watchdog`` run in-process export their storage options to this
    process's environment (for the flows they run here); a test must not hand them to the next one,
    whose subprocesses (a saver, a Prefect worker) would then reach for a store that is gone."""
    before = os.environ.get("CKPT_STORAGE_OPTIONS")
    yield
    if before is None:
        os.environ.pop("CKPT_STORAGE_OPTIONS", None)
    else:
        os.environ["CKPT_STORAGE_OPTIONS"] = before


def pytest_configure(config):
    """Compile the project's modules to bytecode once, before any test process starts. The suite
    starts hundreds of Python processes (ranks, Dask workers, flow runs, ``ckpt train``), and each
    imports a large part of the project's 1.8 MB of source. Where ``PYTHONDONTWRITEBYTECODE`` is
    set (as on the machines here), no process writes ``__pycache__``, so every one of them compiled
    that source again; Python still reads bytecode that exists, and checks it against the source."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller has done it
        return
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for package in ("ckptlib", "trainrun", "tasks", "flows", "ckpt", "workloads", "deployments", "bench", "tests"):
        # silent: it only saves time (a read-only checkout just compiles as before), and a syntax
        # error is reported by the import that meets it
        compileall.compile_dir(root / package, quiet=2)


_FILE_SECONDS: dict[str, float] = {}
# A test may run longer than this only if it is a drill that needs it, marked ``slow`` (the summary
# lists every one with its time, and names any that is not marked).
LONG_TEST_S = 60.0
_LONG_TESTS: dict[str, tuple[float, bool]] = {}


def pytest_runtest_logreport(report):
    """Seconds per test file (setup, call and teardown), summed where the reports arrive (the xdist
    controller too): the suite's time budget is spent by files, since ``--dist loadfile`` runs
    each file on one worker."""
    name = report.nodeid.split("::")[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration
    if report.when == "call" and report.duration > LONG_TEST_S:
        _LONG_TESTS[report.nodeid] = (report.duration, "slow" in report.keywords)


def pytest_terminal_summary(terminalreporter):
    if os.environ.get("PYTEST_XDIST_WORKER") or not _FILE_SECONDS:
        return
    terminalreporter.section("slowest test files")
    for name, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {name}")
    if _LONG_TESTS:
        terminalreporter.section(f"tests over {LONG_TEST_S:.0f} s")
        for nodeid, (seconds, marked) in sorted(_LONG_TESTS.items(), key=lambda kv: -kv[1][0]):
            terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}{'' if marked else '   NOT MARKED slow'}")


# The files that take longest (wall seconds of a whole run at 3 xdist workers on 2 cores, 2026-12-07:
# stack with the UI tests 374, rank drills 148, watchdog 145, ... hostile store 80; the rest under
# 70). `make test` hands xdist whole files in collection order (``--dist loadfile
# --no-loadscope-reorder``), so these go first: xdist's own order (most tests first) started them last, and a 36 s soak or a 237 s file
# begun near the end of the run kept one worker busy alone for minutes.
SLOWEST_FILES_FIRST = ("test_stack.py", "test_rank_drills.py", "test_watchdog.py", "test_rank_group.py",
                       "test_preemption.py", "test_scale_out.py", "test_train_flow.py",
                       "test_distributed_jobs.py", "test_recovery.py", "test_hostile_store.py",
                       "test_soak_compare.py", "test_cancel_everywhere.py", "test_rank_fsdp.py",
                       "test_rank_preemption.py", "test_bench.py", "test_validate.py", "test_gc_race.py")


def pytest_collection_modifyitems(items):
    for item in items:
        if "seaweedfs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    from deployments.local_services import SeaweedFS

    server = SeaweedFS.start(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.create_bucket(S3_TEST_BUCKET)
        yield server
    finally:
        server.stop(grace=1.0)  # throwaway data: no need to wait for a graceful stop


@pytest.fixture
def s3_url(seaweedfs, request) -> S3Location:
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40]
    url = f"s3://{S3_TEST_BUCKET}/{name}-{uuid.uuid4().hex[:8]}"
    return S3Location(url, dict(seaweedfs.storage_options))


@pytest.fixture
def store_factory(tmp_path, request):
    memory_stores: list[Store] = []

    def make(kind: str) -> Store:
        if kind == "local":
            return Store.from_url(str(tmp_path / f"store-{uuid.uuid4().hex[:8]}"))
        if kind == "memory":
            store = Store.from_url(f"memory://test-{uuid.uuid4().hex}")
            memory_stores.append(store)
            return store
        if kind == "s3":
            loc = request.getfixturevalue("s3_url")
            return Store.from_url(f"{loc.url}/{uuid.uuid4().hex[:8]}", loc.storage_options)
        raise ValueError(f"unknown store kind {kind!r}: use 'local', 'memory' or 's3'")

    yield make
    for store in memory_stores:  # the memory filesystem is process-global: free what we wrote
        for key in store.list():
            store.delete(key)


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def any_store(request, store_factory) -> Store:
    return store_factory(request.param)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def api_env(prefect_harness, tmp_path_factory):
    from prefect.settings import PREFECT_API_URL

    from tests.runs import ENV

    home = tmp_path_factory.mktemp("home")
    return {**ENV, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(home)}


@pytest.fixture(scope="session")
def clean_digests(tmp_path_factory):
    from tests.runs import clean_digests as digests_of

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is a folder of the session's
        root = root.parent
    return functools.partial(digests_of, root / "clean-runs")


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A gloo process group of one rank in this process (what a collective Checkpointer is built
    over), for the tests of one module; destroyed after them."""
    import torch.distributed as dist

    where = tmp_path_factory.mktemp("pg")
    dist.init_process_group("gloo", init_method=f"file://{where}/rendezvous", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
