"""The store contract on a local directory, plus what only a local store does (temp files, links)."""

import os
import time
import uuid
from pathlib import Path

import pytest

from ckptlib.errors import StoreError
from ckptlib.store import LocalStore
from ckptlib.testing.store_contract import StoreContract


class TestLocalStore(StoreContract):
    def make_store(self):
        return LocalStore(str(self.request.getfixturevalue("tmp_path") / f"store-{uuid.uuid4().hex[:8]}"))

    def raw_get(self, store, key):
        return (Path(store.root) / key).read_bytes()

    def raw_put(self, store, key, data):
        path = Path(store.root) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


# ----------------------------------------------------------------------------- local only


def test_temp_files_are_hidden_and_removed_after_the_grace_period(tmp_path):
    store = LocalStore(str(tmp_path / "s"))
    store.put("chunks/ab/ab01", b"x")
    old = tmp_path / "s" / "chunks" / "ab" / ".ckpt-tmp-old"
    new = tmp_path / "s" / "chunks" / "ab" / ".ckpt-tmp-new"
    old.write_bytes(b"half a chunk")
    new.write_bytes(b"in flight")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert store.list() == ["chunks/ab/ab01"]  # temp files are not objects
    assert store.list_dirs("chunks") == ["ab"]
    assert store.remove_stale_temp(time.time() - 600) == ["chunks/ab/.ckpt-tmp-old"]
    assert not old.exists() and new.exists()
    assert store.get("chunks/ab/ab01") == b"x"


def test_remove_stale_temp_never_follows_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / ".ckpt-tmp-victim"
    victim.write_bytes(b"not ours")
    os.utime(victim, (0, 0))
    (tmp_path / "s").mkdir()
    os.symlink(outside, tmp_path / "s" / "chunks")
    assert LocalStore(str(tmp_path / "s")).remove_stale_temp(time.time()) == []
    assert victim.exists()


def test_keys_through_a_link_are_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"secret")
    (tmp_path / "s").mkdir()
    os.symlink(outside, tmp_path / "s" / "reports")
    store = LocalStore(str(tmp_path / "s"))
    for op, args in (("get", ()), ("put", (b"x",)), ("put_if_absent", (b"x",)), ("delete", ()), ("modified", ())):
        with pytest.raises(StoreError, match="symbolic link"):
            getattr(store, op)("reports/f", *args)
    assert store.list() == [] and store.list_dirs() == []
    _refused_or_absent(store, "reports/f")
    assert (outside / "f").read_bytes() == b"secret"


def test_a_linked_file_is_not_an_object(tmp_path):
    (tmp_path / "outside").write_bytes(b"secret")
    (tmp_path / "s" / "chunks" / "ab").mkdir(parents=True)
    os.symlink(tmp_path / "outside", tmp_path / "s" / "chunks" / "ab" / "ab01")
    store = LocalStore(str(tmp_path / "s"))
    assert store.list() == []
    _refused_or_absent(store, "chunks/ab/ab01")
    for op, args in (("get", ()), ("put", (b"x",)), ("put_if_absent", (b"x",)), ("delete", ()), ("modified", ())):
        try:
            getattr(store, op)("chunks/ab/ab01", *args)
        except StoreError as e:  # refused (ObjectNotFound is a StoreError too)
            assert "link" in str(e) or "no object" in str(e), e
    assert (tmp_path / "outside").read_bytes() == b"secret"


def _refused_or_absent(store, key):
    """exists() of a key through a link: False, or refused with a StoreError naming the link."""
    try:
        assert store.exists(key) is False
    except StoreError as e:
        assert "symbolic link" in str(e)


def test_copy_from_a_local_store_is_a_hard_link(tmp_path):
    a, b = LocalStore(str(tmp_path / "a")), LocalStore(str(tmp_path / "b"))
    a.put("chunks/ab/ab01", b"x")
    assert b.copy_from(a, "chunks/ab/ab01") is True
    assert os.stat(tmp_path / "a/chunks/ab/ab01").st_ino == os.stat(tmp_path / "b/chunks/ab/ab01").st_ino
