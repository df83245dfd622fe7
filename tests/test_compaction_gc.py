"""GC of compaction shortcuts (``compact/``): stale tables (of steps it does not keep, or superseded by a
newer table of the same part) and objects no remaining table names go; the newest table, what it names,
tables of steps after the newest commit and keys ckptlib does not write stay."""

from __future__ import annotations

import json
import os
import time

import torch

from ckptlib import Checkpointer, RetentionPolicy
from ckptlib.compaction import OBJECT_KEY, object_key, table_key

CHUNK = 256 << 10
STEPS = 5  # 0..4; keep_last=2 keeps 3 and 4
ORPHAN = object_key("0" * 32, [{"name": "orphan"}])  # named by no table
ONLY_STALE = object_key("1" * 32, [{"name": "only-stale"}])  # named only by a stale table
STRAY = "compact/notes.txt"


def _series(root) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(2000, 256, generator=g), "step": 0}
    with Checkpointer(str(root), compact=True, chunk_bytes=CHUNK) as ck:
        for k in range(STEPS):
            state["w"][[k, 500 + 7 * k, 1500 + k]] += 0.25  # sparse: most chunks become deltas
            state["step"] = k
            ck.save(k, state)
            ck.wait()
    return state


def _put(root, key: str, data: bytes) -> None:
    path = os.path.join(root, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    old = time.time() - 3600  # well past any grace
    os.utime(path, (old, old))


def _exists(root, key: str) -> bool:
    return os.path.exists(os.path.join(root, key))


def _plant(root, newest: dict, step: int, extra: list[str]) -> str:
    """A table of ``step`` (a copy of the newest one's entries, plus entries naming ``extra``)."""
    doc = dict(newest, step=step)
    doc["chunks"] = {**newest["chunks"], **{f"{i:032x}": {"key": k, "size": 1, "codecs": [{"name": "raw"}]}
                                            for i, k in enumerate(extra)}}
    _put(root, table_key(step, "state"), json.dumps(doc).encode())
    return table_key(step, "state")


def _setup(root) -> tuple[dict, dict, list[str]]:
    """The series, then planted garbage: stale tables of a dropped step (1) and of a kept but superseded
    step (3), an object only the stale table names, an orphan object, and a stray key."""
    want = _series(root)
    with open(os.path.join(root, table_key(STEPS - 1, "state"))) as f:
        newest = json.load(f)
    assert newest["chunks"], "the series compacted nothing: the test proves nothing"
    stale = [_plant(root, newest, 1, [ONLY_STALE]), _plant(root, newest, STEPS - 2, [])]
    for key in (ORPHAN, ONLY_STALE):
        assert OBJECT_KEY.match(key)
        _put(root, key, b"x")
    _put(root, STRAY, b"hello")
    return want, newest, stale


def test_gc_deletes_stale_tables_and_unnamed_objects_and_keeps_the_newest_table(tmp_path):
    want, newest, stale = _setup(tmp_path)
    named = {e["key"] for e in newest["chunks"].values()}
    assert named and all(_exists(tmp_path, k) for k in named)
    with Checkpointer(str(tmp_path)) as ck:
        report = ck.gc(RetentionPolicy(keep_last=2), grace_s=0)
    assert report.kept_steps == [STEPS - 2, STEPS - 1]
    for key in [*stale, ORPHAN, ONLY_STALE]:
        assert key in report.deleted_objects and not _exists(tmp_path, key), key
    assert _exists(tmp_path, table_key(STEPS - 1, "state"))
    assert all(_exists(tmp_path, k) for k in named)  # also named by the deleted stale tables: kept
    assert not named & set(report.deleted_objects)
    assert STRAY in report.skipped and _exists(tmp_path, STRAY)
    with Checkpointer(str(tmp_path)) as reader:
        got = reader.restore()
    assert torch.equal(got["w"], want["w"]) and got["step"] == want["step"]


def test_gc_dry_run_reports_compaction_garbage_and_deletes_nothing(tmp_path):
    _, _, stale = _setup(tmp_path)
    before = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs)
    with Checkpointer(str(tmp_path)) as ck:
        report = ck.gc(RetentionPolicy(keep_last=2), grace_s=0, dry_run=True)
    assert {*stale, ORPHAN, ONLY_STALE} <= set(report.deleted_objects)
    assert table_key(STEPS - 1, "state") not in report.deleted_objects
    after = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs)
    assert after == before


def test_gc_keeps_a_table_of_a_step_after_the_newest_commit_and_what_it_names(tmp_path):
    _, newest, _ = _setup(tmp_path)
    future_only = object_key("2" * 32, [{"name": "future"}])
    _put(tmp_path, future_only, b"y")
    future = _plant(tmp_path, newest, 99, [future_only])  # a writer's table of a step not committed yet
    with Checkpointer(str(tmp_path)) as ck:
        report = ck.gc(RetentionPolicy(keep_last=2), grace_s=0)
    assert _exists(tmp_path, future) and _exists(tmp_path, future_only)
    assert future not in report.deleted_objects
    assert not _exists(tmp_path, ORPHAN) and ORPHAN in report.deleted_objects  # the sweep of compact/ ran
