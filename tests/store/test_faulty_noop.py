"""FaultyStore without rules is a transparent wrapper: it passes the whole store contract."""

import uuid
from pathlib import Path

from ckptlib.store import LocalStore, Store
from ckptlib.testing import FaultyStore
from ckptlib.testing.store_contract import StoreContract


class TestFaultyStoreWithoutRules(StoreContract):
    def make_store(self):
        return FaultyStore(LocalStore(str(self.request.getfixturevalue("tmp_path") / f"s-{uuid.uuid4().hex[:8]}")))

    def reopen(self, store):
        return FaultyStore(Store.from_url(store.url))

    def raw_get(self, store, key):
        return (Path(store.inner.root) / key).read_bytes()

    def raw_put(self, store, key, data):
        path = Path(store.inner.root) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def test_calls_are_recorded(self, store):
        store.put("a", b"1")
        store.get("a")
        assert [(c.op, c.key, c.fault) for c in store.calls] == [("put", "a", None), ("get", "a", None)]
