"""``s3://bucket/prefix`` through s3fs: AWS S3, SeaweedFS, MinIO, ..."""

from __future__ import annotations

import inspect
import os
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from ckptlib.errors import ObjectNotFound, StoreError

from .base import (
    ObjectInfo,
    Store,
    StoreCapabilities,
    check_key,
    check_max_bytes,
    check_prefix,
    redact_url,
    register_scheme,
)

# Bounded time for every request: a dead endpoint fails in seconds, a stalled one within a minute
# (2 attempts x (5 s to connect + 20 s without a byte)). botocore's "standard" retry mode retries
# 5xx, throttling and connection errors (max_attempts counts the first try); s3fs's own retry loop
# is set to one try so the two do not multiply. Override with storage_options={"config_kwargs":
# {"read_timeout": ..., "retries": {...}}} for slow links or huge objects.
_S3_CONFIG = {
    "connect_timeout": 5,
    "read_timeout": 20,
    "retries": {"max_attempts": 2, "mode": "standard"},
}
_S3FS_RETRIES = 1
# Every call, retries included, ends within this many seconds (fsspec cancels it: the request is
# aborted, not left running): a stalled endpoint fails a save within a minute. storage_options
# {"ckpt_timeout_s": ...} changes it (e.g. for huge objects over a slow link).
DEFAULT_TIMEOUT_S = 55.0
_CONFLICT_RETRIES = 4  # 409 ConditionalRequestConflict: a concurrent conditional write, retry

