"""Every read is bounded before it is read (docs/security.md, "Bounds"): a planted rank fragment,
group fragment, meta or crowd of rank heartbeats costs the reader no more than the cap of its kind.

Memory and time are measured in a fresh subprocess (peak RSS from ``getrusage``), on a real local
store whose documents were written by ckptlib and then forged in place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zstandard

from ckptlib import Checkpointer, CheckpointError, CorruptCheckpoint, RetentionPolicy, UnsupportedState, damage
from ckptlib.distributed.documents import group_digest, rank_fragment_key
from ckptlib.distributed.restoring import RankState
from ckptlib.heartbeat import Heartbeat
from ckptlib.manifest import combined_digest, document_checksum
from ckptlib.quarantine import quarantine_step
from ckptlib.store import Store
from ckptlib.testing import document_json

MEASURE = """
import json, resource, sys, time
from ckptlib import Checkpointer
from ckptlib.store import Store
from ckptlib.testing.faulty import FaultyStore
store = FaultyStore(Store.from_url(sys.argv[1]))
with Checkpointer(store) as ck:
    base, t = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    try:
        ck.restore(1, part="shard-0")
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"error": error, "seconds": time.perf_counter() - t,
                      "rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024,
                      "rank_reads": sum(".r" in k for k in store.keys("get"))}))
