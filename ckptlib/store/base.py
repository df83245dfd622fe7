"""The storage contract: key -> bytes under one root URL.

Contract
--------
Everything above this package (commit, writer, reader, gc, validate) reaches storage only through
a :class:`Store` built by :func:`open_store` (``Store.from_url``). Keys are ``/``-separated relative
paths (``chunks/ab/abcdef...``, ``manifests/10.json``); a key is never also a folder of other keys
(a local directory and SeaweedFS's filer cannot hold both).

What every backend guarantees:

* ``put`` is atomic for readers: a concurrent ``get`` sees the old bytes or the new bytes, never a
  mix or a prefix. Locally: temp file in the same directory, fsync, ``os.replace``, fsync of the
  directory. On S3 a single PUT is atomic by itself.
* ``put_if_absent`` is an atomic exclusive create: among any number of concurrent callers for one
  key exactly one gets ``True``, and the bytes stored are that caller's, complete. This is the
  commit point of a checkpoint (``manifests/<step>.json``). Locally: fsynced temp file, then
  ``os.link(tmp, final)``, which fails if ``final`` exists. On S3: a conditional PUT
  (``If-None-Match: *``). In memory: a process-wide lock.
* ``get`` of a missing key raises :class:`~ckptlib.errors.ObjectNotFound`; every other failure is
  one :class:`~ckptlib.errors.StoreError` whose message names the cause and the fix.
* ``get(key, max_bytes=n)`` is a bounded read: an object larger than ``n`` bytes raises
  :class:`~ckptlib.errors.ObjectTooLarge` (naming the object, its size when known, and ``n``)
  having read at most ``n + 1`` of its bytes: a local store and ``memory://`` look at the size
  first and read none; S3 asks for the first ``n + 1`` bytes (one ranged GET, the same request as
  a plain read). Every document a reader parses is read this way, with the cap of its kind.
* ``scan`` yields every object under a folder with its size and modification time, page by page
  (memory stays bounded however many objects there are); ``list`` is its sorted keys.
* Every call returns or raises in bounded time: S3 calls have connect/read timeouts and a bounded
  number of retries of transient errors (5xx, throttling, dropped connections); by default a
  stalled endpoint fails a call within a minute.
* Nothing outside the root is ever read, written or deleted: keys with ``..``, absolute paths or
  backslashes are refused, and a local store refuses to pass through a symbolic link inside it.

Where a guarantee does not hold:

* ``put_if_absent`` returning ``False`` means "the key exists", not "someone else wrote it": on S3,
  a conditional PUT whose reply was lost is retried by the client and then fails its own
  precondition. Callers that must know (the commit) compare the stored bytes or digest.
* ``memory://`` is atomic only within one process; it is for tests and single-process runs.
* ``exists``/``modified`` on S3 cannot tell a missing key from a missing bucket (HEAD has no error
  body); ``from_url`` checks the bucket once so that case surfaces early.
* ``modified`` has 1 s resolution on S3 (HTTP dates).
* Local calls are as bounded as the filesystem under them (a hung NFS hard mount hangs them), and
  the symbolic-link check is a check, not a lock: someone who can write the store directory while
  a call runs can still swap a folder for a link between the check and the call.
* Local temp files (``.ckpt-tmp-*``) of a writer killed mid-``put`` stay behind; ``scan`` hides
  them and ``remove_stale_temp`` (called by garbage collection) deletes them after a grace period.

Note for implementers: a new backend subclasses :class:`Store`, implements the methods marked
"backend", registers its URL schemes with :func:`register_scheme` when its module is imported (and
``ckptlib/store/__init__.py`` imports the module), and passes
``ckptlib.testing.store_contract.StoreContract``.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ckptlib.errors import ObjectNotFound, ObjectTooLarge, StoreError

SUPPORTED_URLS = "a local path, file:///absolute/path, memory://name, s3://bucket[/prefix]"

# Temp files of local writes start with this; keys may not, so `scan` can hide them.
TMP_PREFIX = ".ckpt-tmp-"


@dataclass(frozen=True)
class StoreCapabilities:
    """What a backend can do atomically.

    conditional_put: ``put_if_absent`` is atomic across processes (and machines, for S3).
    atomic_rename: the backend can rename an object atomically (local filesystems only).
    """

    conditional_put: bool
    atomic_rename: bool


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float  # epoch seconds


def check_key(key: str, what: str = "key") -> str:
    """Return ``key`` if it is a clean relative path; raise StoreError naming what is wrong."""
    if not isinstance(key, str) or not key:
        raise StoreError(f"invalid {what} {key!r}: expected a non-empty '/'-separated relative path")
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or "\0" in key or any(p in ("", ".", "..") for p in parts):
        raise StoreError(
            f"invalid {what} {key!r}: use a relative path like 'chunks/ab/abcd' "
            "(no leading '/', no empty, '.' or '..' parts, no backslashes)"
        )
    if any(p.startswith(TMP_PREFIX) for p in parts):
        raise StoreError(f"invalid {what} {key!r}: names starting with {TMP_PREFIX!r} are reserved")
    return key


def is_clean_key(key: str) -> bool:
    try:
        check_key(key)
    except StoreError:
        return False
    return True


def check_max_bytes(max_bytes: int | None) -> int | None:
    """``max_bytes`` of a bounded read: None (no bound) or an int >= 0."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes must be None or an int >= 0, got {max_bytes!r}")
    return max_bytes


