"""The store contract as a test kit: every ``Store`` backend and wrapper passes these tests.

A backend (or a wrapper such as ``FaultyStore``) gets the whole contract by subclassing
:class:`StoreContract` in a pytest module (the class name must start with ``Test``)::

    from ckptlib.store import LocalStore
    from ckptlib.testing.store_contract import StoreContract

    class TestLocalStore(StoreContract):
        def make_store(self):
            return LocalStore(str(self.request.getfixturevalue("tmp_path") / "store"))

        def raw_get(self, store, key):
            return (Path(store.root) / key).read_bytes()

        def raw_put(self, store, key, data):
            path = Path(store.root) / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)

What a subclass provides:

* ``make_store()``: a fresh, empty store (each call a new one; ``copy_from`` tests call it twice).
  ``self.request`` is pytest's ``request`` of the running test: use
  ``self.request.getfixturevalue(...)`` for ``tmp_path``, a server, credentials...
* ``raw_get(store, key)`` / ``raw_put(store, key, data)``: a back door that reads and writes the
  backend's own storage *without* the Store API (the file, the S3 object, the in-memory entry),
  so the API is checked against what really landed (zarr's ``StoreTests`` works the same way).
  ``raw_get`` raises ``FileNotFoundError`` (or ``KeyError``) for a missing object.
* optionally ``reopen(store)``: the same store opened again as another process would (default:
  ``Store.from_url(store.url, store.storage_options)``), and ``cleanup(store)`` (default: delete
  every key of a ``memory://`` store).

The tests need nothing but the Store API and the back door, run in a few seconds against a real
backend, and use small objects except one 12 MiB round trip.
"""

from __future__ import annotations

import pickle
import random
import threading
import time
from abc import abstractmethod
from typing import Any, ClassVar

import pytest

from ckptlib.errors import ObjectNotFound, StoreError
from ckptlib.store import ObjectInfo, Store, StoreCapabilities, check_key

__all__ = ["INVALID_KEYS", "StoreContract"]

# Keys every store refuses (StoreError naming "invalid"), whatever the operation.
INVALID_KEYS = ["", "/abs", "a//b", "../x", "a/../b", "a/./b", ".", "a/", "a\\b", "a\0b",
                "x/.ckpt-tmp-1", ".ckpt-tmp-2"]


def _missing(exc: BaseException) -> bool:
    return isinstance(exc, (FileNotFoundError, KeyError))


