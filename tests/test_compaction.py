"""Compaction of the newest step (ckptlib.compaction): the latest step restores from one keyframe per
chunk, and anything wrong with the compacted copy costs time, never data (the chains stay the truth)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from ckptlib import Checkpointer
from ckptlib.compaction import delta_tops, table_key

CHUNK = 64 << 10


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(1024, 128, generator=g), "bf": torch.randn(256, 256, generator=g).to(torch.bfloat16),
            "step": 0}


def _train(state: dict, k: int) -> None:
    """A sparse change: a few rows of each tensor (so chunks become delta chains)."""
    state["emb"][[k, 100 + 3 * k, 700 + k]] += 0.5
    state["bf"][k % 256] += 1
    state["step"] = k


def _series(root, n: int = 6, **kw) -> dict:
    state = _state()
    with Checkpointer(str(root), compact=True, chunk_bytes=CHUNK, **kw) as ck:
        for k in range(n):
            _train(state, k)
            ck.save(k, state)
        ck.wait()
    return state


def _exact(got: dict, want: dict) -> None:
    assert torch.equal(got["emb"], want["emb"]) and torch.equal(got["bf"], want["bf"]) and got["step"] == want["step"]


def _table(root, step: int) -> dict:
    with open(os.path.join(root, table_key(step, "state"))) as f:
        return json.load(f)


def _write_table(root, step: int, doc: dict) -> None:
    with open(os.path.join(root, table_key(step, "state")), "w") as f:
        json.dump(doc, f)


def _fallbacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "compact" in r.getMessage()]


def test_the_latest_step_restores_from_its_compacted_keyframes_alone(tmp_path):
    want = _series(tmp_path)
    with Checkpointer(str(tmp_path)) as reader:
        frag = reader.fragment(5, "state")
        tops = delta_tops(frag)
        table = _table(tmp_path, 5)
        assert tops and set(table["chunks"]) == set(tops)  # every delta-coded chunk was compacted
        # delete every stored delta of those chunks' chains: only the compaction can serve them now
        for digest in tops:
            d = digest
            while frag.blobs[d].base is not None:
                os.remove(os.path.join(tmp_path, frag.blobs[d].key))
                d = frag.blobs[d].base
        _exact(reader.restore(), want)
        assert reader.verify()  # verify reads the chains: the truth, now damaged


def test_only_the_newest_table_stays_and_objects_of_unchanged_chunks_are_reused(tmp_path):
    _series(tmp_path)
    tables = [k for k in os.listdir(tmp_path / "compact") if k != "objects" and os.listdir(tmp_path / "compact" / k)]
    assert tables == ["5"]
    named = {e["key"] for e in _table(tmp_path, 5)["chunks"].values()}
    stored = {os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path / "compact" / "objects")
              for f in fs}
    assert stored == named  # what the older tables alone named was deleted


@pytest.mark.parametrize("damage", ["flipped", "missing", "truncated", "swapped"])
def test_a_damaged_compacted_object_falls_back_to_its_chain_with_one_warning(tmp_path, caplog, damage):
    want = _series(tmp_path)
    entries = list(_table(tmp_path, 5)["chunks"].values())
    victim = os.path.join(tmp_path, entries[0]["key"])
    if damage == "flipped":
        data = bytearray(Path(victim).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(victim).write_bytes(bytes(data))
    elif damage == "missing":
        os.remove(victim)
    elif damage == "truncated":
        Path(victim).write_bytes(Path(victim).read_bytes()[:-7])
    else:  # two chunks' objects trade places in the table
        doc = _table(tmp_path, 5)
        a, b = list(doc["chunks"])[:2]
        doc["chunks"][a], doc["chunks"][b] = doc["chunks"][b], doc["chunks"][a]
        _write_table(tmp_path, 5, doc)
    caplog.set_level(logging.WARNING, logger="ckptlib")
    with Checkpointer(str(tmp_path)) as reader:
        _exact(reader.restore(), want)
        assert reader.verify() == []
    assert len(_fallbacks(caplog)) == 1 and "delta chain" in _fallbacks(caplog)[0]


def _forge(doc: dict, how: str, digest_of_keyframe: str) -> None:
    digest, entry = next(iter(doc["chunks"].items()))
    if how == "delta-codec":
        entry["codecs"] = [{"name": "xor_delta", "configuration": {}}]
    elif how == "foreign-key":
        entry["key"] = "manifests/5.json"
    elif how == "oversized":
        entry["size"] = 1 << 40
    elif how == "unknown-chunk":
        doc["chunks"]["0" * 32] = entry
    elif how == "keyframe-chunk":  # a chunk stored as a keyframe has no chain to shortcut
        doc["chunks"][digest_of_keyframe] = entry
    elif how == "other-fragment":
        doc["fragment"] = "f" * 32
    elif how == "not-json":
        doc.clear()
    elif how == "extra-field":
        entry["base"] = digest


@pytest.mark.parametrize("how", ["delta-codec", "foreign-key", "oversized", "unknown-chunk", "keyframe-chunk",
                                 "other-fragment", "not-json", "extra-field"])
def test_a_forged_table_is_ignored_whole_and_the_chains_restore(tmp_path, caplog, how):
    want = _series(tmp_path)
    with Checkpointer(str(tmp_path)) as reader:
        frag = reader.fragment(5, "state")
    keyframe = next(d for d, b in frag.blobs.items() if b.base is None)
    doc = _table(tmp_path, 5)
    _forge(doc, how, keyframe)
    if how == "not-json":
        Path(tmp_path, table_key(5, "state")).write_text("{not json")
    else:
        _write_table(tmp_path, 5, doc)
    caplog.set_level(logging.WARNING, logger="ckptlib")
    with Checkpointer(str(tmp_path)) as reader:
        _exact(reader.restore(), want)
    assert any("ignoring the compaction table" in m for m in _fallbacks(caplog))


def test_a_huge_table_is_refused_unread(tmp_path, caplog):
    want = _series(tmp_path)
    with open(os.path.join(tmp_path, table_key(5, "state")), "w") as f:
        f.write(" " * (64 << 20))
    caplog.set_level(logging.WARNING, logger="ckptlib")
    with Checkpointer(str(tmp_path)) as reader:
        _exact(reader.restore(), want)
    assert any("ignoring the compaction table" in m for m in _fallbacks(caplog))


def test_saves_in_quick_succession_stop_compactions_and_every_step_stays_exact(tmp_path, caplog):
    """save_async right after save_async: each stops the compaction of the previous step before
    its snapshot writes over the bytes that compaction reads."""
    state = _state()
    kept = {}
    caplog.set_level(logging.WARNING, logger="ckptlib")
    with Checkpointer(str(tmp_path), compact=True, chunk_bytes=CHUNK) as ck:
        for k in range(12):
            _train(state, k)
            ck.save_async(k, state)
            kept[k] = {"emb": state["emb"].clone(), "bf": state["bf"].clone(), "step": k}
        ck.wait()
        assert ck.compaction_bytes > 0
    with Checkpointer(str(tmp_path)) as reader:
        for k, want in kept.items():
            _exact(reader.restore(k), want)
    assert _table(tmp_path, 11)["step"] == 11
    assert _fallbacks(caplog) == []  # no compacted copy of the latest step was wrong


def test_a_writer_holding_its_base_and_a_restore_of_an_older_step_read_the_chains(tmp_path):
    state = _state()
    with Checkpointer(str(tmp_path), compact=True, chunk_bytes=CHUNK) as ck:
        for k in range(4):
            _train(state, k)
            ck.save(k, state)
        ck.wait()
        # the table of step 3 is the only one; step 2's chains serve step 2
        assert not os.path.exists(os.path.join(tmp_path, table_key(2, "state")))
        got = ck.restore(2)
        assert got["step"] == 2
        _exact(ck.restore(3), state)


def test_without_compact_nothing_is_written_beside_the_stream(tmp_path):
    state = _state()
    with Checkpointer(str(tmp_path), chunk_bytes=CHUNK) as ck:
        for k in range(3):
            _train(state, k)
            ck.save(k, state)
        assert ck.compaction_bytes == 0
    assert not os.path.exists(tmp_path / "compact")


def test_a_stopped_compaction_names_nothing_and_the_next_one_completes(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from ckptlib.compaction import Compactor
    from ckptlib.store import Store
    from ckptlib.throttle import RateLimiter

    state = _state()
    with Checkpointer(str(tmp_path), chunk_bytes=CHUNK) as ck:
        for k in range(3):
            _train(state, k)
            ck.save(k, state)
        raw = dict(ck._bases.held("state").raw)  # the bytes a compaction of step 2 reads
        frag = ck.fragment(2, "state")
    store = Store.from_url(str(tmp_path))
    with ThreadPoolExecutor(2) as pool:
        compactor = Compactor(store, pool, RateLimiter(None))
        compactor.stop.set()
        assert compactor.run(frag, raw) is None and not store.exists(table_key(2, "state"))
        compactor.stop.clear()
        table = compactor.run(frag, raw)
    assert table is not None and set(table.chunks) == set(delta_tops(frag))
    assert store.exists(table_key(2, "state")) and compactor.bytes_written > 0


def test_compaction_on_every_store_kind_restores_exact_and_gc_keeps_only_the_newest_table(any_store, caplog):
    """Local, memory and a real S3 server (SeaweedFS): write, read, fall back, sweep."""
    from ckptlib import RetentionPolicy
    from ckptlib.compaction import OBJECT_KEY, TABLE_KEY

    state = _state()
    with Checkpointer(any_store, compact=True, chunk_bytes=CHUNK) as ck:
        for k in range(4):
            _train(state, k)
            ck.save(k, state)
        ck.wait()
        assert ck.compaction_bytes > 0
    with Checkpointer(any_store) as reader:
        _exact(reader.restore(), state)
    tables = [key for key in any_store.list("compact") if TABLE_KEY.match(key)]
    objects = [key for key in any_store.list("compact") if OBJECT_KEY.match(key)]
    assert tables == [table_key(3, "state")] and objects
    any_store.delete(objects[0])
    caplog.set_level(logging.WARNING, logger="ckptlib")
    with Checkpointer(any_store) as reader:
        _exact(reader.restore(), state)
        reader.gc(RetentionPolicy(keep_last=1), grace_s=0)
        _exact(reader.restore(), state)
    assert len(_fallbacks(caplog)) == 2  # one per restore: the deleted object's chunk read its chain
    assert [key for key in any_store.list("compact") if TABLE_KEY.match(key)] == [table_key(3, "state")]


def test_compact_is_refused_for_a_collective_checkpointer_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="single writer"):
        Checkpointer(str(tmp_path), compact=True, process_group=object())
