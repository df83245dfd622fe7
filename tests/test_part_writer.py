"""The part writer both checkpointers compose (ckptlib.part_writer), and the protocol kits run against
the collective one: a save of a 1-rank gloo group, crashed after every store call and interleaved
with a full GC between every two calls (the single writer's are in tests/test_protocol.py)."""

from __future__ import annotations

import uuid

import pytest
import torch

from ckptlib import Checkpointer, CollectiveCheckpointer, PartWriter, commit
from ckptlib.save import WriteOptions
from ckptlib.store import Store
from ckptlib.testing.protocol import crash_after_every_call, expect_states, interleave_gc

CHUNK = 4096
pytestmark = pytest.mark.timeout(300)


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2500, generator=g)  # 10 KB: 3 chunks
    b = torch.randn(64, generator=g)  # small: packed
    if step >= 2:
        w[:40] += 0.5 * step  # a sparse change of the first chunk
        b += step
    return {"w": w, "b": b, "step": step}


def history(save_step):
    """make_store for the kits: a fresh memory store holding step 1, saved by ``save_step``."""
    def make() -> Store:
        store = Store.from_url(f"memory://part-writer-{uuid.uuid4().hex}")
        save_step(store, 1)
        return store

    return make


# --------------------------------------------------------------------------------------- the writer


def test_a_part_writer_adopts_a_published_part_and_forgets_the_bytes_of_a_failed_one(tmp_path):
    store = Store.from_url(str(tmp_path / "run"))
    writer = PartWriter(store, WriteOptions.checked(CHUNK, 32, 2.0, 3, None), load_base=lambda key: None)
    try:
        with writer.writing(writer.snapshot(state(1), "p", copy=True), "p", 1) as enc:
            commit.put_fragment(store, enc.fragment)
            assert writer.bases.held("p") is None  # nothing adopted before the caller published
        first = writer.bases.held("p")
        assert first is not None and first.step == 1 and first.raw  # adopted, with its bytes
        snap = writer.snapshot(state(2), "p", copy=True)
        with pytest.raises(RuntimeError, match="publish failed"), writer.writing(snap, "p", 2) as enc:
            assert enc.fragment.stats["delta"] >= 1  # encoded against step 1's bytes
            raise RuntimeError("publish failed")
        kept = writer.bases.held("p")
        assert kept is not None and kept.step == 1 and not kept.raw  # the table stays, the bytes go
        assert not list(store.list("leases"))  # the save lease ended with the block
    finally:
        writer.close()


# --------------------------------------------------------------------------- the collective one


def collective_save(group):
    def save(store: Store, step: int) -> None:
        with Checkpointer(store, chunk_bytes=CHUNK, process_group=group) as ck:
            assert isinstance(ck, CollectiveCheckpointer)
            ck.save(step, state(step))

    return save


def test_a_process_group_makes_the_collective_checkpointer_and_none_the_single_writer(tmp_path, group):
    with Checkpointer(str(tmp_path / "a"), process_group=group) as ck:
        assert type(ck) is CollectiveCheckpointer and isinstance(ck, Checkpointer)
        assert isinstance(ck.writer, PartWriter) and ck.rank == 0
    with Checkpointer(str(tmp_path / "b")) as ck:
        assert type(ck) is Checkpointer and isinstance(ck.writer, PartWriter) and ck.rank == 0


def test_crash_after_every_call_of_a_collective_save(group):
    save = collective_save(group)
    points = crash_after_every_call(history(save), lambda s: save(s, 2), expect_states({1: state(1), 2: state(2)}),
                                    expect_committed=[1, 2])
    crashed = [p for p in points if p.outcome == "crashed"]
    assert len(crashed) >= 8
    assert any(p.call.key == "manifests/2.json" for p in crashed)  # a crash right at the commit point
    assert any(p.call.key.startswith("fragments/2/state.g0.r0.") for p in crashed)  # after the rank fragment


def test_gc_between_every_two_calls_of_a_collective_save(group):
    save = collective_save(group)
    points = interleave_gc(history(save), lambda s: save(s, 2), expect_states({1: state(1), 2: state(2)}),
                           expect_committed=[2])
    assert sum(p.outcome == "gc ran" for p in points) >= 8
