"""A store in a directory of a local (POSIX) filesystem."""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from ckptlib.errors import StoreError

from .base import (
    TMP_PREFIX,
    ObjectInfo,
    Store,
    StoreCapabilities,
    check_key,
    check_max_bytes,
    check_prefix,
    redact_url,
    register_scheme,
)


def _fsync_dir(path: str) -> None:
    """Make a directory entry (a new, renamed or linked file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    """A directory; created on the first write. Never follows a symbolic link inside it: a key
    whose path passes through a link is refused (the root itself may be a link)."""

    capabilities = StoreCapabilities(conditional_put=True, atomic_rename=True)

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url = "file://" + self.root
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StoreError(f"store root {self.root} is a file, not a directory: pick another path")

    def _path(self, key: str, what: str = "key") -> str:
        """The file of ``key``; StoreError if any folder on the way (below the root) is a link."""
        parts = check_key(key, what).split("/")
        path = self.root
        for i, part in enumerate(parts):
            path = os.path.join(path, part)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return os.path.join(path, *parts[i + 1:])
            except OSError:
                continue  # e.g. not a directory: the operation itself reports it
            if stat.S_ISLNK(mode):
                raise StoreError(
                    f"{key!r} in {self.url} passes through the symbolic link {path}: a store never follows "
                    "links (they could lead outside it); replace the link with a real folder or file"
                )
        return path

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
            if e.errno == errno.ELOOP:
                raise StoreError(f"{key!r} in {self.url} is a symbolic link: a store never follows links") from e
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

    def _write_temp(self, path: str, data: bytes | memoryview) -> str:
        """Write ``data`` to a fsynced temp file beside ``path`` (same filesystem: link/replace work)."""
        folder = os.path.dirname(path)
        self._makedirs(folder)
        tmp = os.path.join(folder, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return tmp

    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        check_max_bytes(max_bytes)
        with self._os_errors("read", key):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    if max_bytes is None:
                        return f.read()
                    size = os.fstat(f.fileno()).st_size
                    if size > max_bytes:  # refused unread
                        raise self._too_large(key, size, max_bytes)
                    data = f.read(size + 1)  # (read(n) allocates n bytes first: not the cap)
                    if len(data) > size:  # appended to since the stat (a put replaces the file whole)
                        data += f.read(max_bytes + 1 - len(data))
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                raise self._not_found(key) from None  # a folder of keys is not an object
        if len(data) > max_bytes:
            raise self._too_large(key, None, max_bytes)
        return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        with self._os_errors("write", key):
            tmp = self._write_temp(path, data)
            try:
                os.replace(tmp, path)  # replaces a link itself, never writes through it
            except BaseException:
                os.unlink(tmp)
                raise
            _fsync_dir(os.path.dirname(path))

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        path = self._path(key)
        with self._os_errors("create", key):
            tmp = self._write_temp(path, data)
            try:
                # link() is the exclusive step: it fails if `path` exists, and the file it
                # publishes is already complete and fsynced.
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            _fsync_dir(os.path.dirname(path))
            return True

    def copy_from(self, source: Store, key: str) -> bool:
        """A hard link when both stores are local on one filesystem (free), else a copy."""
        if isinstance(source, LocalStore):
            src, dst = source._path(key), self._path(key)
            with self._os_errors("link", key):
                self._makedirs(os.path.dirname(dst))
                try:
                    os.link(src, dst, follow_symlinks=False)
                    _fsync_dir(os.path.dirname(dst))
                    return True
                except FileExistsError:
                    return False
                except FileNotFoundError:
                    raise source._not_found(key) from None
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                        raise
        return super().copy_from(source, key)

    def exists(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._path(key)).st_mode)
        except OSError:
            return False

    def _folder(self, prefix: str) -> str | None:
        """The directory of a list prefix (None when it does not exist)."""
        prefix = check_prefix(prefix)
        path = self._path(prefix, "list prefix") if prefix else self.root
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        return path if stat.S_ISDIR(mode) else None

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        folder = self._folder(prefix)
        if folder is None:
            return
        stack = [folder]
        with self._os_errors("list", prefix):
            while stack:
                current = stack.pop()
                rel = os.path.relpath(current, self.root).replace(os.sep, "/")
                try:
                    entries = os.scandir(current)
                except FileNotFoundError:
                    continue  # removed since it was listed
                with entries:
                    for entry in entries:
                        if entry.name.startswith(TMP_PREFIX) or entry.is_symlink():
                            continue  # temp files of writes in flight; links are never objects
                        try:
                            if entry.is_dir(follow_symlinks=False):
                                stack.append(entry.path)
                            elif entry.is_file(follow_symlinks=False):
                                info = entry.stat(follow_symlinks=False)
                                key = entry.name if rel == "." else f"{rel}/{entry.name}"
                                yield ObjectInfo(key, info.st_size, info.st_mtime)
                        except FileNotFoundError:
                            continue  # deleted while listed: a listing is not a snapshot

    def list_dirs(self, prefix: str = "") -> list[str]:
        folder = self._folder(prefix)
        if folder is None:
            return []
        with self._os_errors("list", prefix), os.scandir(folder) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False)
                          and not e.name.startswith(TMP_PREFIX))

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._os_errors("delete", key):
            try:
                os.unlink(path)  # a link itself is removed, never what it points to
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                pass  # not an object: nothing to delete

    def modified(self, key: str) -> float:
        path = self._path(key)
        with self._os_errors("stat", key):
            try:
                info = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                raise self._not_found(key) from None
        if not stat.S_ISREG(info.st_mode):
            raise self._not_found(key)  # a folder of keys (or a link), not an object
        return info.st_mtime

    def remove_stale_temp(self, older_than: float) -> list[str]:
        removed: list[str] = []
        if not os.path.isdir(self.root):
            return removed
        stack = [self.root]
        while stack:
            current = stack.pop()
            try:
                entries = list(os.scandir(current))
            except OSError:
                continue
            for entry in entries:
                try:
                    if entry.is_symlink():
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.name.startswith(TMP_PREFIX) and entry.stat(follow_symlinks=False).st_mtime < older_than:
                        os.unlink(entry.path)
                        removed.append(os.path.relpath(entry.path, self.root).replace(os.sep, "/"))
                except FileNotFoundError:
                    continue  # finished (renamed or linked) meanwhile
        return removed

    def child(self, subpath: str) -> LocalStore:
        return LocalStore(self._path(subpath, "subpath"))


def _open_path(url: str, _options: Mapping[str, Any]) -> LocalStore:
    return LocalStore(os.path.abspath(os.path.expanduser(url)))


def _open_file_url(url: str, _options: Mapping[str, Any]) -> LocalStore:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
        raise StoreError(
            f"file URL {redact_url(url)!r} is not absolute: write file:///absolute/path (three slashes) or pass a "
            "plain path"
        )
    return LocalStore(os.path.abspath(parts.path))


register_scheme("", _open_path)
register_scheme("file", _open_file_url)
