"""No object is trusted because it exists (issue 37): a save after a step was found damaged (by
``verify``) or moved aside (``quarantine``) writes the damaged objects again instead of referencing
them; ``verify``'s findings mark the step in ``ckpt ls`` and keep ``restore()`` of the latest off it;
``ckpt show`` describes a collective (group) save as one. Local store and SeaweedFS S3."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpt.cli import app
from ckptlib import Checkpointer, CorruptCheckpoint
from ckptlib.quarantine import quarantine_step

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 64 << 10


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def run(request, tmp_path) -> tuple[str, dict | None]:
    """A new run's URL and its storage options."""
    if request.param == "local":
        return str(tmp_path / "run"), None
    loc = request.getfixturevalue("s3_url")
    return loc.url, dict(loc.storage_options)


def ckpt(run: tuple[str, dict | None], *args: str):
    url, options = run
    extra = ["--storage-options", json.dumps(options)] if options else []
    return CliRunner().invoke(app, [args[0], url, *args[1:], *extra], env={"COLUMNS": "80"})


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4 * CHUNK // 4, generator=g), "b": torch.arange(100, dtype=torch.float32)}


def open_ck(run: tuple[str, dict | None]) -> Checkpointer:
    return Checkpointer(run[0], run[1], chunk_bytes=CHUNK)


def flip_a_byte(ck: Checkpointer, step: int, avoid: frozenset[str] = frozenset(), key: str | None = None) -> str:
    """Flip one byte in the middle of ``key``, or of the largest object of ``step`` not in ``avoid``; its key."""
    if key is None:
        key = max((b for b in ck.fragment(step, "state").blobs.values() if b.key not in avoid), key=lambda b: b.size).key
    data = bytearray(ck.store.get(key))
    data[len(data) // 2] ^= 0xFF
    ck.store.put(key, bytes(data))
    return key


def first_chunk_of_w(ck: Checkpointer, step: int) -> str:
    frag = ck.fragment(step, "state")
    leaf = next(leaf for leaf in frag.leaves if leaf.spec.path == "/w")
    return frag.blobs[leaf.chunks[0]].key


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_save_after_quarantine_writes_the_damaged_object_again(run):
    """The outsiders' reproduction: save, flip a byte, `ckpt quarantine` (what `verify` recommends),
    save the same state with a fresh Checkpointer: the damaged chunk is written again, not reused."""
    with open_ck(run) as ck:
        ck.save(1, state())
        flip_a_byte(ck, 1)
    r = ckpt(run, "quarantine", "--step", "1")
    assert r.exit_code == 0, r.output
    with open_ck(run) as ck:
        info = ck.save(2, state())
        assert info.committed and info.bytes_written > 0
        assert ck.verify(2) == []
        assert same(ck.restore(2), state())


def test_a_long_lived_checkpointer_does_not_trust_what_it_saved_after_a_quarantine_elsewhere(run):
    """The writer that saved step 1 holds its blob table and bytes: unchanged chunks are referenced,
    a changed one is taken as a delta against its previous object. After another Checkpointer
    damaged that object and quarantined step 1 without a verify, its next save (a change in that
    chunk) takes no delta against it and references none of step 1's objects."""
    changed = state()
    changed["w"][5] += 1  # in the first chunk of w: a delta against it would do
    with open_ck(run) as writer:
        writer.save(1, state())
        with open_ck(run) as other:
            flip_a_byte(other, 1, key=first_chunk_of_w(other, 1))
            quarantine_step(other.store, 1, "a byte flipped")
        info = writer.save(2, changed)
        assert info.bytes_written > 0 and info.chunks["unchanged"] == 0, info
        # what step 2 found intact (or wrote again) this writer trusts from then on: one check each
        again = writer.save(3, changed)
        assert again.bytes_written == 0 and again.chunks["unchanged"] == sum(again.chunks.values()), again
        assert writer.verify(2) == [] and writer.verify(3) == []
    with open_ck(run) as reader:
        assert same(reader.restore(2), changed) and same(reader.restore(3), changed)


def test_verify_flags_a_step_ls_marks_it_and_restore_of_the_latest_skips_it(run, caplog):
    with open_ck(run) as ck:
        ck.save(1, state(0))
        ck.save(2, state(1))
        ck.save(3, state(2))
        bad = flip_a_byte(ck, 3, {b.key for s in (1, 2) for b in ck.fragment(s, "state").blobs.values()})
        assert ck.verify(3)  # flagged now, as `ckpt verify` would
        assert ck.verify(2) == []
    assert ckpt(run, "verify", "--step", "3").exit_code == 1
    r = ckpt(run, "ls")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if line.strip("│ ").startswith("3 "))
    table = [line for line in r.output.splitlines() if line[:1] in "┏┃┡│└"]
    assert "DAMAGED" in row and all(len(line) <= 80 for line in table), r.output
    assert "damaged: step 3: verify found" in r.output and bad in r.output
    with open_ck(run) as ck:
        with caplog.at_level(logging.WARNING, logger="ckptlib"):
            assert same(ck.restore(), state(1))
        skipped = [rec.getMessage() for rec in caplog.records if "step 3" in rec.getMessage()]
        assert len(skipped) == 1 and "step 2" in skipped[0], skipped
        for s in (2, 3):  # both validated: a resume still takes step 2
            ck.store.put(f"validations/{s}.json", b'{"passed": true}')
        assert ck.latest_step(healthy=True) == 2 and same(ck.restore(healthy=True), state(1))
        with caplog.at_level(logging.WARNING, logger="ckptlib"), pytest.raises(CorruptCheckpoint, match="checksum does not match"):
            ck.restore(3)  # asked for by name: read as any step, and its damaged object refused
        assert any("step 3" in r.getMessage() and "marked damaged" in r.getMessage() for r in caplog.records)
        # a save of step 3's state writes the damaged object again; verified intact, the flag drops
        assert ck.save(4, state(2)).bytes_written > 0
        from ckptlib import damage

        assert ck.verify(3) == [] and damage.flagged_steps(ck.store) == {}
        assert same(ck.restore(3), state(2)) and same(ck.restore(), state(2))
    assert "DAMAGED" not in ckpt(run, "ls").output


