"""A resume falls back past a damaged step (trainrun.resume): the newest healthy step that fails
`verify` is quarantined with its first problem as the reason, named in one log line, and the run
continues from the newest healthy step before it, to the same digests as a run that was never
damaged. Before, the resume picked the damaged step and every shard failed reading it."""

from __future__ import annotations

import logging

import torch

from ckptlib import Checkpointer
from ckptlib.quarantine import quarantined, read_record
from tests.runs import TINY, run_rounds
from trainrun.resume import where_to_start
from trainrun.spec import RunSpec


def _validated(ck: Checkpointer) -> None:
    for step in ck.steps():
        ck.store.put(f"validations/{step}.json", b'{"passed": true}')


def _flip_an_object_only(ck: Checkpointer, step: int) -> str:
    """Flip a byte of the largest chunk ``step`` names that the step before it does not."""
    def chunks(s: int) -> dict[str, int]:
        return {b.key: b.size for part in ck.manifest(s).parts for b in ck.fragment(s, part).blobs.values()}

    own = {k: n for k, n in chunks(step).items() if k not in chunks(step - 1)}
    key = max(own, key=own.__getitem__)
    data = bytearray(ck.store.get(key))
    data[len(data) // 2] ^= 0x01
    ck.store.put(key, bytes(data))
    return key


def test_a_resume_quarantines_a_damaged_latest_step_and_continues_from_the_one_before(tmp_path, caplog):
    spec = RunSpec(**TINY)
    clean = run_rounds(str(tmp_path / "clean"), spec, 3)
    url = str(tmp_path / "run")
    assert run_rounds(url, spec, 2) == {s: clean[s] for s in (0, 1, 2)}
    with Checkpointer(url) as ck:
        _validated(ck)
        _flip_an_object_only(ck, 2)
        with caplog.at_level(logging.WARNING):
            plan = where_to_start(ck, spec, resume=True)
        assert plan.start_step == 1, plan
        assert "step 2 was damaged" in plan.note and "quarantined" in plan.note
        lines = [r.getMessage() for r in caplog.records if "step 2" in r.getMessage()]
        assert len(lines) == 1 and "a resume found it damaged" in lines[0], lines
        assert ck.steps() == [0, 1] and sorted(quarantined(ck.store)) == [2]
        assert "a resume found it damaged" in read_record(ck.store, 2).reason
    # the resumed run recomputes steps 2 and 3 to the clean run's digests
    assert run_rounds(url, spec, 3, start=1) == {2: clean[2], 3: clean[3]}


def test_an_intact_resume_reads_what_it_resumes_from_once_and_quarantines_nothing(tmp_path):
    spec = RunSpec(**TINY)
    url = str(tmp_path / "run")
    run_rounds(url, spec, 2)
    with Checkpointer(url) as ck:
        _validated(ck)
        plan = where_to_start(ck, spec, resume=True)
        assert plan.start_step == 2 and "damaged" not in plan.note and quarantined(ck.store) == {}


def test_restore_with_fallback_quarantines_a_damaged_latest_step_and_restores_the_one_before(tmp_path, caplog):
    import pytest

    from ckptlib.errors import CorruptCheckpoint

    url = str(tmp_path / "lib")
    states = {s: {"w": torch.arange(20000, dtype=torch.float32) * s, "step": s} for s in (1, 2, 3)}
    with Checkpointer(url, chunk_bytes=16384) as ck:
        for s, state in states.items():
            ck.save(s, state)
        key = _flip_an_object_only(ck, 3)
    with Checkpointer(url) as ck:
        with pytest.raises(CorruptCheckpoint):
            ck.restore()  # off by default: the damage is the caller's to see
        into = {"w": torch.zeros(20000), "step": 0}
        with caplog.at_level(logging.WARNING):
            out = ck.restore(into=into, fallback=True)
        assert out["step"] == 2 and torch.equal(into["w"], states[2]["w"])
        lines = [r.getMessage() for r in caplog.records if "step 3" in r.getMessage()]
        assert len(lines) == 1 and "restore(fallback=True) found it damaged" in lines[0] and key in lines[0], lines
        assert ck.steps() == [1, 2] and sorted(quarantined(ck.store)) == [3]
        assert ck.restore(fallback=True)["step"] == 2  # nothing else to skip
        with pytest.raises(ValueError, match="latest step"):
            ck.restore(2, fallback=True)
