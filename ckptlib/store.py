"""Key -> bytes storage under one root URL: a local directory, ``memory://`` or ``s3://``.

Contract
--------
Everything above this module (commit, writer, reader, gc, validate) reaches storage only through a
:class:`Store` built by ``Store.from_url(url, storage_options)``. Keys are ``/``-separated relative
paths (``chunks/ab/abcdef...``, ``manifests/10.json``); a key is never also a folder of other keys
(a local directory and SeaweedFS's filer cannot hold both).

What every backend guarantees:

* ``put`` is atomic for readers: a concurrent ``get`` sees the old bytes or the new bytes, never a
  mix or a prefix. Locally: temp file in the same directory, fsync, ``os.replace``, fsync of the
  directory. On S3 a single PUT (or a completed multipart upload) is atomic by itself.
* ``put_if_absent`` is an atomic exclusive create: among any number of concurrent callers for one
  key exactly one gets ``True``, and the bytes stored are that caller's, complete. This is the
  commit point of a checkpoint (``manifests/<step>.json``). Locally: fsynced temp file, then
  ``os.link(tmp, final)``, which fails if ``final`` exists. On S3: a conditional PUT
  (``If-None-Match: *``). In memory: a process-wide lock.
* ``get`` of a missing key raises :class:`~ckptlib.errors.ObjectNotFound`; every other failure is one
  :class:`~ckptlib.errors.StoreError` whose message names the cause and the fix.
* Every call returns or raises in bounded time: S3 calls have connect/read timeouts and a bounded
  number of retries of transient errors (5xx, throttling, dropped connections).

Where a guarantee does not hold:

* ``put_if_absent`` returning ``False`` means "the key exists", not "someone else wrote it": on S3,
  a conditional PUT whose reply was lost is retried by the client and then fails its own
  precondition. Callers that must know (the commit) compare the stored bytes or digest.
* ``memory://`` is atomic only within one process; it is for tests and single-process runs.
* ``exists``/``modified`` on S3 cannot tell a missing key from a missing bucket (HEAD has no error
  body); ``from_url`` checks the bucket once so that case surfaces early.
* ``modified`` has 1 s resolution on S3 (HTTP dates).
* Local calls are as bounded as the filesystem under them (a hung NFS hard mount hangs them).
* Local temp files (``.ckpt-tmp-*``) of a writer that crashed mid-``put`` stay behind; ``list``
  hides them, garbage collection may delete them.
"""

from __future__ import annotations

import inspect
import os
import re
import stat
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ckptlib.errors import ObjectNotFound, StoreError

__all__ = ["Store", "StoreCapabilities", "LocalStore", "MemoryStore", "S3Store", "SUPPORTED_URLS"]

SUPPORTED_URLS = "a local path, file:///absolute/path, memory://name, s3://bucket[/prefix]"

# Temp files of local writes start with this; keys may not, so `list` can hide them.
_TMP_PREFIX = ".ckpt-tmp-"


@dataclass(frozen=True)
class StoreCapabilities:
    """What a backend can do atomically.

    conditional_put: ``put_if_absent`` is atomic across processes (and machines, for S3).
    atomic_rename: the backend can rename an object atomically (local filesystems only).
    """

    conditional_put: bool
    atomic_rename: bool


def _check_key(key: str, what: str = "key") -> str:
    """Return ``key`` if it is a clean relative path; raise StoreError naming what is wrong."""
    if not isinstance(key, str) or not key:
        raise StoreError(f"invalid {what} {key!r}: expected a non-empty '/'-separated relative path")
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise StoreError(
            f"invalid {what} {key!r}: use a relative path like 'chunks/ab/abcd' "
            "(no leading '/', no empty, '.' or '..' parts, no backslashes)"
        )
    if any(p.startswith(_TMP_PREFIX) for p in parts):
        raise StoreError(f"invalid {what} {key!r}: names starting with {_TMP_PREFIX!r} are reserved")
    return key


