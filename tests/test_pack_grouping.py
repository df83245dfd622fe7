"""Small groups share packs: any flat state is about ``bytes / chunk`` objects, and still deltas well."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlib import Checkpointer
from ckptlib.chunking import chunk_size_for, plan_units
from ckptlib.store import Store, WrapperStore
from ckptlib.types import LeafSpec

CHUNK = 256 << 10


def _undotted() -> dict[str, torch.Tensor]:
    """100 tensors of 1-16 KiB named w0..w99 (no dots: each its own top-level key) and one of 12 MiB."""
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(int(torch.randint(256, 4097, (1,), generator=g)), generator=g) for i in range(100)}
    state["big"] = torch.randn(3 << 20, generator=g)
    return state


def _modules() -> dict[str, torch.Tensor]:
    """160 modules' ``layer{i}.weight/bias/scale``: 160 prefixes of 81 KiB each."""
    g = torch.Generator().manual_seed(1)
    return {f"layer{i}.{name}": torch.randn(shape, generator=g) for i in range(160)
            for name, shape in (("weight", (128, 160)), ("bias", (128,)), ("scale", (128,)))}


def _objects(root) -> dict[str, int]:
    return {f: os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(root, "chunks")) for f in files}


@pytest.mark.parametrize("make", [_undotted, _modules], ids=["undotted", "modules"])
def test_a_flat_state_is_about_bytes_over_chunk_objects_and_deltas_well(tmp_path, make):
    state = make()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with Checkpointer(str(tmp_path), chunk_bytes=CHUNK) as ck:
        ck.save(1, state)
        first = _objects(tmp_path)
        # near the ideal: a leaf is never split across packs, so 81 KiB modules fill 243 KiB of 256
        assert len(first) <= 1.1 * math.ceil(nbytes / CHUNK) + 1, (len(first), math.ceil(nbytes / CHUNK))
        # a step that barely changes the small tensors (1 value in 100): their packs are deltas
        g = torch.Generator().manual_seed(2)
        after = {k: v.clone() for k, v in state.items()}
        for t in after.values():
            if t.numel() < 65536:
                t.view(-1)[torch.randperm(t.numel(), generator=g)[: max(1, t.numel() // 100)]] += 1e-3
        ck.save(2, after)
        second = {k: n for k, n in _objects(tmp_path).items() if k not in first}
        small = sum(t.numel() * t.element_size() for t in state.values() if t.numel() < 65536)
        assert sum(second.values()) < 0.1 * small, (sum(second.values()), small)
        for step, want in ((1, state), (2, after)):
            got = ck.restore(step)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    reads: list[str] = []

    class Counting(WrapperStore):
        def _forward(self, op, key, *args):
            reads.append(key) if op == "get" and key.startswith("chunks/") else None
            return super()._forward(op, key, *args)

    key = next(k for k in state if state[k].numel() < 1000)
    with Checkpointer(Counting(Store.from_url(str(tmp_path)))) as ck:
        assert torch.equal(ck.restore(2, select=[key])[key], after[key])
    assert len(reads) <= 2, reads  # one key still reads its own pack (and the delta's base)


@settings(max_examples=100, deadline=None)
@given(groups=st.lists(st.tuples(st.lists(st.integers(1, 3000), min_size=1, max_size=6), st.sampled_from([1, 4])),
                       min_size=1, max_size=60), chunk=st.integers(4096, 9000))
def test_packs_are_more_than_half_full_and_small_groups_stay_whole(groups, chunk):
    """Every pack but one per element size and kind is over half full, whatever the grouping; a
    group under half a chunk sits in one pack (a restore of it reads one object)."""
    specs = [LeafSpec(f"/g{j}.{i}", "numpy", "<u4" if k == 4 else "|u1", (n,), n * k, k)
             for j, (sizes, k) in enumerate(groups) for i, n in enumerate(sizes)]
    units = plan_units(specs, chunk)
    packs = [u for u in units if u.packed]
    for k in (1, 4):
        fill = [u.nbytes for u in packs if u.itemsize == k]
        assert sum(2 * n <= chunk_size_for(k, chunk) for n in fill) <= 1, fill
    where = {s.leaf: u for u, unit in enumerate(units) for s in unit.segments}
    for j, (_, k) in enumerate(groups):
        members = [i for i, spec in enumerate(specs) if spec.path.startswith(f"/g{j}.")]
        if 2 * sum(specs[i].nbytes for i in members) <= chunk_size_for(k, chunk) and len(members) > 1:
            assert len({where[i] for i in members}) == 1
    assert plan_units(specs, chunk) == units  # the same shape, the same units: every delta base found
