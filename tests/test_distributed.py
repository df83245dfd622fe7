"""A group's part in one process: the documents, the plan, the geometry, the range reads, and the
API a coordinator uses (``write_group`` / ``read_rank``), with GC, branch and verify around them.
The torch.distributed jobs themselves are in tests/test_distributed_jobs.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ckptlib import Checkpointer, CorruptCheckpoint, FormatVersionError, RetentionPolicy, UnsupportedState, branch
from ckptlib.distributed import pieces
from ckptlib.distributed.documents import GroupFragment, RankFragment, loads_any_fragment
from ckptlib.distributed.local import ShardInfo
from ckptlib.distributed.plan import Candidate, Summary, candidate_key, make_plan
from ckptlib.distributed.restoring import RankState
from ckptlib.restore import ByteRange, decode_ranges
from ckptlib.store import Store
from ckptlib.testing import document_json
from ckptlib.testing.compare import first_difference
from ckptlib.testing.faulty import FaultyStore

CHUNK = 4096
W = torch.arange(64 * 96, dtype=torch.float32).view(64, 96) / 7  # 24 KiB: several chunks per shard
B = torch.linspace(-1, 1, 96)


def rows(world: int) -> list[tuple[int, int]]:
    return [(r * 64 // world, (r + 1) * 64 // world) for r in range(world)]


def rank_state(r: int, world: int, w: torch.Tensor = W) -> RankState:
    """What rank r of an FSDP-like job of ``world`` ranks holds: a row shard of w, the bias whole
    (replicated), a value of its own, and an optimizer counter every rank has."""
    lo, hi = rows(world)[r]
    state = {"model": {"w": w[lo:hi].clone(), "b": B.clone()}, "mine": torch.full((2,), float(r)),
             "optim": {"step": torch.tensor(5.0), "lr": 0.1}, "rank": r}
    return RankState(state, {"/model/w": ShardInfo(tuple(w.shape), (lo, 0))})


def test_write_group_read_rank_and_restore_whole_or_in_place(tmp_path):
    with Checkpointer(str(tmp_path / "run"), chunk_bytes=CHUNK) as ck:
        g = ck.write_group(3, "shard-0", [rank_state(r, 2) for r in range(2)])
        assert isinstance(g, GroupFragment) and g.world == 2 and g.key == "fragments/3/shard-0.g0.json"
        # the bias and the step counter, the same on both ranks, are stored once; W's halves and each
        # rank's own value once each
        assert g.logical_bytes == W.nbytes + B.nbytes + 2 * 8 + 4
        frags = [RankFragment.from_json(document_json(ck.store.get(r.key))) for r in g.ranks]
        stored = [sorted(leaf.spec.path for leaf in f.leaves) for f in frags]
        assert stored == [["/mine/", "/model/b", "/model/w"], ["/mine/", "/model/w", "/optim/step"]]
        assert frags[1].layout.skeleton is not None  # its skeleton differs ("rank": 1): stored by itself
        info = ck.commit(3, ["shard-0"])
        assert info.logical_bytes == g.logical_bytes

        full = ck.restore(3, part="shard-0")
        assert torch.equal(full["model"]["w"], W) and torch.equal(full["model"]["b"], B)
        assert (full["rank"], full["mine"].tolist(), full["optim"]) == (0, [0.0, 0.0], {"step": torch.tensor(5.0), "lr": 0.1})
        assert ck.restore(3, part="shard-0", rank=1)["rank"] == 1

        one = ck.read_rank(3, "shard-0", 1)  # rank 1's pieces as it held them, without any full tensor
        assert one.shards == {"/model/w": ShardInfo((64, 96), (32, 0), (), ())}
        assert first_difference(rank_state(1, 2).state, one.state) is None

        dest = {"model": {"w": torch.zeros(64, 96), "b": torch.zeros(96)}, "mine": torch.zeros(2),
                "optim": {"step": torch.tensor(0.0), "lr": 0.0}, "rank": -1}
        keep = dest["model"]["w"]
        back = ck.restore(3, part="shard-0", into=dest)
        assert back["model"]["w"] is keep and torch.equal(keep, W)
        with pytest.raises(ValueError, match=r"2 mismatch\(es\)") as e:
            ck.restore(3, part="shard-0", into={**dest, "model": {"w": torch.zeros(64, 95), "b": torch.zeros(96, dtype=torch.float64)}})
        assert "/model/w" in str(e.value) and "/model/b" in str(e.value)
        assert ck.verify(3) == []


def test_a_coordinator_averages_groups_piece_by_piece_and_writes_the_same_layout(tmp_path):
    """Issue 23's outer step: two shard groups of 2 ranks; the mean written as a group of 2 from one
    process, rank by rank, without a full tensor; then a layout of 3 ranks reshards it."""
    with Checkpointer(str(tmp_path / "run"), chunk_bytes=CHUNK) as ck:
        ck.write_group(1, "shard-0", [rank_state(r, 2, W) for r in range(2)])
        ck.write_group(1, "shard-1", [rank_state(r, 2, W * 3) for r in range(2)])
        gathered = ck.gather(1, ["shard-0", "shard-1"], timeout=10)
        mean = []
        for r in range(2):
            a, b = (ck.read_rank(1, p, r, fragment=gathered[p][0]) for p in ("shard-0", "shard-1"))
            assert a.shards == b.shards  # the layouts match: average the pieces
            state = {**a.state, "model": {k: (a.state["model"][k] + b.state["model"][k]) / 2 for k in a.state["model"]}}
            mean.append(RankState(state, a.shards))
        cg = ck.write_group(1, "coordinator", mean)
        info = ck.commit(1, ["coordinator", "shard-0", "shard-1"], fragments=gathered)
        assert info.committed and cg.world == 2
        assert torch.equal(ck.restore(1, part="coordinator")["model"]["w"], W * 2)
        # the next round on 3 ranks: the unchanged bias and counter are referenced, not written again
        g3 = ck.write_group(2, "coordinator", [rank_state(r, 3, W * 2) for r in range(3)])
        ck.commit(2, ["coordinator"])
        assert torch.equal(ck.restore(2, part="coordinator")["model"]["w"], W * 2)
        assert g3.bytes_written < g3.logical_bytes - B.nbytes


def test_plan_stores_equal_values_once_balanced_and_refuses_diverged_replicas():
    def cand(key, digest, nbytes=100, must=False):
        return Candidate(candidate_key(key, None, (nbytes,)), "{}", nbytes, digest, must)

    def owners(owner):
        return {json.loads(k)[0]: r for k, r in owner.items()}

    # DDP-like: four equal values on two ranks: two stored on each, the largest first
    sizes = [400, 300, 200, 100]
    summaries = [Summary(r, "ab" * 8 if r == 0 else "", "s", 0, tuple(cand(f"k{i}", f"d{i}", n) for i, n in enumerate(sizes)))
                 for r in range(2)]
    plan = make_plan(summaries)
    assert owners(plan.owner[0]) == owners(plan.owner[1]) == {"k0": 0, "k1": 1, "k2": 1, "k3": 0}
    assert plan.stored_bytes(summaries) == [500, 500] and plan.save_id == "ab" * 8
    assert plan.skeleton_of == (None, 0)
    # a value that differs per rank is each rank's own; a Replicate() piece that differs is refused
    per_rank = [Summary(r, "", "s", 0, (cand("rng", f"d{r}"),)) for r in range(2)]
    assert [owners(o) for o in make_plan(per_rank).owner] == [{"rng": 0}, {"rng": 1}]
    with pytest.raises(UnsupportedState, match="replicas diverged"):
        make_plan([Summary(r, "", "s", 0, (cand("w", f"d{r}", must=True),)) for r in range(2)])
    # a rank holding more shards already gets fewer of the shared values
    skewed = [Summary(0, "", "s", 1000, (cand("a", "x"), cand("b", "y"))), Summary(1, "", "t", 0, (cand("a", "x"), cand("b", "y")))]
    assert owners(make_plan(skewed).owner[0]) == {"a": 1, "b": 1} and make_plan(skewed).skeleton_of == (None, None)


def test_pieces_geometry():
    assert pieces.overlap(((0, 0), (4, 4)), ((2, 3), (4, 4))) == ((2, 3), (2, 1))
    assert pieces.overlap(((0,), (2,)), ((2,), (2,))) is None
    assert pieces.element_span((4, 5), (1, 0), (2, 5)) == (5, 15)  # rows 1-2: one run
    assert pieces.element_span((4, 5), (1, 2), (2, 2)) == (7, 14)  # a column block: its first to last element
    assert pieces.is_contiguous((4, 5), (2, 5)) and pieces.is_contiguous((4, 5), (1, 3))
    assert not pieces.is_contiguous((4, 5), (2, 2))
    assert pieces.tiling_problem((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    assert "cover" in pieces.tiling_problem((4, 4), [((0, 0), (2, 4))])
    assert "outside" in pieces.tiling_problem((4, 4), [((3, 0), (2, 4)), ((0, 0), (3, 4))])
    # as many elements as the tensor, but two pieces overlap (and leave a gap)
    assert "overlap" in pieces.tiling_problem((4, 4), [((0, 0), (2, 4)), ((1, 0), (2, 4))])


def test_decode_ranges_reads_only_the_chunks_it_needs_and_checks_them(tmp_path):
    store = FaultyStore(Store.from_url(str(tmp_path / "run")))
    big = torch.randn(64, 96)
    with Checkpointer(store, chunk_bytes=CHUNK) as ck:
        ck.save(1, {"w": big, "small": torch.arange(10), "tiny": torch.ones(3)})
        big.mul_(1.0001)
        ck.save(2, {"w": big, "small": torch.arange(10), "tiny": torch.ones(3)})  # deltas on step 1
        frag = ck.fragment(2, "state")
        raw = big.numpy().view(np.uint8).reshape(-1)
        w = next(i for i, leaf in enumerate(frag.leaves) if leaf.spec.path == "/w")
        del store.calls[:]
        ranges = [ByteRange(w, 5000, 9000, np.empty(4000, np.uint8)), ByteRange(w, 100, 200, np.empty(100, np.uint8))]
        assert decode_ranges(frag, store, ck._pool, ranges) == []
        assert all(np.array_equal(r.out, raw[r.start:r.stop]) for r in ranges)
        fetched = {k for k in store.keys("get") if k.startswith("chunks/")}
        chain = {frag.blobs[d].key for d in frag.leaves[w].chunks[:3]}  # chunks 0-2 cover bytes 0..12288
        chain |= {frag.blobs[frag.blobs[d].base].key for d in frag.leaves[w].chunks[:3] if frag.blobs[d].base}
        assert fetched <= chain and len(fetched) < len(frag.blobs)
        whole = ByteRange(w, 0, big.nbytes, np.empty(big.nbytes, np.uint8))
        assert decode_ranges(frag, store, ck._pool, [whole]) == [] and np.array_equal(whole.out, raw)
        key = frag.blobs[frag.leaves[w].chunks[1]].key
        store.inner.put(key, b"garbage")
        problems = decode_ranges(frag, store, ck._pool, [ByteRange(w, 4096, 4200, np.empty(104, np.uint8))])
        assert problems and problems[0].tensor == "/w"


def test_a_groups_documents_are_checked(tmp_path):
    with Checkpointer(str(tmp_path / "run"), chunk_bytes=CHUNK) as ck:
        g = ck.write_group(3, "part", [rank_state(r, 2) for r in range(2)])
        ck.commit(3, ["part"])
        doc = ck.store.get(g.ranks[1].key)
        assert isinstance(loads_any_fragment(doc, "x"), RankFragment)
        text = json.dumps(document_json(doc), separators=(",", ":")).encode()
        assert b'"lr":0.1' in text
        ck.store.put(g.ranks[1].key, text.replace(b'"lr":0.1', b'"lr":0.2'))
        with pytest.raises(CorruptCheckpoint, match="does not match the checksum its group names"):
            ck.restore(3, part="part", rank=1)
        assert ck.verify(3) and "checksum" in str(ck.verify(3)[0])
        ck.store.delete(g.ranks[1].key)
        with pytest.raises(CorruptCheckpoint, match="missing from the store"):
            ck.restore(3, part="part")
        bad = g.to_json()
        bad["ranks"][0]["digest"] = "0" * 32
        with pytest.raises(ValueError, match="does not match its ranks"):
            GroupFragment.from_json(bad)
        with pytest.raises(FormatVersionError, match="install the ckptlib version"):
            loads_any_fragment(json.dumps({**g.to_json(), "format": 4}).encode(), "x")
        # a reader that knows only plain fragments (format 1-2) refuses a group's clearly
        from ckptlib.manifest import loads_fragment

        with pytest.raises(FormatVersionError):
            loads_fragment(json.dumps(g.to_json()).encode(), "x")


def test_gc_keeps_a_groups_rank_fragments_and_a_branch_copies_them(tmp_path):
    with Checkpointer(str(tmp_path / "run"), chunk_bytes=CHUNK) as ck:
        for step in (1, 2):
            ck.write_group(step, "p", [rank_state(r, 2, W + step) for r in range(2)])
            ck.commit(step, ["p"])
        pending = ck.write_group(3, "p", [rank_state(r, 2, W + 3) for r in range(2)])  # not committed yet
        report = ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
        assert report.dropped_steps == [1] and not report.skipped
        assert any(k.startswith("fragments/1/p.g0.r") for k in report.deleted_objects)
        for r in pending.ranks:  # a cut being gathered keeps its ranks' fragments and chunks
            assert ck.store.exists(r.key)
        ck.commit(3, ["p"])
        assert torch.equal(ck.restore(3, part="p")["model"]["w"], W + 3)
        assert torch.equal(ck.restore(2, part="p")["model"]["w"], W + 2)
        target = Store.from_url(str(tmp_path / "branch"))
        branch(ck.store, 2, target)
    with Checkpointer(target) as other:
        assert other.verify(2) == []
        assert torch.equal(other.restore(2, part="p")["model"]["w"], W + 2)


def test_a_dtensor_outside_a_collective_checkpointer_names_the_fix(tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        dt = DTensor.from_local(torch.ones(4), DeviceMesh("cpu", [0]), [Shard(0)])
        with Checkpointer(str(tmp_path / "plain")) as ck, pytest.raises(UnsupportedState, match=r"process_group="):
            ck.save(1, {"w": dt})
        # a group of one: the DTensor is its local shard and its place; restored as a full tensor
        with Checkpointer(str(tmp_path / "run"), process_group=dist.group.WORLD) as ck:
            info = ck.save(1, {"w": dt, "n": 3})
            assert info.committed
            back = ck.restore(1, into={"w": DTensor.from_local(torch.zeros(4), DeviceMesh("cpu", [0]), [Shard(0)]), "n": 0})
            assert isinstance(back["w"], DTensor) and torch.equal(back["w"].to_local(), torch.ones(4)) and back["n"] == 3
        with Checkpointer(str(tmp_path / "run")) as ck:
            assert torch.equal(ck.restore(1)["w"], torch.ones(4))
    finally:
        dist.destroy_process_group()


def test_validation_measures_a_groups_part_rank_by_rank(tmp_path):
    from ckptlib import commit
    from ckptlib.validate import validate_checkpoint

    url = str(tmp_path / "run")
    with Checkpointer(url, chunk_bytes=CHUNK) as ck:
        for step, w in ((1, W), (2, W * 1.01), (3, W.clone().index_fill_(0, torch.tensor([40]), float("nan")))):
            g = ck.write_group(step, "state", [rank_state(r, 2, w) for r in range(2)])
            commit.commit_step(ck.store, step, {"state": (g, None)}, parent=step - 1 or None, single=True)
    assert validate_checkpoint(url, 1, report=False).passed
    v2 = validate_checkpoint(url, 2, report=False)
    assert v2.passed, v2.failed
    v3 = validate_checkpoint(url, 3, report=False)  # row 40 is in rank 1's shard
    assert list(v3.failed) == ["no_nan"]
    [failure] = v3.failures
    assert failure.where == ("part 'state/r1', tensor 'model/w' (nan_count=96)",)
