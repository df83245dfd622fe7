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

from ckptlib import Checkpointer, CorruptCheckpoint, UnsupportedState
from ckptlib.distributed.documents import group_digest, rank_fragment_key
from ckptlib.distributed.restoring import RankState
from ckptlib.heartbeat import Heartbeat
from ckptlib.manifest import combined_digest, document_checksum
from ckptlib.store import Store

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
        return ck.store, json.loads(ck.store.get(g.key))


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
    m = json.loads(store.get("manifests/1.json"))
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
    m = json.loads(path.read_bytes())
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