class StoreContract:
    """Contract tests of :class:`ckptlib.store.Store` (see the module docstring)."""

    # --- what a backend's test provides ----------------------------------------------------------

    @abstractmethod
    def make_store(self) -> Store:
        """A fresh, empty store."""

    @abstractmethod
    def raw_get(self, store: Store, key: str) -> bytes:
        """The bytes stored under ``key``, read without the Store API."""

    @abstractmethod
    def raw_put(self, store: Store, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` without the Store API."""

    def reopen(self, store: Store) -> Store:
        """The same store, opened again from its URL (as another process would)."""
        return Store.from_url(store.url, getattr(store, "storage_options", None))

    def cleanup(self, store: Store) -> None:
        if store.url.startswith("memory://"):
            for key in store.list():
                store.delete(key)

    # --- fixtures ---------------------------------------------------------------------------------

    @pytest.fixture(autouse=True)
    def _contract_request(self, request: pytest.FixtureRequest) -> None:
        self.request = request

    @pytest.fixture
    def store(self) -> Any:
        self._made: list[Store] = []
        try:
            yield self.fresh_store()
        finally:
            for s in self._made:
                self.cleanup(s)

    def fresh_store(self) -> Store:
        """Another fresh store from ``make_store``, cleaned up after the test."""
        s = self.make_store()
        self._made.append(s)
        return s

    def _raw_put_many(self, store: Store, keys: list[str], data: bytes = b"{}") -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: self.raw_put(store, k, data), keys))

    def _raw_missing(self, store: Store, key: str) -> bool:
        try:
            self.raw_get(store, key)
        except Exception as e:
            if _missing(e):
                return True
            raise
        return False

    # --- get / put --------------------------------------------------------------------------------

    def test_put_lands_in_the_backend(self, store: Store) -> None:
        data = bytes(range(256)) * 3 + b"\x00\r\n\xff"
        store.put("chunks/ab/abcdef", data)
        assert self.raw_get(store, "chunks/ab/abcdef") == data

    def test_get_reads_the_backend(self, store: Store) -> None:
        self.raw_put(store, "manifests/3.json", b'{"x": 1}')
        self.raw_put(store, "empty", b"")
        assert store.get("manifests/3.json") == b'{"x": 1}'
        assert store.get("empty") == b""
        assert store.exists("manifests/3.json")

    def test_round_trip_binary_and_empty(self, store: Store) -> None:
        data = bytes(range(256)) * 3 + b"\x00\r\n\xff"
        store.put("chunks/ab/abcdef", data)
        store.put("empty", b"")
        assert store.get("chunks/ab/abcdef") == data
        assert store.get("empty") == b""
        assert self.reopen(store).get("chunks/ab/abcdef") == data

    def test_put_accepts_bytes_like(self, store: Store) -> None:
        store.put("a", bytearray(b"ba"))  # type: ignore[arg-type]  # bytes-like, as backends accept
        store.put("b", memoryview(b"mv"))
        assert store.get("a") == b"ba" and store.get("b") == b"mv"
        assert isinstance(store.get("a"), bytes)

    def test_put_overwrites(self, store: Store) -> None:
        store.put("heartbeats/0.json", b"old")
        store.put("heartbeats/0.json", b"new")
        assert store.get("heartbeats/0.json") == b"new"
        assert self.raw_get(store, "heartbeats/0.json") == b"new"
        assert store.list() == ["heartbeats/0.json"]  # no temp file left behind

    def test_large_object_round_trip(self, store: Store) -> None:
        data = random.Random(0).randbytes(12 * 2**20)
        store.put("chunks/big/1", data)
        assert store.get("chunks/big/1") == data
        assert store.put_if_absent("chunks/big/2", data) is True
        assert store.put_if_absent("chunks/big/2", data[:10]) is False
        assert self.raw_get(store, "chunks/big/2") == data

    # --- bounded reads (get with max_bytes) ---------------------------------------------------------

    def test_bounded_get_returns_what_fits(self, store: Store) -> None:
        self.raw_put(store, "manifests/1.json", b"0123456789")
        self.raw_put(store, "empty", b"")
        assert store.get("manifests/1.json", max_bytes=10) == b"0123456789"
        assert store.get("manifests/1.json", max_bytes=1 << 30) == b"0123456789"
        assert store.get("empty", max_bytes=0) == b"" and store.get("empty", max_bytes=5) == b""
        assert isinstance(store.get("manifests/1.json", max_bytes=10), bytes)

    def test_bounded_get_refuses_what_does_not_fit(self, store: Store) -> None:
        from ckptlib.errors import CorruptCheckpoint, ObjectTooLarge

        self.raw_put(store, "heartbeats/x.json", b"x" * 4097)
        for cap in (0, 1, 4096):
            with pytest.raises(ObjectTooLarge) as err:
                store.get("heartbeats/x.json", max_bytes=cap)
            e = err.value
            assert isinstance(e, CorruptCheckpoint) and e.cap == cap and e.size in (4097, None)
            assert "heartbeats/x.json" in str(e) and f"the {cap} bytes" in str(e) and store.url in str(e)
        assert store.get("heartbeats/x.json") == b"x" * 4097  # unbounded: as before

    def test_bounded_get_reads_no_more_than_the_cap(self, store: Store) -> None:
        """A 12 MiB object refused under a 1 KiB cap: the read is bounded, not the whole object
        first (measured as Python allocations, which hold every byte a backend returns)."""
        import tracemalloc

        from ckptlib.errors import ObjectTooLarge

        self.raw_put(store, "manifests/9.json", bytes(12 << 20))
        tracemalloc.start()
        try:
            with pytest.raises(ObjectTooLarge):
                store.get("manifests/9.json", max_bytes=1024)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, f"a refused bounded read allocated {peak} bytes"

    def test_bounded_get_under_a_large_cap_allocates_what_it_reads(self, store: Store) -> None:
        """A 1 KiB object read under a 1 GiB cap costs about 1 KiB (not a buffer of the cap)."""
        import tracemalloc

        self.raw_put(store, "manifests/2.json", b"m" * 1024)
        tracemalloc.start()
        try:
            assert store.get("manifests/2.json", max_bytes=1 << 30) == b"m" * 1024
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, f"a bounded read of 1 KiB allocated {peak} bytes"

    def test_bounded_get_of_a_missing_key_or_a_folder(self, store: Store) -> None:
        store.put("reports/3/summary.json", b"{}")
        for key in ("manifests/7.json", "reports/3"):
            with pytest.raises(ObjectNotFound):
                store.get(key, max_bytes=100)

    @pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
    def test_bounded_get_refuses_a_bad_cap(self, store: Store, bad: Any) -> None:
        store.put("a", b"x")
        with pytest.raises(ValueError, match="max_bytes"):
            store.get("a", max_bytes=bad)

    # --- missing keys -----------------------------------------------------------------------------

    def test_missing_key_raises_object_not_found(self, store: Store) -> None:
        with pytest.raises(ObjectNotFound) as err:
            store.get("manifests/7.json")
        assert "manifests/7.json" in str(err.value) and store.url in str(err.value)
        assert isinstance(err.value, KeyError) and isinstance(err.value, StoreError)
        with pytest.raises(ObjectNotFound):
            store.modified("manifests/7.json")
        assert not store.exists("manifests/7.json")
        store.delete("manifests/7.json")  # deleting nothing is fine

    def test_missing_key_under_a_missing_folder(self, store: Store) -> None:
        with pytest.raises(ObjectNotFound):
            store.get("no/such/folder/key")
        assert not store.exists("no/such/folder/key")
        assert store.list("no/such") == [] and list(store.scan("no/such")) == []
        assert store.list_dirs("no/such") == []

    def test_a_folder_is_not_an_object(self, store: Store) -> None:
        store.put("reports/3/summary.json", b"{}")
        assert store.exists("reports/3/summary.json")
        assert not store.exists("reports/3")
        with pytest.raises(ObjectNotFound):
            store.get("reports/3")
        with pytest.raises(ObjectNotFound):
            store.modified("reports/3")
        store.delete("reports/3")  # not an object: nothing to delete, nothing under it touched
        assert store.get("reports/3/summary.json") == b"{}"

    def test_a_key_is_not_a_folder(self, store: Store) -> None:
        store.put("manifests/1.json", b"m")
        assert store.list("manifests/1.json") == []
        assert list(store.scan("manifests/1.json")) == []
        assert store.list_dirs("manifests/1.json") == []

    # --- put_if_absent ----------------------------------------------------------------------------

    def test_put_if_absent_creates_once(self, store: Store) -> None:
        assert store.put_if_absent("manifests/1.json", b"first") is True
        assert store.put_if_absent("manifests/1.json", b"second") is False
        assert store.get("manifests/1.json") == b"first"
        assert self.raw_get(store, "manifests/1.json") == b"first"
        assert store.list("manifests") == ["manifests/1.json"]  # no temp files left behind

    def test_put_if_absent_sees_objects_written_behind_its_back(self, store: Store) -> None:
        self.raw_put(store, "manifests/2.json", b"there")
        assert store.put_if_absent("manifests/2.json", b"mine") is False
        assert self.raw_get(store, "manifests/2.json") == b"there"

    def test_put_if_absent_after_delete(self, store: Store) -> None:
        store.put("fences/0/1", b"")
        store.delete("fences/0/1")
        assert store.put_if_absent("fences/0/1", b"again") is True
        assert store.get("fences/0/1") == b"again"

    @pytest.mark.timeout(120)
    def test_concurrent_put_if_absent_has_exactly_one_winner(self, store: Store) -> None:
        n, rounds = 8, 2
        for r in range(rounds):
            key = f"manifests/{r}.json"
            barrier = threading.Barrier(n)
            results: list[Any] = [None] * n

            def race(i: int, barrier: Any = barrier, results: list[Any] = results, key: str = key) -> None:
                data = f"writer {i} ".encode() * 2000
                barrier.wait(timeout=30)
                try:
                    results[i] = (store.put_if_absent(key, data), data)
                except BaseException as e:  # noqa: BLE001 - reported below
                    results[i] = e

            threads = [threading.Thread(target=race, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            errors = [r for r in results if not isinstance(r, tuple)]
            assert not errors, f"concurrent put_if_absent raised: {errors}"
            winners = [data for won, data in results if won]
            assert len(winners) == 1, f"{len(winners)} winners of put_if_absent({key!r})"
            assert store.get(key) == winners[0]  # the winner's bytes, complete
        assert store.list("manifests") == [f"manifests/{r}.json" for r in range(rounds)]

    # --- atomic visibility -----------------------------------------------------------------------

    @pytest.mark.timeout(120)
    def test_put_is_atomic_for_readers(self, store: Store) -> None:
        """A reader racing an overwrite sees the old bytes or the new bytes, never a mix or a prefix."""
        size = 1 << 20
        versions = [bytes([v]) * size for v in range(1, 5)]
        store.put("heartbeats/x.json", versions[0])
        stop = threading.Event()
        seen: list[Any] = []

        def read() -> None:
            while not stop.is_set():
                try:
                    seen.append(store.get("heartbeats/x.json"))
                except BaseException as e:  # noqa: BLE001
                    seen.append(e)
                    return

        reader = threading.Thread(target=read)
        reader.start()
        try:
            for i in range(12):
                store.put("heartbeats/x.json", versions[i % len(versions)])
        finally:
            stop.set()
            reader.join(timeout=60)
        assert seen
        for got in seen:
            assert not isinstance(got, BaseException), f"a get during a put raised {got!r}"
            assert got in versions, f"a get during a put returned {len(got)} bytes that no put wrote"

    @pytest.mark.timeout(120)
    def test_put_if_absent_is_atomic_for_readers(self, store: Store) -> None:
        """Until put_if_absent returns, a reader sees nothing or the complete object."""
        data = random.Random(1).randbytes(2 << 20)
        stop = threading.Event()
        seen: list[Any] = []

        def read() -> None:
            while not stop.is_set():
                try:
                    seen.append(store.get("manifests/9.json"))
                except ObjectNotFound:
                    seen.append(None)
                except BaseException as e:  # noqa: BLE001
                    seen.append(e)
                    return

        reader = threading.Thread(target=read)
        reader.start()
        try:
            time.sleep(0.01)
            assert store.put_if_absent("manifests/9.json", data) is True
            time.sleep(0.05)
        finally:
            stop.set()
            reader.join(timeout=60)
        for got in seen:
            assert got is None or got == data, f"a reader saw {got!r:.80}"
        assert store.get("manifests/9.json") == data

    # --- scan, list, list_dirs --------------------------------------------------------------------

    KEYS: ClassVar[list[str]] = ["fragments/1/0.g0.json", "fragments/10/0.g0.json", "fragments/1/1.g0.json",
            "chunks/ab/ab12", "chunks/cd/cd34", "manifests/1.json", "top"]

    def test_list_is_recursive_sorted_and_folder_based(self, store: Store) -> None:
        assert store.list() == []
        for k in self.KEYS:
            store.put(k, b"x")
        assert store.list() == sorted(self.KEYS)
        assert store.list("fragments/1") == ["fragments/1/0.g0.json", "fragments/1/1.g0.json"]
        assert store.list("fragments/1/") == store.list("fragments/1")
        assert store.list("chunks") == ["chunks/ab/ab12", "chunks/cd/cd34"]
        assert store.list("nothing/here") == []

    def test_list_sees_objects_written_behind_its_back(self, store: Store) -> None:
        self.raw_put(store, "chunks/ef/ef56", b"abc")
        assert store.list("chunks") == ["chunks/ef/ef56"]

    def test_scan_gives_keys_sizes_and_times(self, store: Store) -> None:
        before = time.time()
        for i, k in enumerate(self.KEYS):
            store.put(k, b"y" * i)
        after = time.time()
        infos = list(store.scan())
        assert all(isinstance(i, ObjectInfo) for i in infos)
        assert sorted(i.key for i in infos) == sorted(self.KEYS)
        for info in infos:
            assert info.size == self.KEYS.index(info.key)
            # S3 has whole seconds; allow for that and a little clock skew with a server
            assert before - 2 <= info.modified <= after + 2
            check_key(info.key)
        assert sorted(i.key for i in store.scan("fragments")) == sorted(k for k in self.KEYS if k.startswith("fragments/"))
        assert sorted(i.key for i in store.scan("fragments/1")) == ["fragments/1/0.g0.json", "fragments/1/1.g0.json"]
        assert list(store.scan("nothing")) == []

    def test_scan_many_objects(self, store: Store) -> None:
        """More objects than one listing page of most backends' small pages."""
        keys = [f"chunks/{i % 7:02x}/{i:032x}" for i in range(1100)]
        self._raw_put_many(store, keys)
        assert sorted(i.key for i in store.scan("chunks")) == sorted(keys)
        assert store.list_dirs("chunks") == sorted({k.split("/")[1] for k in keys})

    @pytest.mark.timeout(120)
    def test_scan_while_objects_are_deleted(self, store: Store) -> None:
        """Listing a folder while another process deletes in it (GC deleting manifests, readers
        deleting their leases) yields objects that existed, and never fails."""
        keys = [f"leases/read-{i:04d}.json" for i in range(120)]
        self._raw_put_many(store, keys)
        errors: list[BaseException] = []

        def delete_all() -> None:
            for k in keys:
                store.delete(k)

        deleter = threading.Thread(target=delete_all)
        deleter.start()
        scans = 0
        while deleter.is_alive() or scans == 0:
            scans += 1
            try:
                listed = [info.key for info in store.scan("leases")]
                assert set(listed) <= set(keys)
                assert set(store.list("leases")) <= set(keys)
            except StoreError as e:
                errors.append(e)
        deleter.join(60)
        assert not errors, f"{len(errors)} of {scans} listings failed while objects were deleted: {errors[0]}"
        assert store.list("leases") == []

    def test_list_dirs_is_one_level(self, store: Store) -> None:
        for k in self.KEYS:
            store.put(k, b"x")
        assert store.list_dirs() == ["chunks", "fragments", "manifests"]
        assert store.list_dirs("fragments") == ["1", "10"]
        assert store.list_dirs("fragments/") == ["1", "10"]
        assert store.list_dirs("chunks") == ["ab", "cd"]
        assert store.list_dirs("fragments/1") == []
        assert store.list_dirs("nothing") == []

    @pytest.mark.parametrize("prefix", ["/abs", "../x", "a//b", "a\\b"])
    def test_invalid_prefixes_are_refused(self, store: Store, prefix: str) -> None:
        for call in (store.list, store.list_dirs, lambda p: list(store.scan(p))):
            with pytest.raises(StoreError, match="invalid"):
                call(prefix)

    # --- delete, exists, modified -----------------------------------------------------------------

    def test_delete(self, store: Store) -> None:
        store.put("fences/0/1", b"")
        store.put("fences/0/2", b"")
        store.delete("fences/0/1")
        assert not store.exists("fences/0/1")
        assert self._raw_missing(store, "fences/0/1")
        assert store.list() == ["fences/0/2"]
        with pytest.raises(ObjectNotFound):
            store.get("fences/0/1")
        store.delete("fences/0/1")  # missing is fine

    def test_delete_of_an_object_written_behind_its_back(self, store: Store) -> None:
        self.raw_put(store, "leases/save-1.json", b"{}")
        assert store.exists("leases/save-1.json")
        store.delete("leases/save-1.json")
        assert self._raw_missing(store, "leases/save-1.json")

    def test_modified_is_recent(self, store: Store) -> None:
        before = time.time()
        store.put("heartbeats/1.json", b"{}")
        after = time.time()
        assert before - 2 <= store.modified("heartbeats/1.json") <= after + 2

    # --- child ------------------------------------------------------------------------------------

    def test_child_store_is_rooted_below(self, store: Store) -> None:
        run = store.child("runs/a")
        assert run.url == store.url + "/runs/a"
        assert type(run) is type(store)
        run.put("manifests/1.json", b"m")
        store.put("other", b"o")
        assert store.get("runs/a/manifests/1.json") == b"m"
        assert self.raw_get(store, "runs/a/manifests/1.json") == b"m"
        assert run.list() == ["manifests/1.json"]
        assert store.list() == ["other", "runs/a/manifests/1.json"]
        assert store.list_dirs("runs") == ["a"]
        assert self.reopen(run).get("manifests/1.json") == b"m"
        assert run.put_if_absent("manifests/1.json", b"x") is False

    @pytest.mark.parametrize("subpath", ["", "/abs", "../up", "a/../../b"])
    def test_child_cannot_leave_the_root(self, store: Store, subpath: str) -> None:
        with pytest.raises(StoreError, match="invalid"):
            store.child(subpath)

    # --- copy_from --------------------------------------------------------------------------------

    def test_copy_from_another_store_of_this_kind(self, store: Store) -> None:
        source = self.fresh_store()
        source.put("chunks/ab/ab01", b"payload")
        assert store.copy_from(source, "chunks/ab/ab01") is True
        assert store.get("chunks/ab/ab01") == b"payload"
        assert self.raw_get(store, "chunks/ab/ab01") == b"payload"
        assert store.copy_from(source, "chunks/ab/ab01") is False  # present: nothing copied
        source.put("chunks/ab/ab01", b"changed")  # the copy is not a view of the source
        assert store.get("chunks/ab/ab01") == b"payload"
        assert source.list() == ["chunks/ab/ab01"]

    def test_copy_from_does_not_replace(self, store: Store) -> None:
        source = self.fresh_store()
        source.put("manifests/1.json", b"theirs")
        store.put("manifests/1.json", b"ours")
        assert store.copy_from(source, "manifests/1.json") is False
        assert store.get("manifests/1.json") == b"ours"

    def test_copy_from_a_missing_key(self, store: Store) -> None:
        source = self.fresh_store()
        with pytest.raises(ObjectNotFound):
            store.copy_from(source, "chunks/ab/missing")
        assert not store.exists("chunks/ab/missing")

    def test_copy_from_a_memory_store(self, store: Store) -> None:
        import uuid

        from ckptlib.store import MemoryStore

        source = MemoryStore("/contract-src-" + uuid.uuid4().hex)
        try:
            source.put("chunks/cd/cd01", b"from memory")
            assert store.copy_from(source, "chunks/cd/cd01") is True
            assert store.get("chunks/cd/cd01") == b"from memory"
        finally:
            source.delete("chunks/cd/cd01")

    # --- temp files -------------------------------------------------------------------------------

    def test_remove_stale_temp_leaves_objects_alone(self, store: Store) -> None:
        for k in self.KEYS:
            store.put(k, b"x")
        removed = store.remove_stale_temp(time.time() + 3600)
        assert isinstance(removed, list)
        assert store.list() == sorted(self.KEYS)

    # --- keys -------------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_keys_are_refused(self, store: Store, key: str) -> None:
        for op, args in (("put", (b"x",)), ("put_if_absent", (b"x",)), ("get", ()), ("delete", ()),
                         ("modified", ())):
            with pytest.raises(StoreError, match="invalid"):
                getattr(store, op)(key, *args)
        assert store.list() == []

    def test_exists_of_an_invalid_key(self, store: Store) -> None:
        # exists() never raises for a missing object; an invalid key is either refused or "no"
        for key in INVALID_KEYS:
            try:
                assert store.exists(key) is False
            except StoreError as e:
                assert "invalid" in str(e)

    @pytest.mark.parametrize("key", ["a b", "caf\u00e9", "x.json", "-dash", "_u", "1", "a.b.c/d-e_f"])
    def test_unusual_but_valid_keys(self, store: Store, key: str) -> None:
        store.put(key, b"v")
        assert store.get(key) == b"v"
        assert store.list() == [key]

    # --- identity ---------------------------------------------------------------------------------

    def test_pickles_for_other_workers(self, store: Store) -> None:
        # Prefect/Dask may ship a Store to another worker; it must arrive usable.
        store.put("a", b"1")
        copy = pickle.loads(pickle.dumps(store))
        assert copy == store and copy.get("a") == b"1"

    def test_equal_when_reopened(self, store: Store) -> None:
        again = self.reopen(store)
        assert again == store and hash(again) == hash(store)
        assert store != self.fresh_store()

    def test_capabilities(self, store: Store) -> None:
        assert isinstance(store.capabilities, StoreCapabilities)
        assert store.capabilities.conditional_put is True
