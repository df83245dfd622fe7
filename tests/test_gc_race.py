"""A saver, a GC loop and a restorer in three processes on one store, with no grace period: no
committed step is ever lost (docs/format.md, "Garbage collection"). The interleavings are the
machine's, not scripted (ckptlib.testing.protocol scripts them: tests/test_protocol.py).

Before the GC listed the steps after reading the leases and marked the steps committed while it
planned, 6 of 93 steps of such a run could no longer be restored ("chunk ... is missing from the
store"): a GC that listed the steps before a save committed, and read the leases after it ended,
swept the save's new keyframe. ``CKPT_GC_RACE_S`` sets how long each run lasts (default 20 s: on 2
shared cores that is still scores of saves, GCs that drop steps and restores beside them, which the
test checks it got; set it longer to look harder for a rarer interleaving)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptlib import Checkpointer
from ckptlib.testing.compare import first_difference

sys.path.insert(0, str(Path(__file__).parent))
from gc_race_roles import state  # noqa: E402

SECONDS = float(os.environ.get("CKPT_GC_RACE_S", "20"))
ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SECONDS * 3 + 240)]


def _race(url: str, options: dict | None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if options:
        env["CKPT_STORAGE_OPTIONS"] = json.dumps(options)
    script = str(ROOT / "tests" / "gc_race_roles.py")
    procs = {role: subprocess.Popen([sys.executable, script, role, url, str(SECONDS)], env=env, cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("saver", "gc", "restorer")}
    results = {}
    for role, proc in procs.items():
        out, err = proc.communicate(timeout=SECONDS + 180)
        assert proc.returncode == 0, f"the {role} failed:\n{err[-3000:]}"
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


def _every_committed_step_restores(url: str, options: dict | None) -> list[int]:
    with Checkpointer(url, options) as ck:
        steps = ck.steps()
        for step in steps:
            assert first_difference(state(step), ck.restore(step)) is None, f"step {step}"
            assert ck.verify(step) == [], f"verify of step {step}"
    return steps


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_saver_gc_and_restorer_race_loses_no_commit(kind, tmp_path, request):
    if kind == "local":
        url, options = str(tmp_path / "run"), None
    else:
        loc = request.getfixturevalue("s3_url")
        url, options = loc.url, loc.storage_options
    results = _race(url, options)
    kept = _every_committed_step_restores(url, options)
    saver, gc, restorer = results["saver"], results["gc"], results["restorer"]
    # the race really ran: many saves, many GCs that dropped steps, many restores beside them
    assert saver["saved"] >= 20 and gc["gc_runs"] >= 10 and gc["dropped"] >= 10 and gc["chunks_swept"] >= 10, results
    assert restorer["restored"] >= 10, results
    assert kept and kept[-1] == saver["saved"], (kept, results)
