"""The Store contract, run against every backend (local dir, memory://, S3 on a real SeaweedFS),
then bad-input errors and the FaultyStore wrapper."""

from __future__ import annotations

import pickle
import random
import socket
import threading
import time

import pytest

from ckptlib.errors import ObjectNotFound, StoreError
from ckptlib.store import Store, StoreCapabilities
from ckptlib.testing import FaultyStore, InjectedFault, SimulatedCrash


def reopen(store: Store) -> Store:
    """The same store, opened again from its URL (as another process would)."""
    return Store.from_url(store.url, getattr(store, "storage_options", None))


# ----------------------------------------------------------------------------- the contract


def test_round_trip_binary_and_empty(any_store):
    data = bytes(range(256)) * 3 + b"\x00\r\n\xff"
    any_store.put("chunks/ab/abcdef", data)
    any_store.put("empty", b"")
    assert any_store.get("chunks/ab/abcdef") == data
    assert any_store.get("empty") == b""
    assert reopen(any_store).get("chunks/ab/abcdef") == data


def test_put_overwrites(any_store):
    any_store.put("heartbeats/0.json", b"old")
    any_store.put("heartbeats/0.json", b"new")
    assert any_store.get("heartbeats/0.json") == b"new"


def test_missing_key_raises_object_not_found(any_store):
    with pytest.raises(ObjectNotFound) as err:
        any_store.get("manifests/7.json")
    assert "manifests/7.json" in str(err.value) and any_store.url in str(err.value)
    assert isinstance(err.value, KeyError) and isinstance(err.value, StoreError)
    with pytest.raises(ObjectNotFound):
        any_store.modified("manifests/7.json")
    assert not any_store.exists("manifests/7.json")


def test_put_if_absent_creates_once(any_store):
    assert any_store.put_if_absent("manifests/1.json", b"first") is True
    assert any_store.put_if_absent("manifests/1.json", b"second") is False
    assert any_store.get("manifests/1.json") == b"first"
    assert any_store.list("manifests") == ["manifests/1.json"]  # no temp files left behind


def test_concurrent_put_if_absent_has_one_winner(any_store):
    n = 8
    barrier = threading.Barrier(n)
    results: list[tuple[bool, bytes]] = [None] * n  # type: ignore[list-item]

    def race(i: int) -> None:
        data = f"writer {i} ".encode() * 1000
        barrier.wait(timeout=30)
        results[i] = (any_store.put_if_absent("manifests/5.json", data), data)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [data for won, data in results if won]
    assert len(winners) == 1
    assert any_store.get("manifests/5.json") == winners[0]


def test_list_is_recursive_sorted_and_folder_based(any_store):
    assert any_store.list() == []
    keys = ["fragments/1/0.g0.json", "fragments/10/0.g0.json", "fragments/1/1.g0.json",
            "chunks/ab/ab12", "chunks/cd/cd34", "manifests/1.json"]
    for k in keys:
        any_store.put(k, b"x")
    assert any_store.list() == sorted(keys)
    assert any_store.list("fragments/1") == ["fragments/1/0.g0.json", "fragments/1/1.g0.json"]
    assert any_store.list("fragments/1/") == any_store.list("fragments/1")
    assert any_store.list("chunks") == ["chunks/ab/ab12", "chunks/cd/cd34"]
    assert any_store.list("nothing/here") == []
    assert any_store.list("manifests/1.json") == []  # a key is not a folder


def test_delete(any_store):
    any_store.put("fences/0/1", b"")
    assert any_store.exists("fences/0/1")
    any_store.delete("fences/0/1")
    assert not any_store.exists("fences/0/1")
    assert any_store.list() == []
    with pytest.raises(ObjectNotFound):
        any_store.get("fences/0/1")
    any_store.delete("fences/0/1")  # missing is fine
    assert any_store.put_if_absent("fences/0/1", b"again") is True


def test_exists_is_for_objects_not_folders(any_store):
    any_store.put("reports/3/summary.json", b"{}")
    assert any_store.exists("reports/3/summary.json")
    assert not any_store.exists("reports/3")


