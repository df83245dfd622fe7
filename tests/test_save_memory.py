"""What a save holds after it returns (issue 41): the bytes of a unit are kept as the next save's delta
base only where that save can take a delta against them; elsewhere (``keyframe_every=1``, a chain at
its bound) only the unit's digest is, which is all an unchanged chunk's dedup needs."""

from __future__ import annotations

import pytest
import torch

from ckptlib import Checkpointer
from ckptlib.testing.compare import assert_same_state as assert_same

CHUNK = 1 << 16
pytestmark = pytest.mark.timeout(120)


def dense(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1 << 18, generator=g), "v": torch.randn(3, 1 << 14, generator=g),
            "b": torch.randn(64, generator=g), "step": 1}  # 19 chunks of 64 KiB and a pack


def retained(ck: Checkpointer, chain: str = "state") -> tuple[int, int]:
    """(units whose digest the chain's base holds, raw bytes it holds)."""
    base = ck.writer.bases.held(chain)
    assert base is not None
    return len(base.units), sum(a.nbytes for a in base.raw.values())


@pytest.mark.parametrize("background", [False, True], ids=["save", "save_async"])
def test_keyframes_only_keep_digests_not_bytes(tmp_path, background):
    """keyframe_every=1: no delta is ever taken, so a save keeps no copy of the state (read in place
    or snapshotted), yet a second save of an unchanged state writes nothing, a changed chunk is
    written alone, and every step restores bit-exact."""
    state = dense()
    with Checkpointer(str(tmp_path), chunk_bytes=CHUNK, keyframe_every=1) as ck:
        def save(step: int):
            return ck.save_async(step, state).result() if background else ck.save(step, state)

        first = save(1)
        units, held = retained(ck)
        assert first.chunks["keyframe"] == units == 20 and held == 0
        again = save(2)
        assert again.chunks == {"keyframe": 0, "delta": 0, "unchanged": 20} and again.bytes_written == 0
        state = {**state, "w": state["w"].clone()}
        state["w"][5] += 1.0  # one chunk changes
        third = save(3)
        assert third.chunks == {"keyframe": 1, "delta": 0, "unchanged": 19}
        assert 0 < third.bytes_written <= CHUNK and retained(ck) == (20, 0)
        if background:  # the snapshot's buffers went back to the pool for the next snapshot
            assert ck.writer.bases.buffers("state").free_bytes >= 19 * CHUNK
    with Checkpointer(str(tmp_path)) as back:
        assert_same(state, back.restore(3))
        assert_same(dense(), back.restore(1))


def test_a_unit_at_the_end_of_its_chain_keeps_no_bytes(tmp_path):
    """keyframe_every=2: a unit just written as a delta ends its chain (its next save writes a
    keyframe), so its bytes are dropped; a keyframe's are kept, and the next save takes its delta."""
    state = dense()
    with Checkpointer(str(tmp_path), chunk_bytes=CHUNK, keyframe_every=2) as ck:
        kinds, held = [], []
        for step in range(1, 5):
            state = {k: v + 1.0 if k == "b" else v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            for name in ("w", "v"):
                state[name].view(-1)[::997] += 0.5  # a sparse change in every chunk
            kinds.append(ck.save(step, state).kind)
            held.append(retained(ck)[1])
        assert kinds == ["keyframe", "delta", "keyframe", "delta"]
        assert min(held[0], held[2]) >= 19 * CHUNK and held[1] == held[3] == 0
        assert_same(state, Checkpointer(str(tmp_path)).restore())


def test_a_collective_keyframes_only_save_keeps_no_bytes(tmp_path, group):
    """The collective Checkpointer writes through the same part writer: a rank's chain keeps its
    digests, not its bytes, and an unchanged state is written again as nothing."""
    state = dense()
    with Checkpointer(str(tmp_path), chunk_bytes=CHUNK, keyframe_every=1, process_group=group) as ck:
        ck.save_async(1, state).result()
        assert retained(ck, "state#r0")[1] == 0
        assert ck.save_async(2, state).result().bytes_written == 0
        assert_same(state, ck.restore(2))
