"""The store contract on S3 (a real SeaweedFS on loopback); the back door is a plain botocore client."""

import uuid

import pytest

from ckptlib.store import Store
from ckptlib.testing.store_contract import StoreContract

pytestmark = pytest.mark.s3


class TestS3Store(StoreContract):
    def make_store(self):
        loc = self.request.getfixturevalue("s3_url")
        return Store.from_url(f"{loc.url}/{uuid.uuid4().hex[:8]}", loc.storage_options)

    def _client(self):
        if not hasattr(self, "_s3"):
            self._s3 = self.request.getfixturevalue("seaweedfs")._client()
        return self._s3

    def raw_get(self, store, key):
        try:
            return self._client().get_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}")["Body"].read()
        except self._client().exceptions.NoSuchKey:
            raise FileNotFoundError(key) from None

    def raw_put(self, store, key, data):
        self._client().put_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}", Body=data)