def test_child_store_is_rooted_below(any_store):
    run = any_store.child("runs/a")
    assert run.url == any_store.url + "/runs/a"
    assert type(run) is type(any_store)
    run.put("manifests/1.json", b"m")
    any_store.put("other", b"o")
    assert any_store.get("runs/a/manifests/1.json") == b"m"
    assert run.list() == ["manifests/1.json"]
    assert any_store.list() == ["other", "runs/a/manifests/1.json"]
    assert reopen(run).get("manifests/1.json") == b"m"
    assert run.put_if_absent("manifests/1.json", b"x") is False


def test_modified_is_recent(any_store):
    before = time.time()
    any_store.put("heartbeats/1.json", b"{}")
    after = time.time()
    # S3 reports whole seconds; allow for that and for a little clock skew with the server.
    assert before - 2 <= any_store.modified("heartbeats/1.json") <= after + 2


def test_large_object_round_trip(any_store):
    data = random.Random(0).randbytes(12 * 2**20)
    any_store.put("chunks/big/1", data)
    assert any_store.get("chunks/big/1") == data
    assert any_store.put_if_absent("chunks/big/2", data) is True
    assert any_store.put_if_absent("chunks/big/2", data[:10]) is False
    assert any_store.get("chunks/big/2") == data


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "../x", "a/./b", "a/", "a\\b", "x/.ckpt-tmp-1"])
def test_invalid_keys_are_refused(any_store, key):
    with pytest.raises(StoreError, match="invalid key"):
        any_store.put(key, b"x")


def test_pickles_for_other_workers(any_store):
    # Prefect/Dask may ship a Store to another worker; it must arrive usable.
    any_store.put("a", b"1")
    copy = pickle.loads(pickle.dumps(any_store))
    assert copy == any_store and copy.get("a") == b"1"


def test_capabilities(any_store):
    assert isinstance(any_store.capabilities, StoreCapabilities)
    assert any_store.capabilities.conditional_put is True


# ----------------------------------------------------------------------------- URLs