def _check_prefix(prefix: str) -> str:
    """A list prefix is a folder: '' (everything) or a relative path; a trailing '/' is optional."""
    prefix = prefix.rstrip("/") if isinstance(prefix, str) else prefix
    return _check_key(prefix, "list prefix") if prefix != "" else ""


class Store:
    """Bytes under keys, relative to one root. Build one with :meth:`from_url`.

    Subclasses implement every method below; see the module docstring for the guarantees.
    """

    url: str
    capabilities: StoreCapabilities

    @classmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
        """Open the store at ``url``: a plain path, ``file://``, ``memory://name`` or ``s3://bucket/prefix``.

        ``storage_options`` are s3fs arguments (``endpoint_url``, ``key``, ``secret``, ...) and
        apply to ``s3://`` only. For S3 the bucket is checked here (one LIST request), so a wrong
        endpoint, bucket or credentials fail now, with a message that says what to fix.
        """
        if not isinstance(url, str) or not url.strip():
            raise StoreError(f"empty store URL {url!r}: use {SUPPORTED_URLS}")
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise StoreError(
                f"storage_options must be a dict of s3fs arguments, got {type(storage_options).__name__}"
            )
        url = url.strip()
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme != "s3" and storage_options:
            raise StoreError(
                f"storage_options {sorted(storage_options)} apply only to s3:// URLs, not {url!r}: "
                "drop them or use an s3:// URL"
            )
        if scheme == "":
            return LocalStore(os.path.abspath(os.path.expanduser(url)))
        if scheme == "file":
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
                raise StoreError(
                    f"file URL {url!r} is not absolute: write file:///absolute/path (three slashes) "
                    "or pass a plain path"
                )
            return LocalStore(os.path.abspath(parts.path))
        if scheme == "memory":
            name = url[len("memory://"):].strip("/")
            if not name:
                raise StoreError(f"memory URL {url!r} needs a name: memory://run1")
            _check_key(name, "memory store name")
            return MemoryStore("/" + name)
        if scheme == "s3":
            parts = urlsplit(url)
            bucket, prefix = parts.netloc, parts.path.strip("/")
            if not bucket:
                raise StoreError(f"S3 URL {url!r} has no bucket: write s3://bucket/prefix")
            if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
                raise StoreError(
                    f"invalid S3 bucket name {bucket!r} in {url!r}: bucket names are 3-63 characters "
                    "of lowercase letters, digits, '.' and '-'"
                )
            if prefix:
                _check_key(prefix, "S3 prefix")
            store = S3Store(bucket, prefix, dict(storage_options or {}))
            store.check()
            return store
        raise StoreError(f"unsupported store URL scheme {scheme + '://'!r} in {url!r}: use {SUPPORTED_URLS}")

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``; ObjectNotFound if there are none."""
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, replacing what was there; atomic for readers."""
        raise NotImplementedError

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` only if it does not exist. True: we wrote it; False: it existed."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key`` (a folder of other keys is not one)."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        """All keys under the folder ``prefix`` ('' = the whole store), recursive, sorted.

        ``prefix`` is a folder, not a string prefix: ``list("fragments/1")`` does not return
        ``fragments/10/...``.
        """
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is fine (deletes are idempotent)."""
        raise NotImplementedError

    def modified(self, key: str) -> float:
        """Last-modified time of ``key``, epoch seconds; ObjectNotFound if missing."""
        raise NotImplementedError

    def child(self, subpath: str) -> Store:
        """A store of the same kind rooted at ``<root>/<subpath>`` (e.g. one run under a store root)."""
        raise NotImplementedError

    def _not_found(self, key: str) -> ObjectNotFound:
        return ObjectNotFound(f"no object {key!r} in {self.url}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.url == self.url  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.url))


# --------------------------------------------------------------------------------------- local


def _fsync_dir(path: str) -> None:
    """Make a directory entry (a new, renamed or linked file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    """A directory on a local (POSIX) filesystem. The directory is created on the first write."""

    capabilities = StoreCapabilities(conditional_put=True, atomic_rename=True)

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url = "file://" + self.root
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StoreError(f"store root {self.root} is a file, not a directory: pick another path")

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *_check_key(key).split("/"))

    @contextmanager
    def _os_errors(self, op: str, key: str) -> Iterator[None]:
        try:
            yield
        except PermissionError as e:
            raise StoreError(
                f"permission denied: cannot {op} {key!r} in {self.url} ({e.strerror}): "
                "fix the directory's permissions or use another store path"
            ) from e
        except OSError as e:
            raise StoreError(f"cannot {op} {key!r} in {self.url}: {e}") from e

    def _makedirs(self, path: str) -> None:
        """Create ``path`` and missing parents, fsyncing each new entry into its parent."""
        if os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        if parent != path:
            self._makedirs(parent)
        try:
            os.mkdir(path)
        except FileExistsError:
            return  # a concurrent writer made it
        _fsync_dir(parent)

    def _write_temp(self, path: str, data: bytes) -> str:
        """Write ``data`` to a fsynced temp file beside ``path`` (same filesystem: link/replace work)."""
        folder = os.path.dirname(path)
        self._makedirs(folder)
        tmp = os.path.join(folder, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    def get(self, key: str) -> bytes:
        path = self._path(key)
        with self._os_errors("read", key):
            try:
                with open(path, "rb") as f:
                    return f.read()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise self._not_found(key) from None

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with self._os_errors("write", key):
            tmp = self._write_temp(path, data)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
            _fsync_dir(os.path.dirname(path))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with self._os_errors("create", key):
            tmp = self._write_temp(path, data)
            try:
                # link() is the exclusive step: it fails if `path` exists, and the file it
                # publishes is already complete and fsynced. (pipe_file(mode="create") is not
                # atomic locally: it checks, then writes.)
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            _fsync_dir(os.path.dirname(path))
            return True

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(key))

    def list(self, prefix: str = "") -> list[str]:
        prefix = _check_prefix(prefix)
        base = os.path.join(self.root, *prefix.split("/")) if prefix else self.root
        keys = []
        with self._os_errors("list", prefix):
            for folder, _dirs, files in os.walk(base):
                rel = os.path.relpath(folder, self.root).replace(os.sep, "/")
                keys += [
                    name if rel == "." else f"{rel}/{name}"
                    for name in files
                    if not name.startswith(_TMP_PREFIX)
                ]
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._os_errors("delete", key):
            try:
                os.unlink(path)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                pass  # not an object: nothing to delete

    def modified(self, key: str) -> float:
        path = self._path(key)
        with self._os_errors("stat", key):
            try:
                info = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                raise self._not_found(key) from None
        if stat.S_ISDIR(info.st_mode):
            raise self._not_found(key)  # a folder of keys, not an object
        return info.st_mtime

    def child(self, subpath: str) -> LocalStore:
        return LocalStore(os.path.join(self.root, *_check_key(subpath, "subpath").split("/")))


# -------------------------------------------------------------------------------------- memory

# One lock for every memory store in the process: fsspec's memory filesystem is one global dict.
_MEMORY_LOCK = threading.RLock()


class MemoryStore(Store):
    """fsspec's in-process memory filesystem; shared by every ``memory://`` user in the process."""

    capabilities = StoreCapabilities(conditional_put=True, atomic_rename=False)

    def __init__(self, root: str):
        import fsspec

        self.fs = fsspec.filesystem("memory")
        self.root = "/" + root.strip("/")
        self.url = "memory://" + self.root.lstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{_check_key(key)}"

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except (FileNotFoundError, IsADirectoryError):
            raise self._not_found(key) from None

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with _MEMORY_LOCK:
            self.fs.pipe_file(path, bytes(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with _MEMORY_LOCK:  # check-then-write, made atomic by the lock (this process only)
            if self.fs.isfile(path):
                return False
            self.fs.pipe_file(path, bytes(data))
            return True

    def exists(self, key: str) -> bool:
        return self.fs.isfile(self._path(key))

    def list(self, prefix: str = "") -> list[str]:
        prefix = _check_prefix(prefix)
        base = f"{self.root}/{prefix}/" if prefix else f"{self.root}/"
        with _MEMORY_LOCK:
            paths = list(self.fs.store)
        return sorted(p[len(self.root) + 1:] for p in paths if p.startswith(base))

    def delete(self, key: str) -> None:
        path = self._path(key)
        with _MEMORY_LOCK:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                pass

    def modified(self, key: str) -> float:
        try:
            return self.fs.modified(self._path(key)).timestamp()
        except FileNotFoundError:
            raise self._not_found(key) from None

    def child(self, subpath: str) -> MemoryStore:
        return MemoryStore(f"{self.root}/{_check_key(subpath, 'subpath')}")


# ------------------------------------------------------------------------------------------ S3

# Bounded time for every request: a dead endpoint fails in seconds, a slow one in well under a
# minute per attempt. botocore's "standard" retry mode retries 5xx, throttling and connection
# errors (max_attempts counts the first try); s3fs retries a few more errors itself (`retries`).
_S3_CONFIG = {
    "connect_timeout": 5,
    "read_timeout": 30,
    "retries": {"max_attempts": 3, "mode": "standard"},
}
_S3FS_RETRIES = 2
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


def _s3_filesystem(options: dict[str, Any]):
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
        self._conn = _fs or _s3_filesystem(storage_options)  # (filesystem, endpoint), shared by children
        self.fs, endpoint = self._conn
        self.endpoint = endpoint or "the default AWS S3 endpoint"
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"

    def __reduce__(self):
        # Rebuild from the arguments (our retry settings are not part of s3fs's pickled state).
        return (S3Store, (self.bucket, self.prefix, self.storage_options))

    def _key(self, key: str) -> str:
        key = _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _path(self, key: str) -> str:
        return f"{self.bucket}/{self._key(key)}"

    def _error(self, exc: BaseException, op: str, key: str | None) -> StoreError:
        """Turn an s3fs/botocore exception into one StoreError naming the cause and the fix."""
        from botocore.exceptions import (ConnectionError as BotoConnectionError, HTTPClientError,
                                         NoCredentialsError, PartialCredentialsError)

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
            self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=prefix, MaxKeys=1)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        with self._errors("get", key):
            try:
                return self.fs.cat_file(path)
            except FileNotFoundError as e:
                if _s3_code(e) == "NoSuchBucket":
                    raise
                raise self._not_found(key) from None

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with self._errors("put", key):
            self.fs.pipe_file(path, bytes(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        with self._errors("put_if_absent", key):
            attempt = 0
            while True:
                try:
                    self.fs.pipe_file(path, bytes(data), mode="create")
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
            return self.fs.call_s3("head_object", Bucket=self.bucket, Key=self._key(key))
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        with self._errors("exists", key):
            return self._head(key) is not None

    def list(self, prefix: str = "") -> list[str]:
        prefix = _check_prefix(prefix)
        folder = "/".join(p for p in (self.prefix, prefix) if p)
        s3_prefix = folder + "/" if folder else ""
        skip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        token: dict[str, str] = {}
        with self._errors("list", prefix or None):
            while True:
                page = self.fs.call_s3("list_objects_v2", Bucket=self.bucket, Prefix=s3_prefix, **token)
                keys += [obj["Key"][skip:] for obj in page.get("Contents", [])]
                if not page.get("IsTruncated"):
                    break
                token = {"ContinuationToken": page["NextContinuationToken"]}
        return sorted(keys)

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self._key(key))  # 204 if missing

    def modified(self, key: str) -> float:
        with self._errors("stat", key):
            head = self._head(key)
        if head is None:
            raise self._not_found(key)
        return head["LastModified"].timestamp()

    def child(self, subpath: str) -> S3Store:
        prefix = "/".join(p for p in (self.prefix, _check_key(subpath, "subpath")) if p)
        return S3Store(self.bucket, prefix, self.storage_options, _fs=self._conn)
