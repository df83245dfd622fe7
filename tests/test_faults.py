"""The commit protocol under injected faults: crashes between any two steps of a save, lost
replies, torn writes. After each, the latest committed checkpoint restores bit-exactly and nothing
half-written is visible."""

import pytest
import torch

from ckptlib import Checkpointer, CorruptCheckpoint, StoreError
from ckptlib.testing.faulty import FaultyStore, SimulatedCrash


def states():
    torch.manual_seed(0)
    first = {"w": torch.randn(600_000), "b": torch.randn(100), "step": 1}
    second = {"w": first["w"].clone(), "b": first["b"] + 1, "step": 2}
    second["w"][:5000] *= 1.5
    return first, second


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request, store_factory):
    return store_factory(request.param)


def committed_and_intact(store, expected_steps, expected_state):
    fresh = Checkpointer(store)  # a "restarted process" on the same store, no faults
    assert fresh.steps() == expected_steps
    restored = fresh.restore()
    assert torch.equal(restored["w"], expected_state["w"]) and torch.equal(restored["b"], expected_state["b"])
    assert restored["step"] == expected_state["step"]
    assert fresh.verify() == []


@pytest.mark.parametrize("crash_op,pattern", [
    ("put_if_absent", "chunks/*"),      # died after writing the first chunk
    ("put_if_absent", "manifests/*"),   # died right after the manifest landed: committed
])
def test_crash_points(store, crash_op, pattern):
    first, second = states()
    Checkpointer(store, chunk_bytes=1 << 18).save(1, first)
    faulty = FaultyStore(store).crash_after(crash_op, pattern)
    with pytest.raises(SimulatedCrash):
        Checkpointer(faulty, chunk_bytes=1 << 18).save(2, second)
    if pattern.startswith("manifests"):
        committed_and_intact(store, [1, 2], second)
    else:
        committed_and_intact(store, [1], first)
        # a retry of the same save after the crash completes and rewrites nothing already stored
        info = Checkpointer(store, chunk_bytes=1 << 18).save(2, second)
        assert info.committed
        committed_and_intact(store, [1, 2], second)


def test_failure_before_publish_leaves_previous_checkpoint(store):
    first, second = states()
    Checkpointer(store).save(1, first)
    faulty = FaultyStore(store).fail_on("put_if_absent", "manifests/*")  # every attempt fails
    with pytest.raises(StoreError, match="could not publish step 2"):
        Checkpointer(faulty).save(2, second)
    committed_and_intact(store, [1], first)


def test_transient_failure_of_publish_is_retried(store):
    first, _ = states()
    faulty = FaultyStore(store).fail_on("put_if_absent", "manifests/*", times=2)
    assert Checkpointer(faulty).save(1, first).committed
    committed_and_intact(store, [1], first)


def test_lost_reply_on_conditional_put_is_success(store):
    first, second = states()
    Checkpointer(store).save(1, first)
    faulty = FaultyStore(store).lose_reply("put_if_absent", "manifests/*", times=1)
    info = Checkpointer(faulty).save(2, second)
    assert info.step == 2 and info.bytes_written > 0  # our own write, recognised by its digest
    assert [c.fault for c in faulty.calls if c.key == "manifests/2.json" and c.op == "put_if_absent"] == ["lose_reply", None]
    committed_and_intact(store, [1, 2], second)


def test_crash_after_fragments_commits_nothing(store):
    first, _ = states()
    faulty = FaultyStore(store).crash_after("put_if_absent", "fragments/*")
    with pytest.raises(SimulatedCrash):
        Checkpointer(faulty).write_fragment(1, "shard-0", first)
    assert Checkpointer(store).steps() == []
    # the restarted shard rewrites its fragment (identical: accepted) and the coordinator commits
    Checkpointer(store).write_fragment(1, "shard-0", first)
    Checkpointer(store).commit(1, ["shard-0"], timeout=10)
    assert torch.equal(Checkpointer(store).restore(1, part="shard-0")["w"], first["w"])


def test_torn_chunk_is_detected_and_named_previous_step_still_restores(store):
    first, second = states()
    faulty = FaultyStore(store)
    writer = Checkpointer(faulty, chunk_bytes=1 << 18)
    writer.save(1, first)
    faulty.truncate_on("put_if_absent", "chunks/*", times=1)
    assert writer.save(2, second).kind == "delta"  # the store claimed success for a torn chunk
    problems = Checkpointer(store).verify(2)
    # which of the two changed chunks was torn depends on upload order
    assert len(problems) == 1 and problems[0].tensor in ("/w", "/b") and problems[0].chunk is not None
    with pytest.raises(CorruptCheckpoint, match=rf"step 2, part 'state', tensor '{problems[0].tensor}', chunk \d+"):
        Checkpointer(store).restore(2)
    restored = Checkpointer(store).restore(1)
    assert torch.equal(restored["w"], first["w"])


def test_damaged_delta_base_is_the_object_named(tmp_path):
    w = torch.randn(1024)
    with Checkpointer(str(tmp_path), chunk_bytes=4096) as ck:
        ck.save(1, {"w": w.clone()})
        w[:10] += 1
        ck.save(2, {"w": w.clone()})
        frag = ck.fragment(2, "state")
        top = frag.blobs[frag.leaves[0].chunks[0]]
        damaged = frag.blobs[top.base].key
        path = tmp_path / damaged
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        (problem,) = ck.verify(2)
        assert problem.key == damaged and damaged in str(problem)
        with pytest.raises(CorruptCheckpoint, match=damaged):
            Checkpointer(str(tmp_path)).restore(2)