"""


def measured_restore(root: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(root)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def group_part(root: Path) -> tuple[Store, dict]:
    """A committed group's part of two ranks (step 1, part shard-0); its group fragment's document."""
    with Checkpointer(str(root)) as ck:
        g = ck.write_group(1, "shard-0", [RankState({"x": np.full(8, float(r)), "r": r}, {}) for r in range(2)])
        ck.commit(1, ["shard-0"])
        return ck.store, document_json(ck.store.get(g.key))


def test_a_3_gib_rank_fragment_is_refused_unread(tmp_path):
    _, group = group_part(tmp_path)
    os.truncate(tmp_path / group["ranks"][1]["key"], 3 << 30)  # sparse: costs the disk nothing
    got = measured_restore(tmp_path)
    print("3 GiB rank fragment:", got)
    assert "3221225472 bytes, more than the 134217728" in got["error"] and "refused unread" in got["error"]
    assert got["rss_mb"] < 100 and got["seconds"] < 1


def test_a_forged_400000_rank_group_fragment_is_refused_before_a_rank_is_built_or_read(tmp_path):
    store, d = group_part(tmp_path)
    world = 400_000
    d["world"] = world
    d["ranks"] = [{**d["ranks"][0], "rank": r, "key": rank_fragment_key(1, "shard-0", 0, r, d["save_id"])}
                  for r in range(world)]
    d["digest"] = group_digest(world, [r["digest"] for r in d["ranks"]])  # consistent: only its size is wrong
    data = json.dumps(d, separators=(",", ":")).encode()
    store.put("fragments/1/shard-0.g0.json", data)
    m = document_json(store.get("manifests/1.json"))
    m["parts"]["shard-0"].update(checksum=document_checksum(data), size=len(data), digest=d["digest"])
    m["digest"] = combined_digest({"shard-0": d["digest"]}, False)
    store.put("manifests/1.json", json.dumps(m).encode())
    got = measured_restore(tmp_path)
    print(f"forged group fragment of {world} ranks ({len(data)} bytes):", got)
    assert "world 400000 is not an int in [1, 65536]" in got["error"]
    assert got["rank_reads"] == 0
    # its cost is parsing the document (bounded by the fragment cap), not the world it declares
    assert got["seconds"] < 12 and got["rss_mb"] < 6 * len(data) / 2**20


def test_a_meta_over_the_cap_is_refused_on_read_as_on_write(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"x": np.arange(4)}, meta={"note": "small"})
        with pytest.raises(UnsupportedState, match=r"meta of 2097\d+ bytes, more than the 1048576"):
            ck.save(2, {"x": np.arange(4)}, meta={"note": "y" * (2 << 20)})
    path = tmp_path / "manifests" / "1.json"
    m = document_json(path.read_bytes())
    m["meta"] = {"note": "y" * (118 << 20)}  # within the manifest's cap, 118 times meta's
    path.write_text(json.dumps(m))
    with Checkpointer(str(tmp_path)) as ck, pytest.raises(CorruptCheckpoint, match="meta is more than the 1048576"):
        ck.restore(1)


def test_status_shows_the_groups_own_rank_beats_and_counts_20000_planted_ones(tmp_path):
    from rich.console import Console

    from ckpt.cmd_watchdog import render_status, status_of

    store = Store.from_url(str(tmp_path))
    for rank in (0, 1):
        Heartbeat(store, "shard-0", generation=0, round=1, every_s=60, rank=rank, meta={"ranks": 2}).start(step=0)
    beat = json.loads(store.get("heartbeats/ranks/shard-0/1.json"))
    folder = tmp_path / "heartbeats" / "ranks" / "shard-0"
    for r in range(2, 20_002):  # planted: valid beats of ranks the group of 2 does not have
        (folder / f"{r}.json").write_text(json.dumps({**beat, "rank": r, "pid": r}))
    t = time.perf_counter()
    (run,) = status_of(str(tmp_path))
    seconds = time.perf_counter() - t
    print(f"status with 20,000 planted rank beats: {seconds:.2f} s")
    (part,) = run["parts"]
    assert [k["rank"] for k in part["ranks"]] == [0, 1] and part["foreign_beats"] == 20_000
    console = Console(record=True, width=150)
    console.print(render_status([run]))
    assert "20000 foreign heartbeats ignored" in console.export_text()
    assert seconds < 2


def many_leaves(root: Path, steps: int = 2) -> None:
    with Checkpointer(str(root)) as ck:
        for step in range(1, steps + 1):
            ck.save(step, {f"layer{i}": np.full(16, float(i + step), dtype=np.float32) for i in range(300)})


def test_manifests_are_stored_as_one_zstd_frame_that_declares_its_size_and_plain_json_still_reads(tmp_path):
    many_leaves(tmp_path)
    stored = (tmp_path / "manifests" / "2.json").read_bytes()
    text = json.dumps(document_json(stored), separators=(",", ":")).encode()
    assert stored[:4] == b"\x28\xb5\x2f\xfd" and zstandard.frame_content_size(stored) == len(text)
    assert len(stored) < len(text) / 3, (len(stored), len(text))  # 300 paths and digests
    # what ckptlib wrote before: the same document as plain JSON is read as it was
    (tmp_path / "manifests" / "2.json").write_bytes(text)
    with Checkpointer(str(tmp_path)) as ck:
        assert ck.restore(2)["layer7"][0] == 9.0


@pytest.mark.parametrize("forgery", ["over-the-cap", "no-size", "trailing-bytes", "damaged"])
def test_a_forged_or_damaged_manifest_frame_is_refused_before_it_is_decoded(tmp_path, forgery):
    many_leaves(tmp_path, steps=1)
    path = tmp_path / "manifests" / "1.json"
    text = zstandard.ZstdDecompressor().decompress(path.read_bytes())
    if forgery == "over-the-cap":  # 200 MiB of JSON whitespace in a frame of a few KiB
        frame = zstandard.ZstdCompressor(level=1).compress(text + b" " * (200 << 20))
    elif forgery == "no-size":
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(text)
    elif forgery == "trailing-bytes":
        frame = path.read_bytes() + b'{"format": 2}'
    else:
        frame = bytearray(path.read_bytes())
        frame[len(frame) // 2] ^= 0xFF
        frame = bytes(frame)
    path.write_bytes(frame)
    measure = MEASURE.replace('ck.restore(1, part="shard-0")', "ck.restore(1)")
    out = subprocess.run([sys.executable, "-c", measure, str(tmp_path)], capture_output=True, text=True, timeout=300)
    got = json.loads(out.stdout.splitlines()[-1])
    print(forgery, got)
    assert got["error"].startswith("DamagedStep: step 1 of") and "manifests/1.json" in got["error"], got
    expected = {"over-the-cap": f"declares {len(text) + (200 << 20)} bytes of JSON; ckptlib writes at most",
                "no-size": "declares no size of JSON", "trailing-bytes": "does not decode", "damaged": ""}[forgery]
    assert expected in got["error"], got
    assert got["rss_mb"] < 100  # nothing of the declared 200 MiB was allocated


def test_garbage_collection_stops_at_a_quarantined_manifest_whose_frame_does_not_decode(tmp_path):
    """A quarantined step keeps the objects its manifest names; a frame that does not decode names
    none, and collecting without them could delete what the step holds: the collection stops and says
    which folder to remove (plain JSON, damaged, is still searched for the names it holds)."""
    many_leaves(tmp_path, steps=3)
    with Checkpointer(str(tmp_path)) as ck:
        quarantine_step(ck.store, 1, "test")
    aside = tmp_path / "quarantine" / "1" / "manifests" / "1.json"
    frame = bytearray(aside.read_bytes())
    frame[8:40] = bytes(32)  # its block header and first sequences
    aside.write_bytes(bytes(frame))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    with Checkpointer(str(tmp_path)) as ck, pytest.raises(CheckpointError) as err:
        ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
    assert "garbage collection stops" in str(err.value) and f"remove file://{tmp_path}/quarantine/1/" in str(err.value)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()) == before


def test_a_step_whose_manifest_frame_does_not_decode_is_quarantined_distrusting_every_object(tmp_path):
    """What it names cannot be read, so no later save may take any object of the store on trust
    (a dedup hit) until a verify confirms it."""
    many_leaves(tmp_path, steps=2)
    path = tmp_path / "manifests" / "2.json"
    frame = bytearray(path.read_bytes())
    frame[8:40] = bytes(32)
    path.write_bytes(bytes(frame))
    with Checkpointer(str(tmp_path)) as ck:
        quarantine_step(ck.store, 2, "test")
        note = damage.notes(ck.store)[2]
        assert note.every and note.found_by == "quarantine", note
        assert ck.steps() == [1]
