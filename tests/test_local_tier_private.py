"""The local tier is private (trainrun/local_tier.py, docs/security.md "Local tier"): another user
cannot pre-create its root or run folders, nor redirect them with a link.

The attacker is real: links and folders are planted by another uid (nobody, 65534) through
``setpriv``, in a world-writable sticky folder standing in for /dev/shm.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from trainrun.local_tier import LocalTier, LocalTierRefused, default_root

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv, to act as another user")
UNITS = {"a" * 32: np.zeros(64, dtype=np.uint8)}


def as_nobody(*cmd: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd], check=True)


@pytest.fixture
def shm():
    """A world-writable sticky folder (as /dev/shm is) that another user can reach."""
    base = Path(tempfile.mkdtemp(prefix="ckpt-shm-", dir="/tmp"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def victim(base: Path) -> Path:
    """Another folder's files: one a day and more old, named as a local copy is."""
    where = base / "victim" / "other"
    where.mkdir(parents=True)
    old = where / "shard-0.g0.bin"
    old.write_bytes(b"not the tier's")
    os.utime(old, (time.time() - 3 * 86400,) * 2)
    return old


def _name(url: str) -> str:
    """The run folder a tier of ``url`` uses (as trainrun.local_tier names it)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", url.rstrip("/").rsplit("/", 1)[-1])[:40]
    return f"{name}-{hashlib.blake2b(url.encode(), digest_size=8).hexdigest()}"


def test_a_root_planted_as_another_users_link_is_refused_and_nothing_is_swept_through_it(shm):
    old = victim(shm)
    as_nobody("ln", "-s", str(old.parent.parent), str(shm / "ckptlib-0"))
    with pytest.raises(LocalTierRefused, match="symbolic link"):
        LocalTier("memory://run", root=shm / "ckptlib-0")
    assert old.exists()  # the stale sweep did not follow the link


@pytest.mark.parametrize("who", ["another user", "us"])
def test_a_precreated_open_root_is_refused_and_its_linked_run_folder_is_never_written_or_deleted(shm, who):
    old = victim(shm)
    root, url = shm / "tier", "memory://run"
    if who == "us":
        root.mkdir()
        root.chmod(0o777)
    else:
        as_nobody("mkdir", "-m", "777", str(root))
        as_nobody("ln", "-s", str(old.parent), str(root / _name(url)))
    with pytest.raises(LocalTierRefused, match=r"not ours .* and 0700.*chmod 700|CKPT_LOCAL_TIER"):
        LocalTier(url, root=root)
    assert old.read_bytes() == b"not the tier's"
    assert [p.name for p in old.parent.iterdir()] == ["shard-0.g0.bin"]


def test_a_run_folder_turned_into_another_users_link_is_refused_by_put_get_and_drop(shm):
    old = victim(shm)
    url = "memory://run"
    tier = LocalTier(url, root=shm / "tier")
    assert tier.put("shard-1", 0, "k", "d", UNITS)
    os.remove(tier.dir / "shard-1.g0.bin")
    tier.dir.rmdir()
    os.symlink(old.parent, tier.dir)  # planted while the run was away (ours 0700 root: root plants it)
    os.lchown(tier.dir, NOBODY, NOBODY)
    for call in (lambda: tier.put("shard-0", 0, "k", "d", UNITS), lambda: tier.drop("shard-0"),
                 lambda: tier.get("shard-0", 0, "k", "d"), lambda: LocalTier(url, root=shm / "tier")):
        with pytest.raises(LocalTierRefused, match="symbolic link"):
            call()
    assert old.read_bytes() == b"not the tier's"
    assert [p.name for p in old.parent.iterdir()] == ["shard-0.g0.bin"]


def test_the_sweep_removes_stale_copies_of_ours_and_never_follows_a_planted_link(shm):
    old = victim(shm)
    root = shm / "tier"
    root.mkdir(mode=0o700)
    (root / "dead-run").mkdir(mode=0o700)
    stale = root / "dead-run" / "shard-0.g3.bin"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 2 * 86400,) * 2)
    os.symlink(old.parent, root / "planted")
    os.lchown(root / "planted", NOBODY, NOBODY)
    LocalTier("memory://another-run", root=root)
    assert not (root / "dead-run").exists()  # a dead run's copy and then its folder
    assert old.exists()


def test_folders_are_0700_and_copies_0600_and_a_private_runtime_dir_is_preferred(shm, monkeypatch):
    tier = LocalTier("memory://run", root=shm / "tier")
    assert tier.put("shard-0", 0, "k", "d", UNITS)
    mode = lambda p: stat.S_IMODE(os.lstat(p).st_mode)  # noqa: E731
    assert (mode(tier.root), mode(tier.dir), mode(tier.dir / "shard-0.g0.bin")) == (0o700, 0o700, 0o600)
    # a folder an earlier ckptlib made 0755 (nobody else could write it) is tightened, not refused
    tier.dir.chmod(0o755)
    assert tier.put("shard-0", 0, "k2", "d", UNITS) and mode(tier.dir) == 0o700

    monkeypatch.delenv("CKPT_LOCAL_TIER", raising=False)
    runtime = shm / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert default_root() == runtime / "ckptlib"
    runtime.chmod(0o755)  # not private: not used
    assert default_root().parent != runtime
