"""Golden checkpoints: tests/data/golden_v1 was written by ckptlib 0.1.0 (format 1: keyframes; sparse,
arith and XOR deltas; a multi-part cut). Every later ckptlib must read it bit-exactly, with the
digests 0.1.0 recorded, and keep saving on top of it. Always on a copy: the data is never changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import golden_states as golden
import pytest

from ckptlib import Checkpointer, RetentionPolicy
from ckptlib.testing.protocol import assert_same_state

DATA = Path(__file__).parent / "data" / "golden_v1"
EXPECTED = json.loads((DATA / "expected.json").read_text())
pytestmark = pytest.mark.timeout(120)


def loose(expected, actual) -> bool:
    """Types format 1 could not keep, as 0.1.0 itself returned them. The golden states hold none of
    them (0.1.0 returned every value of these states with its exact type), so nothing is loose."""
    return False


@pytest.fixture
def copy(tmp_path) -> Path:
    shutil.copytree(DATA, tmp_path / "golden_v1")
    return tmp_path / "golden_v1"


@pytest.mark.parametrize("step", [0, 1, 2])
def test_single_restores_bit_exactly(copy, step):
    with Checkpointer(str(copy / "single")) as ck:
        assert ck.steps() == [0, 1, 2]
        m = ck.manifest(step)
        assert m.format == 1 and m.single
        assert m.digest == EXPECTED["single"][str(step)]["digest"]
        assert m.stats == EXPECTED["single"][str(step)]["chunks"]
        assert_same_state(golden.single_state(step), ck.restore(step), f"single step {step}", loose=loose)
        assert ck.verify(step) == []


@pytest.mark.parametrize("step", [0, 1])
def test_multi_restores_every_part_bit_exactly(copy, step):
    with Checkpointer(str(copy / "multi")) as ck:
        assert ck.steps() == [0, 1]
        m = ck.manifest(step)
        assert m.format == 1 and not m.single and sorted(m.parts) == sorted(golden.PARTS)
        assert m.digest == EXPECTED["multi"][str(step)]["digest"]
        assert m.stats == EXPECTED["multi"][str(step)]["chunks"]
        everything = ck.restore(step)
        for part in golden.PARTS:
            assert_same_state(golden.part_state(part, step), ck.restore(step, part=part), f"{part} step {step}",
                              loose=loose)
            assert_same_state(golden.part_state(part, step), everything[part], f"{part} step {step}", loose=loose)
        assert ck.verify(step) == []


def test_the_data_has_every_encoding():
    """The golden run covers keyframes and the three delta codecs (what it is for)."""
    names = set()
    for manifest in (DATA / "single" / "manifests").iterdir():
        doc = json.loads(manifest.read_text())
        for frag in doc["parts"].values():
            for blob in frag["blobs"].values():
                names |= {c["name"] for c in blob["codecs"]}
    assert {"zstd", "byteplane", "sparse_delta", "arith_delta", "xor_delta"} <= names


def _next_single(step: int) -> dict:
    state = golden.single_state(2)
    state["step"] = step
    state["model"]["w"] = state["model"]["w"] * 1.5
    state["ids"][:3] = -1
    return state


@pytest.mark.parametrize("follow", [True, False], ids=["follower", "fresh-writer"])
def test_a_format_2_save_on_top_of_format_1(copy, follow):
    url = str(copy / "single")
    with Checkpointer(url, chunk_bytes=golden.CHUNK_BYTES) as ck:
        if follow:
            ck.restore(2, keep_base=True)  # format 1 chunks as the delta base of a format 2 save
        info = ck.save(3, _next_single(3))
        assert info.committed
        if follow:
            assert info.chunks["delta"] > 0 and info.chunks["unchanged"] > 0
    with Checkpointer(url) as ck:
        assert ck.steps() == [0, 1, 2, 3]
        assert ck.manifest(3).format == 2 and ck.manifest(2).format == 1
        assert_same_state(_next_single(3), ck.restore(3), "step 3")
        for step in (0, 1, 2):
            assert_same_state(golden.single_state(step), ck.restore(step), f"step {step}", loose=loose)
        assert ck.verify(3) == [] and ck.verify(2) == []
        # a GC that keeps the format 1 step and the format 2 step built on it keeps both whole
        report = ck.gc(RetentionPolicy(keep_last=2), grace_s=0)
        assert report.dropped_steps == [0, 1] and not report.skipped
        assert ck.steps() == [2, 3]
        assert_same_state(golden.single_state(2), ck.restore(2), "step 2 after gc", loose=loose)
        assert_same_state(_next_single(3), ck.restore(3), "step 3 after gc")
        assert ck.verify(2) == [] and ck.verify(3) == []


def test_a_format_2_cut_on_top_of_a_format_1_cut(copy):
    url = str(copy / "multi")
    states = {}
    for part in golden.PARTS:
        with Checkpointer(url, chunk_bytes=golden.CHUNK_BYTES) as ck:
            ck.restore(1, part=part, keep_base=True)
            s = golden.part_state(part, 1)
            s["params"] = s["params"].clone()
            s["params"][:10] += 1
            s["round"] = 2
            states[part] = s
            ck.write_fragment(2, part, s, config_hash="golden")
    with Checkpointer(url) as ck:
        info = ck.commit(2, list(golden.PARTS), timeout=10)
        assert info.committed and ck.manifest(2).format == 2
        assert_same_state(states, ck.restore(2), "cut 2")
        for part in golden.PARTS:
            assert_same_state(golden.part_state(part, 1), ck.restore(1, part=part), f"{part} step 1", loose=loose)
        assert ck.verify(2) == [] and ck.verify(1) == []


def test_the_golden_data_is_untouched(copy):
    """Reading never writes into a store's objects (the copy's objects equal the originals)."""
    with Checkpointer(str(copy / "single")) as ck:
        ck.restore(2)
        ck.verify(1)
    for path in (DATA / "single").rglob("*"):
        if path.is_file():
            assert (copy / "single" / path.relative_to(DATA / "single")).read_bytes() == path.read_bytes()


def test_a_reader_without_the_planes_codec_refuses_it_naming_the_upgrade(tmp_path, monkeypatch):
    """Dense chunks are written with the ``planes`` codec (docs/decisions.md 43) in format 2: a reader
    that predates it (simulated: the codec taken out of the registry) refuses the step in one error
    naming the codec and the upgrade, rather than decoding it wrongly; the current reader restores it."""
    import torch

    from ckptlib import CheckpointError, codecs

    state = {"w": torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state)
        assert any(c["name"] == "planes" for b in ck.manifest(1).parts["state"].fragment.blobs.values()
                   for c in b.codecs)
    with Checkpointer(str(tmp_path)) as ck:
        assert_same_state(state, ck.restore(1))
    monkeypatch.delitem(codecs.REGISTRY, "planes")
    with Checkpointer(str(tmp_path)) as ck, pytest.raises(CheckpointError) as err:
        ck.restore(1)
    assert "planes" in str(err.value) and "newer ckptlib" in str(err.value), err.value