def test_url_forms_are_normalised(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Store.from_url("runs/x").url == f"file://{tmp_path}/runs/x"
    assert Store.from_url(f"file://{tmp_path}/runs/x/").url == f"file://{tmp_path}/runs/x"
    assert Store.from_url("memory://a/b/").url == "memory://a/b"


@pytest.mark.parametrize("url, message", [
    ("gs://bucket/x", r"unsupported store URL scheme 'gs://'.*s3://bucket"),
    ("file://relative/x", "not absolute"),
    ("memory://", "needs a name"),
    ("s3://", "no bucket"),
    ("s3://B_ad/x", "invalid S3 bucket name 'B_ad'"),
    ("", "empty store URL"),
])
def test_bad_urls_name_the_fix(url, message):
    with pytest.raises(StoreError, match=message):
        Store.from_url(url)


def test_storage_options_only_for_s3(tmp_path):
    with pytest.raises(StoreError, match="apply only to s3://"):
        Store.from_url(str(tmp_path), {"key": "k"})


def test_local_root_that_is_a_file(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(StoreError, match="is a file, not a directory"):
        Store.from_url(str(tmp_path / "f"))


def test_unknown_storage_option_is_named():
    with pytest.raises(StoreError, match=r"unknown storage_options \['endpoint'\]"):
        Store.from_url("s3://ckpts/x", {"endpoint": "http://127.0.0.1:1"})


# ----------------------------------------------------------------------------- S3 errors


def test_missing_bucket(seaweedfs):
    with pytest.raises(StoreError, match=f"bucket 'no-such-bucket' does not exist at {seaweedfs.endpoint}: create it"):
        Store.from_url("s3://no-such-bucket/run", seaweedfs.storage_options)


def test_unreachable_endpoint_fails_fast():
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(StoreError, match=f"cannot reach the S3 endpoint {endpoint}.*AWS_ENDPOINT_URL"):
        Store.from_url("s3://ckpts/run", {"endpoint_url": endpoint, "key": "k", "secret": "s"})
    assert time.monotonic() - start < 15


def test_aws_env_vars_are_honoured(seaweedfs, s3_url, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.storage_options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.storage_options["secret"])
    store = Store.from_url(s3_url.url, {"skip_instance_cache": True})
    store.put("a", b"1")
    assert Store.from_url(s3_url.url, s3_url.storage_options).get("a") == b"1"


# SeaweedFS is started with an identities file (deployments/local_services.py), so it checks
# credentials and permissions like AWS does: these are real refusals, not simulated ones.
@pytest.mark.parametrize("key, secret, code", [
    ("ckpt-admin", "wrong-secret", "SignatureDoesNotMatch"),
    ("nobody", "wrong-secret", "InvalidAccessKeyId"),
])
def test_wrong_credentials(seaweedfs, s3_url, key, secret, code):
    options = {**s3_url.storage_options, "key": key, "secret": secret}
    with pytest.raises(StoreError, match=f"credentials rejected .*{code}.*AWS_ACCESS_KEY_ID"):
        Store.from_url(s3_url.url, options)


def test_missing_credentials(seaweedfs, s3_url, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(StoreError, match="no S3 credentials.*AWS_ACCESS_KEY_ID"):
        Store.from_url(s3_url.url, {"endpoint_url": seaweedfs.endpoint, "skip_instance_cache": True})


def test_permission_denied(seaweedfs, s3_url):
    Store.from_url(s3_url.url, s3_url.storage_options).put("a", b"1")
    reader = Store.from_url(s3_url.url, seaweedfs.readonly_storage_options)
    assert reader.get("a") == b"1"
    with pytest.raises(StoreError, match="permission denied to put 'a'"):
        reader.put("a", b"2")
    with pytest.raises(StoreError, match="permission denied to put_if_absent 'b'"):
        reader.put_if_absent("b", b"2")


# ----------------------------------------------------------------------------- FaultyStore


@pytest.fixture
def faulty(store_factory):
    return FaultyStore(store_factory("memory"))


def test_faulty_fail_on_writes_nothing(faulty):
    faulty.fail_on("put_if_absent", "manifests/*", times=1)
    with pytest.raises(InjectedFault):
        faulty.put_if_absent("manifests/1.json", b"m")
    assert not faulty.inner.exists("manifests/1.json")
    assert faulty.put_if_absent("manifests/1.json", b"m") is True  # the rule is used up
    assert faulty.put_if_absent("chunks/a", b"c") is True  # other keys never matched
    assert [(c.key, c.fault) for c in faulty.calls] == [
        ("manifests/1.json", "fail"), ("manifests/1.json", None), ("chunks/a", None)]


def test_faulty_lose_reply_writes_then_raises(faulty):
    faulty.lose_reply("put_if_absent", "manifests/*")
    with pytest.raises(InjectedFault, match="lost reply"):
        faulty.put_if_absent("manifests/2.json", b"m")
    assert faulty.inner.get("manifests/2.json") == b"m"


def test_faulty_truncate_and_drop(faulty):
    faulty.truncate_on("put*", "chunks/*").drop("put", "heartbeats/*")
    faulty.put_if_absent("chunks/a", b"abcdef")
    faulty.put("heartbeats/0.json", b"{}")
    assert faulty.get("chunks/a") == b"abc"
    assert not faulty.exists("heartbeats/0.json")
    with pytest.raises(ValueError):
        faulty.drop("get")


def test_faulty_crash_after_kills_the_store(faulty):
    faulty.crash_after("put", "fragments/*")
    faulty.put("chunks/a", b"c")
    with pytest.raises(SimulatedCrash):
        faulty.put("fragments/1/0.g0.json", b"f")
    assert faulty.inner.exists("fragments/1/0.g0.json")  # it was written before the "crash"
    with pytest.raises(SimulatedCrash):
        faulty.get("chunks/a")  # a dead writer does nothing more
    assert not issubclass(SimulatedCrash, Exception)
    faulty.reset()
    assert faulty.get("chunks/a") == b"c"


def test_faulty_delay_and_child(faulty):
    faulty.delay("get", "*", 0.2, times=1)
    faulty.put("runs/a/x", b"1")
    start = time.monotonic()
    assert faulty.child("runs/a").get("x") == b"1"  # children share the rules and the log
    assert time.monotonic() - start >= 0.2
    assert faulty.keys("get") == ["x"]