def test_the_record_is_checked_when_read(tmp_path):
    from ckptlib import damage

    with Checkpointer(str(tmp_path / "run"), chunk_bytes=CHUNK) as ck:
        ck.save(1, state())
        ck.store.put("damage/1.json", b'{"format": 1, "step": 1, "found_by": "verify", "time": "t", "objects": ["../../etc/passwd"]}')
        with pytest.raises(CorruptCheckpoint, match=r"damage/1.json.*not an object key"):
            damage.suspects(ck.store)
        ck.store.put("damage/1.json", b"x" * (damage.DamageNote.MAX_BYTES + 1))
        with pytest.raises(CorruptCheckpoint, match=r"more than"):
            damage.suspects(ck.store)


RANKS = """
import sys, torch, torch.distributed as dist
from ckptlib import Checkpointer
rank, port, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    with Checkpointer(url, process_group=dist.group.WORLD, group_timeout_s=60) as ck:
        ck.save(1, {"w": torch.full((8,), float(rank)), "b": torch.ones(3), "n": 7})
finally:
    dist.destroy_process_group()
"""


def test_show_describes_a_collective_save_of_two_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANKS, str(r), str(port), url], env=env, cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read() if p.stderr else ""
    with Checkpointer(str(tmp_path / "single")) as ck:  # the same tensors, saved by one writer
        ck.save(1, {"w": torch.zeros(8), "b": torch.ones(3), "n": 7})
    lines = [CliRunner().invoke(app, ["show", where]).output.splitlines() for where in (url, str(tmp_path / "single"))]
    group, single = ({line.split(": ", 1)[0]: line for line in out} for out in lines)
    assert group["layout"] == "layout: group of 2 ranks (one collective save)", lines[0]
    assert group["tensors"] == single["tensors"] != "tensors: -", lines


def test_a_step_committed_again_after_a_quarantine_is_not_flagged_but_the_old_objects_stay_suspect(run):
    """A note is about one commit of its step: the step saved again under the same number is a new
    commit (not marked, restored as the latest), while what the quarantined one named stays distrusted."""
    from ckptlib import damage

    with open_ck(run) as ck:
        ck.save(1, state(0))
        ck.save(2, state(1))
        bad = flip_a_byte(ck, 2, set())
        assert ck.verify(2)
        assert ckpt(run, "quarantine", "--step", "2").exit_code == 0
        ck.save(2, state(1))  # the same state under the same step: a new commit
        assert damage.flagged_steps(ck.store) == {}
        assert same(ck.restore(), state(1)) and ck.verify(2) == []
        assert bad in damage.notes(ck.store)[2].objects  # the quarantined commit's object, still suspect