def check_prefix(prefix: str) -> str:
    """A list prefix is a folder: '' (everything) or a relative path; a trailing '/' is optional."""
    prefix = prefix.rstrip("/") if isinstance(prefix, str) else prefix
    return check_key(prefix, "list prefix") if prefix != "" else ""


def redact_url(url: str) -> str:
    """``url`` without credentials (``s3://key:secret@bucket`` -> ``s3://***@bucket``): URLs land
    in errors, logs and reports, credentials must not."""
    if not isinstance(url, str) or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    netloc, sep, path = rest.partition("/")
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return f"{scheme}://{netloc}{sep}{path}"


class Store:
    """Bytes under keys, relative to one root. Build one with :meth:`from_url`.

    Subclasses implement every method marked "backend"; see the module docstring for the
    guarantees.
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
        return open_store(url, storage_options)

    # --- backend ----------------------------------------------------------------------------------

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        """The bytes stored under ``key``; ObjectNotFound if there are none. ``max_bytes``: refuse
        an object larger than that (ObjectTooLarge) after reading at most ``max_bytes + 1`` bytes."""
        raise NotImplementedError

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` under ``key``, replacing what was there; atomic for readers. ``data`` (here
        and in ``put_if_absent``) is any contiguous bytes-like object, read during the call only: a
        save passes views of its own buffers, which it reuses afterwards, so a store that keeps the
        bytes beyond the call copies them."""
        raise NotImplementedError

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        """Create ``key`` with ``data`` only if it does not exist. True: we wrote it; False: it existed."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key`` (a folder of other keys is not one)."""
        raise NotImplementedError

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under the folder ``prefix`` ('' = the whole store), recursive, in no
        particular order, read page by page."""
        raise NotImplementedError

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        """Names of the folders directly under ``prefix`` (one level), sorted."""
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

    # --- with defaults ------------------------------------------------------------------------------

    def list(self, prefix: str = "") -> builtins.list[str]:
        """All keys under the folder ``prefix``, recursive, sorted. ``prefix`` is a folder, not a
        string prefix: ``list("fragments/1")`` does not return ``fragments/10/...``."""
        return sorted(info.key for info in self.scan(prefix))

    def remove_stale_temp(self, older_than: float) -> builtins.list[str]:
        """Delete temp files of killed writes last modified before ``older_than`` (epoch seconds);
        returns their names. Backends whose writes are atomic without temp files have none."""
        return []

    def copy_from(self, source: Store, key: str) -> bool:
        """Copy object ``key`` of ``source`` to the same key here, if absent (True if copied).
        Backends override it with a cheaper copy where one exists (a hard link, a server-side copy)."""
        return self.put_if_absent(key, source.get(key))

    def _not_found(self, key: str) -> ObjectNotFound:
        return ObjectNotFound(f"no object {key!r} in {self.url}")

    def _too_large(self, key: str, size: int | None, max_bytes: int) -> ObjectTooLarge:
        return ObjectTooLarge(f"{self.url}/{key}", size, max_bytes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.url == self.url

    def __hash__(self) -> int:
        return hash((type(self), self.url))


class WrapperStore(Store):
    """A store that forwards every call to ``inner``: the base of fault-injecting, recording or
    partitioned views. Subclasses override ``_forward`` (every operation passes through it) or
    single methods; ``child`` wraps the inner child with ``_wrap_child``."""

    def __init__(self, inner: Store):
        self.inner = inner

    @property
    def url(self) -> str:  # type: ignore[override]
        return self.inner.url

    @property
    def capabilities(self) -> StoreCapabilities:  # type: ignore[override]
        return self.inner.capabilities

    def _forward(self, op: str, key: str, *args: Any) -> Any:
        return getattr(self.inner, op)(key, *args)

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        return self._forward("get", key) if max_bytes is None else self._forward("get", key, max_bytes)

    def put(self, key: str, data: bytes | memoryview) -> None:
        return self._forward("put", key, data)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        return self._forward("put_if_absent", key, data)

    def exists(self, key: str) -> bool:
        return self._forward("exists", key)

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(self._forward("scan", prefix))

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self._forward("list", prefix)

    def list_dirs(self, prefix: str = "") -> builtins.list[str]:
        return self._forward("list_dirs", prefix)

    def delete(self, key: str) -> None:
        return self._forward("delete", key)

    def modified(self, key: str) -> float:
        return self._forward("modified", key)

    def remove_stale_temp(self, older_than: float) -> builtins.list[str]:
        return self.inner.remove_stale_temp(older_than)

    def copy_from(self, source: Store, key: str) -> bool:
        return self.put_if_absent(key, source.get(key))

    def child(self, subpath: str) -> Store:
        return self._wrap_child(self.inner.child(subpath))

    def _wrap_child(self, inner_child: Store) -> Store:
        return type(self)(inner_child)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.inner == self.inner

    def __hash__(self) -> int:
        return hash((type(self), self.inner))


# URL scheme ("" for a plain path) -> how to open a URL of it. Each backend module registers its own
# schemes when imported; the package (`ckptlib/store/__init__.py`) imports every backend, so this
# module knows them without importing any (they import it).
Opener = Callable[[str, Mapping[str, Any]], Store]
_OPENERS: dict[str, Opener] = {}
_TAKE_OPTIONS: set[str] = set()


def register_scheme(scheme: str, opener: Opener, *, storage_options: bool = False) -> None:
    """Open URLs of ``scheme`` with ``opener(url, storage_options)``: the URL stripped, the options
    ``{}`` unless the scheme takes them (``storage_options=True``; other schemes refuse any)."""
    _OPENERS[scheme] = opener
    if storage_options:
        _TAKE_OPTIONS.add(scheme)


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """The store at ``url`` (see ``Store.from_url``), by the backend registered for its scheme."""
    if not isinstance(url, str) or not url.strip():
        raise StoreError(f"empty store URL {url!r}: use {SUPPORTED_URLS}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise StoreError(f"storage_options must be a dict of s3fs arguments, got {type(storage_options).__name__}")
    url = url.strip()
    shown = redact_url(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _TAKE_OPTIONS and storage_options:
        takers = " or ".join(f"{s}://" for s in sorted(_TAKE_OPTIONS))
        raise StoreError(
            f"storage_options {sorted(storage_options)} apply only to {takers} URLs, not {shown!r}: "
            f"drop them or use an {takers} URL"
        )
    opener = _OPENERS.get(scheme)
    if opener is None:
        raise StoreError(f"unsupported store URL scheme {scheme + '://'!r} in {shown!r}: use {SUPPORTED_URLS}")
    return opener(url, storage_options or {})
