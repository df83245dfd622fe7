"""The local tier: a shard's newest checkpoint also kept on this host, read back at memory speed.

A rerun on the same host (a Prefect retry, the watchdog's rerun, a Dask worker started again, a
resumed run) reads its shard checkpoint from here instead of downloading it; the store stays the
durable copy and the fallback.

Where: ``$CKPT_LOCAL_TIER`` (a directory), else ``$XDG_RUNTIME_DIR/ckptlib`` when that runtime
directory is ours and 0700, else ``/dev/shm/ckptlib-<uid>`` (shared memory: it outlives the process,
not the machine), else ``<tmp>/ckptlib-<uid>``. One file per run, part and generation,
``<root>/<run>/<part>.g<gen>.bin`` (a group's part: one per rank, ``<part>#r<rank>``, holding the units
that rank stored; a rank reads all of them): a header (the checkpoint's store key, its fragment's
digest, its units' raw checksums and sizes) and the raw bytes of every unit, replaced atomically by
each newer checkpoint.

Private: the root and every run folder are this user's and 0700 (created so), files 0600. The root's
name is predictable, so another user may have made it first or planted a link there: the root and a
run folder that is a symbolic link, not ours, or not 0700 are refused (``LocalTierRefused``, naming
the path and the fix). Below the root every call goes through an opened folder (``dir_fd``,
``O_NOFOLLOW``): nothing is read, written, swept or deleted through a link.

Bounded: every copy on the host together stays within ``max_bytes`` (default: a quarter of the
tier's filesystem, at most 4 GiB); a copy that would not fit is not kept. Cleaned up: a part's copies
go when its round's fragment is written (the next round starts from the cut), and copies untouched
for a day (a run that died and was never resumed) when a tier is opened.

Never trusted: ``get`` returns a copy only if it is of the very checkpoint asked for (key and
fragment digest) and every unit matches its raw checksum (XXH3-128); anything else is logged and
``None`` (the caller reads the store; the restore checks every chunk again).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import struct
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from ckptlib import codecs
from ckptlib.errors import CheckpointError

log = logging.getLogger("trainrun.local_tier")

_MAGIC = b"CKPTLT1\n"
_MAX_HEADER = 64 << 20
STALE_AFTER_S = 24 * 3600.0
MAX_DEFAULT_BYTES = 4 << 30
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_swept: set[str] = set()  # roots whose stale copies this process has removed already


class LocalTierRefused(CheckpointError, ValueError):
    """The local tier's root or a run folder is not private (a link, another user's, or not 0700)."""


def copy_name(part: str, rank: int | None = None) -> str:
    """The name of a part's local copy: the part's own, or one per rank of a group (``<part>#r<rank>``:
    each rank keeps the units it stored)."""
    return part if rank is None else f"{part}#r{rank}"


def default_root() -> Path:
    """``$CKPT_LOCAL_TIER``; else ``$XDG_RUNTIME_DIR/ckptlib`` when that directory is ours and 0700;
    else a folder of this user's in /dev/shm, else in the temp directory."""
    env = os.environ.get("CKPT_LOCAL_TIER")
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and _private(runtime):
        return Path(runtime) / "ckptlib"
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"ckptlib-{os.getuid()}"


