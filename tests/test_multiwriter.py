"""Fragments, fencing and the coordinator's commit (docs/format.md, "Commit protocol"; fencing: docs/watchdog.md)."""

import threading

import pytest
import torch

from ckptlib import Checkpointer, CommitConflict, FencedError


def test_cut_commits_only_when_every_part_is_there(tmp_path):
    url = str(tmp_path)
    shards = [Checkpointer(url) for _ in range(3)]
    coord = Checkpointer(url)
    done = {}

    def coordinator():
        done["info"] = coord.commit(1, ["shard-0", "shard-1", "shard-2"], timeout=30)

    t = threading.Thread(target=coordinator)
    t.start()
    for i, ck in enumerate(shards[:2]):
        ck.write_fragment(1, f"shard-{i}", {"w": torch.full((1000,), float(i))}, config_hash="c1")
    t.join(0.5)
    assert t.is_alive() and coord.steps() == []  # one part missing: nothing visible
    shards[2].write_fragment(1, "shard-2", {"w": torch.full((1000,), 2.0)}, config_hash="c1")
    t.join(30)
    assert done["info"].committed and coord.steps() == [1]
    state = Checkpointer(url).restore(1)
    assert sorted(state) == ["shard-0", "shard-1", "shard-2"]
    assert torch.equal(state["shard-2"]["w"], torch.full((1000,), 2.0))
    assert torch.equal(Checkpointer(url).restore(1, part="shard-1")["w"], torch.full((1000,), 1.0))


def test_fenced_generation_is_refused_and_never_in_the_cut(tmp_path):
    url = str(tmp_path)
    zombie, live, coord = Checkpointer(url), Checkpointer(url), Checkpointer(url)
    assert coord.fence("shard-0", 1, reason="silent for 30 s", by="watchdog-a")
    assert not coord.fence("shard-0", 1, reason="also saw it", by="watchdog-b")  # exactly one wins
    with pytest.raises(FencedError, match="generation 1 is live"):
        zombie.write_fragment(1, "shard-0", {"w": torch.zeros(10)}, generation=0)
    # a zombie that wrote before noticing: its fragment exists but is not the live generation
    from ckptlib import commit
    from ckptlib.save import encode_part, take_snapshot

    snap = take_snapshot({"w": torch.full((10,), -1.0)}, zombie._pool, 1 << 20)
    frag = encode_part(snap, None, zombie.store, zombie._pool, zombie.options, step=1, part="shard-0",
                       generation=0).fragment
    commit.put_fragment(zombie.store, frag)
    live.write_fragment(1, "shard-0", {"w": torch.ones(10)}, generation=1)
    coord.commit(1, ["shard-0"], timeout=5)
    assert torch.equal(Checkpointer(url).restore(1, part="shard-0")["w"], torch.ones(10))
    assert Checkpointer(url).manifest(1).parts["shard-0"].generation == 1


def test_fragments_must_agree_on_config(tmp_path):
    url = str(tmp_path)
    Checkpointer(url).write_fragment(2, "a", {"x": torch.ones(2)}, config_hash="one")
    Checkpointer(url).write_fragment(2, "b", {"x": torch.ones(2)}, config_hash="two")
    with pytest.raises(CommitConflict, match="disagree"):
        Checkpointer(url).commit(2, ["a", "b"], timeout=5)
    assert Checkpointer(url).steps() == []


def test_commit_times_out_naming_missing_parts(tmp_path):
    Checkpointer(str(tmp_path)).write_fragment(3, "a", {"x": torch.ones(2)})
    with pytest.raises(TimeoutError, match=r"\['b'\]"):
        Checkpointer(str(tmp_path)).commit(3, ["a", "b"], timeout=0.5)


def test_read_fragment_and_delta_against_restored_part(tmp_path):
    url = str(tmp_path)
    w = torch.randn(500_000)
    Checkpointer(url).write_fragment(1, "shard-0", {"w": w})
    assert torch.equal(Checkpointer(url).read_fragment(1, "shard-0")["w"], w)
    Checkpointer(url).commit(1, ["shard-0"])
    ck = Checkpointer(url)  # a fresh process: its delta base comes from a restore that keeps it
    state = ck.restore(part="shard-0", keep_base=True)
    state["w"][:100] += 1
    frag = ck.write_fragment(2, "shard-0", state)
    assert frag.stats["delta"] + frag.stats["unchanged"] == sum(frag.stats.values())
    assert frag.bytes_written * 10 < frag.logical_bytes
