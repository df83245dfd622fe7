"""Branching a run from a committed step of another: same state, lineage recorded, independent runs."""

import pytest
import torch

from ckptlib import Checkpointer, CommitConflict, RetentionPolicy, branch
from ckptlib.store import Store


def _run(url, storage_options=None, steps=4):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300_000, generator=gen)
    states = {}
    with Checkpointer(url, storage_options, chunk_bytes=1 << 16) as ck:
        for step in range(steps):
            x = x.clone()
            x[torch.randint(0, x.numel(), (200,), generator=gen)] += 1.0
            states[step] = {"x": x, "step": step}
            ck.save(step, states[step])
    return states


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_branch_restores_the_source_step_and_continues_on_its_own(kind, store_factory, tmp_path):
    src, dst = store_factory(kind), store_factory(kind)
    states = _run(src)
    m = branch(src, 2, dst)
    assert m.lineage == {"run": src.url, "step": 2} and m.digest == Checkpointer(src).manifest(2).digest
    with Checkpointer(dst) as ck:
        assert ck.steps() == [2]
        got = ck.restore()
        assert torch.equal(got["x"], states[2]["x"]) and got["step"] == 2
        assert ck.verify() == []
        info = ck.save(3, {"x": states[2]["x"] + 0, "step": 3})  # continues with references to what it copied
        assert info.chunks["unchanged"] > 0
    # branching again (a retried run that went on from its branch point) is a no-op
    again = branch(src, 2, dst)
    assert again.lineage == m.lineage and again.digest == m.digest
    assert Checkpointer(dst).steps() == [2, 3]
    # the source's GC does not touch the branch
    Checkpointer(src).gc(RetentionPolicy(keep_last=1), grace_s=0)
    assert torch.equal(Checkpointer(dst).restore(2)["x"], states[2]["x"])
    with pytest.raises(CommitConflict, match="new run"):
        branch(src, 3, dst)


def test_branching_local_stores_links_instead_of_copying(tmp_path):
    src, dst = Store.from_url(str(tmp_path / "a")), Store.from_url(str(tmp_path / "b"))
    _run(src)
    branch(src, 3, dst)
    chunk = next(k for k in dst.list("chunks"))
    assert (tmp_path / "b" / chunk).stat().st_nlink == 2