def _private(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def _check_private(fd: int, path: Path) -> None:
    """Refuse the opened folder ``path`` unless it is ours and 0700 (LocalTierRefused)."""
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == os.getuid() and mode != 0o700 and not mode & 0o022:
        # ours and writable by nobody else (a folder an earlier ckptlib made 0755): nobody could have
        # planted anything in it, so it is tightened, not refused
        os.fchmod(fd, 0o700)
        log.info("local tier: %s was %o, now 0700", path, mode)
        return
    if st.st_uid != os.getuid() or mode != 0o700:
        raise LocalTierRefused(
            f"local tier folder {path} is owned by uid {st.st_uid} with mode {mode:o}, not ours (uid {os.getuid()}) "
            f"and 0700: another user may read or plant copies there. Remove it (rm -r {path}) if it is not yours, "
            f"chmod 700 {path} if it is, or set CKPT_LOCAL_TIER to a private folder (or pass --no-local-tier)")


def _open_dir(name: str, path: Path, *, dir_fd: int | None, create: bool) -> int | None:
    """The opened folder ``name`` (relative to ``dir_fd``), created 0700 when ``create``, checked
    private; None when it does not exist and ``create`` is False. A link is refused, never followed."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as e:  # ELOOP: a symbolic link; ENOTDIR: a file (or a link, on some systems)
        raise LocalTierRefused(
            f"local tier folder {path} is not a folder of ours ({e.strerror}: a symbolic link or a file planted "
            f"there?): remove it (rm {path}), or set CKPT_LOCAL_TIER to a private folder (or pass --no-local-tier)"
        ) from None
    try:
        _check_private(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


class LocalTier:
    """The local copies of one run's shard checkpoints (see the module docstring). Construction refuses
    a root or run folder that is not private (LocalTierRefused), and sweeps stale copies."""

    def __init__(self, run_url: str, root: str | Path | None = None, max_bytes: int | None = None):
        self.root = Path(root) if root is not None else default_root()
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", run_url.rstrip("/").rsplit("/", 1)[-1])[:40]
        self.name = f"{name}-{hashlib.blake2b(run_url.encode(), digest_size=8).hexdigest()}"
        self.dir = self.root / self.name
        self.max_bytes = max_bytes
        with self._opened(create=False):
            pass  # refuses a root or run folder that is not private, before anything is swept
        self._sweep_stale()

    @contextlib.contextmanager
    def _root_fd(self) -> Iterator[int]:
        self.root.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_dir(str(self.root), self.root, dir_fd=None, create=True)
        assert fd is not None
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _opened(self, *, create: bool) -> Iterator[tuple[int, int | None]]:
        """(root, run folder) opened and checked; the run folder None when absent and not ``create``."""
        with self._root_fd() as root:
            fd = _open_dir(self.name, self.dir, dir_fd=root, create=create)
            try:
                yield root, fd
            finally:
                if fd is not None:
                    os.close(fd)

    def _budget(self) -> int:
        if self.max_bytes is not None:
            return self.max_bytes
        try:
            return min(MAX_DEFAULT_BYTES, shutil.disk_usage(self.root).total // 4)
        except OSError:
            return 0

    def put(self, part: str, generation: int, key: str, digest: str, units: Mapping[str, np.ndarray]) -> bool:
        """Keep the checkpoint ``key`` (its fragment's ``digest``, its units' raw bytes by raw checksum)
        as ``part``'s local copy, replacing the previous one. False when it does not fit the budget
        or cannot be written (logged: the store has it); LocalTierRefused when the tier is not private."""
        header = json.dumps({"key": key, "digest": digest,
                             "units": [[c, int(b.nbytes)] for c, b in units.items()]}).encode()
        size = len(_MAGIC) + 8 + len(header) + sum(int(b.nbytes) for b in units.values())
        name = f"{part}.g{generation}.bin"
        try:
            with self._opened(create=True) as (root, run):
                assert run is not None
                if _used(root, excluding=(self.name, name)) + size > self._budget():
                    log.info("local tier: %s (%d B) does not fit in %s (budget %d B); the store has it", key, size,
                             self.root, self._budget())
                    return False
                tmp = f".{name}.{secrets.token_hex(6)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=run)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(_MAGIC + struct.pack("<Q", len(header)) + header)
                        for b in units.values():
                            f.write(np.ascontiguousarray(b).view(np.uint8).data)
                    os.replace(tmp, name, src_dir_fd=run, dst_dir_fd=run)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=run)
                    raise
            return True
        except OSError as e:
            log.warning("local tier: cannot keep %s in %s: %s", key, self.dir, e)
            return False

    def get(self, part: str, generation: int, key: str, digest: str) -> dict[str, np.ndarray] | None:
        """The units of checkpoint ``key`` (fragment digest ``digest``) by raw checksum, every one
        checked; None when there is no such copy or it does not check out (logged)."""
        path = self.dir / f"{part}.g{generation}.bin"
        try:
            with self._opened(create=False) as (_, run):
                if run is None:
                    return None
                fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=run)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    raise ValueError("not a regular file of ours")
                if f.read(len(_MAGIC)) != _MAGIC:
                    raise ValueError("not a local-tier file")
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(_MAX_HEADER, st.st_size):
                    raise ValueError(f"header of {n} bytes")
                header = json.loads(f.read(n))
                if header.get("key") != key or header.get("digest") != digest:
                    return None  # a copy of another checkpoint (older, or a fenced attempt's): not this one
                start = len(_MAGIC) + 8 + n
                size = st.st_size - start
                # mapped, not read: the units are checked and copied straight from the page cache
                data = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8,
                                     offset=start, count=size) if size > 0 else np.empty(0, dtype=np.uint8)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, struct.error) as e:
            if isinstance(e, LocalTierRefused):
                raise
            log.warning("local tier: %s is unreadable (%s): reading the store", path, e)
            return None
        return _checked_units(path, header, data)

    def get_all(self, names: list[str], generation: int, key: str, digest: str) -> dict[str, np.ndarray] | None:
        """``get`` of each copy in ``names`` (a group's ranks' copies of checkpoint ``key``), their units
        together: a rank of a group reads its peers' pieces too, and all are on this host. None when
        no copy checks out; units a missing or damaged copy would have given are read from the store."""
        units: dict[str, np.ndarray] = {}
        found = False
        for name in names:
            got = self.get(name, generation, key, digest)
            if got is not None:
                found = True
                units.update(got)
        return units if found else None

    def drop(self, part: str) -> None:
        """Remove every local copy of ``part`` (its round is written); the run's folder once empty.
        LocalTierRefused when the tier is not private."""
        pattern = re.compile(rf"{re.escape(part)}\.g\d+\.bin")
        with self._opened(create=False) as (root, run):
            if run is None:
                return
            for name in os.listdir(run):
                if pattern.fullmatch(name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=run)  # removes a link itself, never what it points to
            with contextlib.suppress(OSError):
                os.rmdir(self.name, dir_fd=root)  # other parts' copies are still there

    def _sweep_stale(self) -> None:
        """Copies untouched for ``STALE_AFTER_S`` are a dead run's: removed, once per root and process.
        Only in run folders that are ours and private; links are skipped, never followed."""
        if str(self.root) in _swept:
            return
        _swept.add(str(self.root))
        cutoff = time.time() - STALE_AFTER_S
        with self._root_fd() as root:
            for run_name in os.listdir(root):
                try:
                    run = _open_dir(run_name, self.root / run_name, dir_fd=root, create=False)
                except (LocalTierRefused, OSError) as e:
                    log.warning("local tier: not sweeping %s: %s", self.root / run_name, e)
                    continue
                if run is None:
                    continue
                try:
                    swept = _sweep_folder(run, cutoff)
                finally:
                    os.close(run)
                if swept:  # a dead run's folder, once empty (a live one may have just made its own)
                    with contextlib.suppress(OSError):
                        os.rmdir(run_name, dir_fd=root)


def _files(run: int) -> Iterator[tuple[str, os.stat_result]]:
    """The regular files of the opened folder ``run``, not following links."""
    for name in os.listdir(run):
        try:
            st = os.stat(name, dir_fd=run, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            yield name, st


def _sweep_folder(run: int, cutoff: float) -> int:
    """Remove the files of the opened folder ``run`` untouched since ``cutoff``; how many."""
    swept = 0
    for name, st in _files(run):
        if st.st_mtime < cutoff:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=run)
                swept += 1
    return swept


def _used(root: int, excluding: tuple[str, str]) -> int:
    """Bytes of every copy under the opened root (private run folders only), but ``excluding``'s."""
    total = 0
    for run_name in os.listdir(root):
        try:
            run = _open_dir(run_name, Path(run_name), dir_fd=root, create=False)
        except (LocalTierRefused, OSError):
            continue  # not ours to count (nor to trust)
        if run is None:
            continue
        try:
            total += sum(st.st_size for name, st in _files(run)
                         if name.endswith(".bin") and (run_name, name) != excluding)
        finally:
            os.close(run)
    return total


def _checked_units(path: Path, header: dict, data: np.ndarray) -> dict[str, np.ndarray] | None:
    units: dict[str, np.ndarray] = {}
    at = 0
    for checksum, nbytes in header.get("units", []):
        view = data[at:at + int(nbytes)]
        at += int(nbytes)
        if view.nbytes != int(nbytes) or codecs.checksum(view) != checksum:
            log.warning("local tier: %s is damaged (unit %s does not match its checksum): reading the store",
                        path, checksum)
            return None
        units[checksum] = view
    if at != data.nbytes:
        log.warning("local tier: %s holds %d bytes more than its units: reading the store", path, data.nbytes - at)
        return None
    return units