_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                    "AuthorizationHeaderMalformed", "InvalidSecurity"}
_DENIED = {"AccessDenied", "AllAccessDisabled", "AccountProblem", "403"}


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code (``NoSuchBucket``, ``PreconditionFailed``, ``404``...) behind an exception."""
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code")
    return None


def _s3_filesystem(options: dict[str, Any]) -> tuple[Any, str | None]:
    """An s3fs filesystem with our timeouts and retries; ``options`` (s3fs kwargs) win."""
    import s3fs

    known = set(inspect.signature(s3fs.S3FileSystem.__init__).parameters) - {"self", "args", "kwargs"}
    known |= {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "batch_size"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise StoreError(
            f"unknown storage_options {unknown} for s3://: use s3fs arguments such as "
            "endpoint_url, key, secret, token, client_kwargs, config_kwargs"
        )
    opts = dict(options)
    endpoint = opts.get("endpoint_url") or opts.get("client_kwargs", {}).get("endpoint_url")
    if not endpoint:
        # botocore reads AWS_ENDPOINT_URL itself only in recent versions; pass it explicitly.
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
    opts["use_listings_cache"] = False  # others write the same bucket: never trust a cached listing
    opts["config_kwargs"] = {**_S3_CONFIG, **opts.get("config_kwargs", {})}
    fs = s3fs.S3FileSystem(**opts)
    fs.retries = _S3FS_RETRIES  # not a constructor argument; s3fs's own retry loop
    return fs, endpoint


class S3Store(Store):
    """Objects under ``s3://bucket/prefix`` through s3fs; works with AWS, SeaweedFS, MinIO..."""

    capabilities = StoreCapabilities(conditional_put=True, atomic_rename=False)

    def __init__(self, bucket: str, prefix: str, storage_options: dict[str, Any], _fs: tuple | None = None):
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.storage_options = storage_options
        options = dict(storage_options)
        timeout = options.pop("ckpt_timeout_s", DEFAULT_TIMEOUT_S)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise StoreError(f"storage_options ckpt_timeout_s must be a positive number of seconds, got {timeout!r}")
        self.timeout_s = float(timeout)
        self._conn = _fs or _s3_filesystem(options)  # (filesystem, endpoint), shared by children
        self.fs, endpoint = self._conn
        self.endpoint = endpoint or "the default AWS S3 endpoint"
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"

    def __reduce__(self):
        # Rebuild from the arguments (our retry settings are not part of s3fs's pickled state).
        return (S3Store, (self.bucket, self.prefix, self.storage_options))

    def _key(self, key: str) -> str:
        key = check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _path(self, key: str) -> str:
        return f"{self.bucket}/{self._key(key)}"

    def _error(self, exc: BaseException, op: str, key: str | None) -> StoreError:
        """Turn an s3fs/botocore exception into one StoreError naming the cause and the fix."""
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError, NoCredentialsError, PartialCredentialsError

        code = _s3_code(exc)
        what = f"{op} {key!r} in {self.url}" if key else f"{op} {self.url}"
        creds = "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or storage_options 'key' / 'secret'"
        if code == "NoSuchBucket":
            return StoreError(
                f"bucket {self.bucket!r} does not exist at {self.endpoint}: create it (e.g. "
                f"`aws --endpoint-url {self.endpoint} s3 mb s3://{self.bucket}`) or fix the URL"
            )
        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return StoreError(f"no S3 credentials to {what}: set {creds}")
        if code in _BAD_CREDENTIALS:
            return StoreError(f"S3 credentials rejected by {self.endpoint} ({code}) to {what}: check {creds}")
        if code in _DENIED or isinstance(exc, PermissionError):
            return StoreError(
                f"permission denied to {what} ({code or exc}): the credentials are not allowed "
                f"this on bucket {self.bucket!r}; grant it or use other credentials ({creds})"
            )
        if isinstance(exc, (BotoConnectionError, HTTPClientError, TimeoutError)):
            return StoreError(
                f"cannot reach the S3 endpoint {self.endpoint} to {what} ({exc}): check that the "
                "server is running and that AWS_ENDPOINT_URL or storage_options['endpoint_url'] "
                "points to it"
            )
        return StoreError(f"cannot {what} at {self.endpoint}: {code or type(exc).__name__}: {exc}")

    @contextmanager
    def _errors(self, op: str, key: str | None = None) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except (ObjectNotFound, StoreError):
            raise
        except (OSError, BotoCoreError, ClientError) as e:
            raise self._error(e, op, key) from e

    def check(self) -> None:
        """Fail now, clearly, if the endpoint, the bucket or the credentials are wrong."""
        prefix = self.prefix + "/" if self.prefix else ""
        with self._errors("list"):
            self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=prefix, MaxKeys=1, timeout=self.timeout_s)

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        if check_max_bytes(max_bytes) is not None and max_bytes is not None:
            return self._get_bounded(key, path, max_bytes)
        with self._errors("get", key):
            try:
                return self.fs.cat_file(path, timeout=self.timeout_s)
            except FileNotFoundError as e:
                if _s3_code(e) == "NoSuchBucket":
                    raise
                raise self._not_found(key) from None

    def _get_bounded(self, key: str, path: str, max_bytes: int) -> bytes:
        """One ranged GET of the first ``max_bytes + 1`` bytes: bounded whatever the object is."""
        with self._errors("get", key):
            try:
                data = self.fs.cat_file(path, start=0, end=max_bytes + 1, timeout=self.timeout_s)
            except FileNotFoundError as e:
                if _s3_code(e) == "NoSuchBucket":
                    raise
                raise self._not_found(key) from None
            except OSError as e:
                if _s3_code(e) != "InvalidRange":
                    raise
                data = self._empty_or_raise(key, e)  # S3 answers a range of an empty object with 416
            if len(data) > max_bytes:
                head = self._head(key)
                raise self._too_large(key, int(head["ContentLength"]) if head else None, max_bytes)
        return data

    def _empty_or_raise(self, key: str, error: OSError) -> bytes:
        """b"" when ``key`` is an empty object (whose every range is "not satisfiable")."""
        head = self._head(key)
        if head is None:
            raise self._not_found(key) from None
        if int(head.get("ContentLength", -1)) == 0:
            return b""
        raise error

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        with self._errors("put", key):
            self.fs.pipe_file(path, bytes(data), timeout=self.timeout_s)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        path = self._path(key)
        with self._errors("put_if_absent", key):
            attempt = 0
            while True:
                try:
                    self.fs.pipe_file(path, bytes(data), mode="create", timeout=self.timeout_s)
                    return True
                except OSError as e:
                    code = _s3_code(e)
                    # AWS/moto: FileExistsError. SeaweedFS sends PreconditionFailed without the
                    # <Condition> element, which s3fs turns into OSError(EINVAL).
                    if isinstance(e, FileExistsError) or code == "PreconditionFailed":
                        return False
                    attempt += 1
                    if code != "ConditionalRequestConflict" or attempt >= _CONFLICT_RETRIES:
                        raise
                time.sleep(0.05 * 2**attempt)

    def _head(self, key: str) -> dict | None:
        """HEAD the object; None if missing."""
        try:
            return self.fs.call_s3("head_object", Bucket=self.bucket, Key=self._key(key), timeout=self.timeout_s)
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        with self._errors("exists", key):
            return self._head(key) is not None

    def _pages(self, prefix: str, **extra: Any) -> Iterator[dict]:
        folder = "/".join(p for p in (self.prefix, check_prefix(prefix)) if p)
        s3_prefix = folder + "/" if folder else ""
        token: dict[str, str] = {}
        with self._errors("list", prefix or None):
            while True:
                page = self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=s3_prefix, **extra, **token,
                                       timeout=self.timeout_s)
                yield page
                if not page.get("IsTruncated"):
                    return
                token = {"ContinuationToken": page["NextContinuationToken"]}

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        skip = len(self.prefix) + 1 if self.prefix else 0
        for page in self._pages(prefix):
            for obj in page.get("Contents", []):
                yield ObjectInfo(obj["Key"][skip:], int(obj.get("Size", 0)), obj["LastModified"].timestamp())

    def list_dirs(self, prefix: str = "") -> list[str]:
        names = []
        for page in self._pages(prefix, Delimiter="/"):
            names += [p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for p in page.get("CommonPrefixes", [])]
        return sorted(names)

    def copy_from(self, source: Store, key: str) -> bool:
        """A server-side copy when both stores are on one endpoint (no bytes through this process)."""
        if not (isinstance(source, S3Store) and source.endpoint == self.endpoint
                and source.storage_options == self.storage_options):
            return super().copy_from(source, key)
        if self.exists(key):
            return False
        with self._errors("copy", key):
            try:
                self.fs.call_s3("copy_object", Bucket=self.bucket, Key=self._key(key), timeout=self.timeout_s,
                                CopySource={"Bucket": source.bucket, "Key": source._key(key)})
            except FileNotFoundError:
                raise source._not_found(key) from None
        return True

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self._key(key), timeout=self.timeout_s)  # 204 if missing

    def modified(self, key: str) -> float:
        with self._errors("stat", key):
            head = self._head(key)
        if head is None:
            raise self._not_found(key)
        return head["LastModified"].timestamp()

    def child(self, subpath: str) -> S3Store:
        prefix = "/".join(p for p in (self.prefix, check_key(subpath, "subpath")) if p)
        return S3Store(self.bucket, prefix, self.storage_options, _fs=self._conn)


def _open_s3_url(url: str, storage_options: Mapping[str, Any]) -> S3Store:
    """``s3://bucket[/prefix]``, its bucket checked now (one LIST request)."""
    shown = redact_url(url)
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise StoreError(
            f"S3 URL {shown!r} carries credentials: they would show in logs, errors and Prefect; pass them "
            "in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or storage_options instead"
        )
    bucket, prefix = parts.netloc, parts.path.strip("/")
    if not bucket:
        raise StoreError(f"S3 URL {shown!r} has no bucket: write s3://bucket/prefix")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise StoreError(
            f"invalid S3 bucket name {bucket!r} in {shown!r}: bucket names are 3-63 characters of lowercase "
            "letters, digits, '.' and '-'"
        )
    if prefix:
        check_key(prefix, "S3 prefix")
    store = S3Store(bucket, prefix, dict(storage_options))
    store.check()
    return store


register_scheme("s3", _open_s3_url, storage_options=True)
