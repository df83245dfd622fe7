"""The pipeline reads what a store holds with the cap of its kind, like ckptlib does: an object far
larger than any document of its kind is refused before it is read, never read whole first.

Each case puts a sparse file (cheap on disk) where a document of the run is expected and checks,
with tracemalloc, that reading it allocates nothing near its size.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from ckptlib import CorruptCheckpoint, commit
from ckptlib.store import Store

HUGE = 160 << 20  # more than any fragment (128 MiB) or recovery row (1 MiB) may hold


def _huge(root: Path, key: str) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(HUGE)


def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 2**20


def test_recovery_rows_are_read_with_their_cap(tmp_path, caplog):
    from trainrun.recovery import read_recoveries

    store = Store.from_url(str(tmp_path))
    commit.ensure_marker(store)
    _huge(tmp_path, "recoveries/1/shard-0.g0.a1.json")
    rows: list = []
    peak = _peak_mib(lambda: rows.extend(read_recoveries(store, 1)))
    assert rows == [] and "ignored" in caplog.text
    assert peak < 16, f"reading a {HUGE >> 20} MiB recovery row allocated {peak:.0f} MiB"


def test_a_shard_flow_runs_fragment_is_read_with_the_fragment_cap(tmp_path):
    from flows.runners import shard_result

    store = Store.from_url(str(tmp_path))
    commit.ensure_marker(store)
    _huge(tmp_path, commit.fragment_key(1, "shard-0", 0))

    def read() -> None:
        with pytest.raises(CorruptCheckpoint, match="shard-0.g0.json"):
            shard_result({"shard": 0, "round_no": 1, "run_url": str(tmp_path), "access": None})

    peak = _peak_mib(read)
    assert peak < 16, f"reading a {HUGE >> 20} MiB fragment allocated {peak:.0f} MiB"
