"""Store URLs, S3 errors and the FaultyStore wrapper. The store contract itself (every backend and
wrapper) is ckptlib.testing.store_contract.StoreContract, run in tests/store/."""

from __future__ import annotations

import pickle
import socket
import time

import pytest

from ckptlib.errors import StoreError
from ckptlib.store import Store
from ckptlib.testing import FaultyStore, InjectedFault, SimulatedCrash

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


def test_faulty_nth_call_and_hooks(faulty):
    ran = []
    faulty.on_call("put", "*", lambda: ran.append(faulty.inner.list()), nth=2)
    faulty.crash_after("*", nth=4)
    faulty.put("a", b"1")
    assert ran == []
    faulty.put("b", b"2")
    assert ran == [["a", "b"]]  # after the 2nd put was performed, before it returned
    assert faulty.get("a") == b"1"
    with pytest.raises(SimulatedCrash):
        faulty.get("b")  # the 4th call of any kind
    assert [c.fault for c in faulty.calls] == [None, None, None, "crash"]
    with pytest.raises(ValueError):
        faulty.crash_after("*", nth=0)


def test_faulty_remove_stale_temp_is_a_call(faulty):
    faulty.crash_after("remove_stale_temp")
    with pytest.raises(SimulatedCrash):
        faulty.remove_stale_temp(time.time())


def test_faulty_store_pickles(faulty):
    faulty.fail_on("get", "x")
    copy = pickle.loads(pickle.dumps(faulty))
    with pytest.raises(InjectedFault):
        copy.get("x")
