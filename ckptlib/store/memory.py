"""``memory://``: fsspec's in-process memory filesystem, for tests and single-process runs."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from ckptlib.errors import StoreError

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

# One lock for every memory store in the process: fsspec's memory filesystem is one global dict.
_MEMORY_LOCK = threading.RLock()


class MemoryStore(Store):
    """Shared by every ``memory://`` user in the process; atomic within the process only."""

    capabilities = StoreCapabilities(conditional_put=True, atomic_rename=False)

    def __init__(self, root: str):
        import fsspec

        self.fs = fsspec.filesystem("memory")
        self.root = "/" + root.strip("/")
        self.url = "memory://" + self.root.lstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        check_max_bytes(max_bytes)
        try:
            if max_bytes is None:
                return self.fs.cat_file(path)
            with _MEMORY_LOCK:  # the size and the bytes of one version of the object
                size = self.fs.info(path)["size"]
                if size > max_bytes:
                    raise self._too_large(key, size, max_bytes)
                return self.fs.cat_file(path)
        except (FileNotFoundError, IsADirectoryError):
            raise self._not_found(key) from None

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        with _MEMORY_LOCK:
            self.fs.pipe_file(path, bytes(data))

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        path = self._path(key)
        with _MEMORY_LOCK:  # check-then-write, made atomic by the lock (this process only)
            if self.fs.isfile(path):
                return False
            self.fs.pipe_file(path, bytes(data))
            return True

    def exists(self, key: str) -> bool:
        return self.fs.isfile(self._path(key))

    def _entries(self, prefix: str) -> list[tuple[str, object]]:
        prefix = check_prefix(prefix)
        base = f"{self.root}/{prefix}/" if prefix else f"{self.root}/"
        with _MEMORY_LOCK:
            return [(p[len(self.root) + 1:], f) for p, f in self.fs.store.items() if p.startswith(base)]

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for key, f in self._entries(prefix):
            yield ObjectInfo(key, f.size, f.modified.timestamp())  # type: ignore[attr-defined]

    def list_dirs(self, prefix: str = "") -> list[str]:
        depth = len(check_prefix(prefix).split("/")) if prefix.strip("/") else 0
        return sorted({key.split("/")[depth] for key, _ in self._entries(prefix) if key.count("/") > depth})

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
        return MemoryStore(f"{self.root}/{check_key(subpath, 'subpath')}")


def _open_memory_url(url: str, _options: Mapping[str, Any]) -> MemoryStore:
    name = url[len("memory://"):].strip("/")
    if not name:
        raise StoreError(f"memory URL {redact_url(url)!r} needs a name: memory://run1")
    check_key(name, "memory store name")
    return MemoryStore("/" + name)


register_scheme("memory", _open_memory_url)
