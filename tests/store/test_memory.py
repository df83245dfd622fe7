"""The store contract on memory://."""

import uuid

import fsspec

from ckptlib.store import MemoryStore
from ckptlib.testing.store_contract import StoreContract


class TestMemoryStore(StoreContract):
    def make_store(self):
        return MemoryStore("/contract-" + uuid.uuid4().hex)

    def raw_get(self, store, key):
        return fsspec.filesystem("memory").cat_file(f"{store.root}/{key}")

    def raw_put(self, store, key, data):
        fsspec.filesystem("memory").pipe_file(f"{store.root}/{key}", data)
