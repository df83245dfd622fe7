"""The local tier: a shard's newest checkpoint also kept on this host, read back at memory speed.

A rerun on the same host (a Prefect retry, the watchdog's rerun, a Dask worker started again, a
resumed run) reads its shard checkpoint from here instead of downloading it; the store stays the
durable copy and the fallback.

Where: ``$CKPT_LOCAL_TIER`` (a directory), else ``/dev/shm/ckptlib-<uid>`` (shared memory: it
outlives the process, not the machine), else ``<tmp>/ckptlib-<uid>``. One file per run, part and
generation, ``<root>/<run>/<part>.g<gen>.bin`` (a group's part: one per rank, ``<part>#r<rank>``,
holding the units that rank stored; a rank reads all of them): a header (the checkpoint's store key, its
fragment's digest, its units' raw checksums and sizes) and the raw bytes of every unit, replaced
atomically by each newer checkpoint.

Bounded: every copy on the host together stays within ``max_bytes`` (default: a quarter of the
tier's filesystem, at most 4 GiB); a copy that would not fit is not kept. Cleaned up: a part's copies
go when its round's fragment is written (the next round starts from the cut), and copies untouched
for a day (a run that died and was never resumed) when a tier is opened.

Never trusted: ``get`` returns a copy only if it is of the very checkpoint asked for (key and
fragment digest) and every unit matches its raw checksum (XXH3-128); anything else is logged and
``None`` (the caller reads the store; the restore checks every chunk again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ckptlib import codecs

log = logging.getLogger("trainrun.local_tier")

_MAGIC = b"CKPTLT1\n"
_MAX_HEADER = 64 << 20
STALE_AFTER_S = 24 * 3600.0
MAX_DEFAULT_BYTES = 4 << 30
_swept: set[str] = set()  # roots whose stale copies this process has removed already


def copy_name(part: str, rank: int | None = None) -> str:
    """The name of a part's local copy: the part's own, or one per rank of a group (``<part>#r<rank>``:
    each rank keeps the units it stored)."""
    return part if rank is None else f"{part}#r{rank}"


def default_root() -> Path:
    """``$CKPT_LOCAL_TIER``, else a folder of this user's in /dev/shm, else in the temp directory."""
    env = os.environ.get("CKPT_LOCAL_TIER")
    if env:
        return Path(env)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"ckptlib-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


class LocalTier:
    """The local copies of one run's shard checkpoints (see the module docstring)."""

    def __init__(self, run_url: str, root: str | Path | None = None, max_bytes: int | None = None):
        self.root = Path(root) if root is not None else default_root()
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", run_url.rstrip("/").rsplit("/", 1)[-1])[:40]
        self.dir = self.root / f"{name}-{hashlib.blake2b(run_url.encode(), digest_size=8).hexdigest()}"
        self.max_bytes = max_bytes
        self._sweep_stale()

    def _path(self, part: str, generation: int) -> Path:
        return self.dir / f"{part}.g{generation}.bin"

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
        or cannot be written (logged: the store has it)."""
        header = json.dumps({"key": key, "digest": digest,
                             "units": [[c, int(b.nbytes)] for c, b in units.items()]}).encode()
        size = len(_MAGIC) + 8 + len(header) + sum(int(b.nbytes) for b in units.values())
        path = self._path(part, generation)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self._used(excluding=path) + size > self._budget():
                log.info("local tier: %s (%d B) does not fit in %s (budget %d B); the store has it", key, size,
                         self.root, self._budget())
                return False
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=self.dir)
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + struct.pack("<Q", len(header)) + header)
                for b in units.values():
                    f.write(np.ascontiguousarray(b).view(np.uint8).data)
            os.replace(tmp, path)
            return True
        except OSError as e:
            log.warning("local tier: cannot keep %s in %s: %s", key, self.dir, e)
            return False

    def get(self, part: str, generation: int, key: str, digest: str) -> dict[str, np.ndarray] | None:
        """The units of checkpoint ``key`` (fragment digest ``digest``) by raw checksum, every one
        checked; None when there is no such copy or it does not check out (logged)."""
        path = self._path(part, generation)
        try:
            with open(path, "rb") as f:
                if f.read(len(_MAGIC)) != _MAGIC:
                    raise ValueError("not a local-tier file")
                (n,) = struct.unpack("<Q", f.read(8))
                if n > _MAX_HEADER:
                    raise ValueError(f"header of {n} bytes")
                header = json.loads(f.read(n))
                if header.get("key") != key or header.get("digest") != digest:
                    return None  # a copy of another checkpoint (older, or a fenced attempt's): not this one
                start = len(_MAGIC) + 8 + n
                size = os.fstat(f.fileno()).st_size - start
                # mapped, not read: the units are checked and copied straight from the page cache
                data = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8,
                                     offset=start, count=size) if size > 0 else np.empty(0, dtype=np.uint8)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, struct.error) as e:
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
        """Remove every local copy of ``part`` (its round is written); the run's folder once empty."""
        for path in self.dir.glob(f"{part}.g*.bin"):
            path.unlink(missing_ok=True)
        try:
            self.dir.rmdir()
        except OSError:
            pass  # other parts' copies are still there

    def _used(self, excluding: Path) -> int:
        total = 0
        for path in self.root.glob("*/*.bin"):
            if path != excluding:
                try:
                    total += path.stat().st_size
                except OSError:
                    continue
        return total

    def _sweep_stale(self) -> None:
        """Copies untouched for ``STALE_AFTER_S`` are a dead run's: removed, once per root and process."""
        if str(self.root) in _swept or not self.root.is_dir():
            return
        _swept.add(str(self.root))
        cutoff = time.time() - STALE_AFTER_S
        for path in self.root.glob("*/*"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    path.parent.rmdir()
            except OSError:
                continue


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
