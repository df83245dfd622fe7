"""The three processes of the saver / GC / restorer race (tests/test_gc_race.py), each run as
``python tests/gc_race_roles.py ROLE URL SECONDS`` with s3fs options in ``CKPT_STORAGE_OPTIONS``.

* saver: saves steps 1, 2, ... of ``state(step)`` as a follower (each save a delta against the
  last, with new keyframes as chains end), restoring its base again now and then, with up to 60 ms
  of "training" between two saves, for SECONDS;
* gc: ``gc(RetentionPolicy(keep_last=2), grace_s=0)`` in a loop, 0.2 s apart;
* restorer: restores committed steps at random; each one must come back bit-exactly, or fail
  because the step was dropped by a GC meanwhile (it is no longer committed). Prints one JSON
  line of counts at the end; exits 1 at the first wrong state.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

from ckptlib import Checkpointer, CheckpointError, RetentionPolicy, StoreError
from ckptlib.testing.compare import first_difference

CHUNK = 16 << 10


def state(step: int) -> dict:
    """A state whose chunks change in every way a save meets: sparse (the embedding rows a step
    touched), dense (a layer every step), not at all (frozen), and whole new values (every 7th step)."""
    g = torch.Generator().manual_seed(step)
    frozen = torch.randn(8192, generator=torch.Generator().manual_seed(0))
    dense = torch.randn(8192, generator=torch.Generator().manual_seed(1)) + 0.001 * step
    emb = torch.zeros(64, 256)
    for s in range(1, step + 1):
        emb[s % 64] += s
    fresh = torch.randn(4096, generator=g) if step % 7 == 0 else torch.zeros(4096)
    return {"model": {"frozen": frozen, "dense": dense, "emb": emb, "fresh": fresh}, "step": step,
            "note": f"step {step}"}


def _options() -> dict | None:
    text = os.environ.get("CKPT_STORAGE_OPTIONS")
    return json.loads(text) if text else None


def saver(url: str, seconds: float) -> dict:
    deadline, step, rng = time.monotonic() + seconds, 0, random.Random(1)
    with Checkpointer(url, _options(), chunk_bytes=CHUNK, keyframe_every=4) as ck:
        while time.monotonic() < deadline:
            step += 1
            ck.save(step, state(step))
            if step % 5 == 0:
                ck.restore(step, keep_base=True)
            time.sleep(rng.uniform(0, 0.06))  # training between two saves: a GC may sweep meanwhile
    return {"saved": step}


def gc_loop(url: str, seconds: float) -> dict:
    deadline, runs, dropped, swept = time.monotonic() + seconds, 0, 0, 0
    while time.monotonic() < deadline:
        with Checkpointer(url, _options()) as ck:
            try:
                report = ck.gc(RetentionPolicy(keep_last=2), grace_s=0)
            except CheckpointError as e:  # nothing to collect yet, or another GC's lock
                if "not a ckptlib store" not in str(e) and "holds" not in str(e):
                    raise
                time.sleep(0.05)
                continue
        runs += 1
        dropped += len(report.dropped_steps)
        swept += sum(key.startswith("chunks/") for key in report.deleted_objects)
        time.sleep(0.2)  # a GC loop, not a spin: saves wait for a GC they saw start
    return {"gc_runs": runs, "dropped": dropped, "chunks_swept": swept}


def restorer(url: str, seconds: float) -> dict:
    deadline, rng = time.monotonic() + seconds, random.Random(0)
    counts = {"restored": 0, "dropped_meanwhile": 0}
    with Checkpointer(url, _options()) as ck:
        while time.monotonic() < deadline:
            steps = ck.steps()
            if not steps:
                time.sleep(0.05)
                continue
            step = rng.choice(steps[-3:])
            try:
                got = ck.restore(step)
            except (CheckpointError, StoreError) as e:
                if step in ck.steps():
                    raise AssertionError(f"committed step {step} does not restore: {e}") from e
                counts["dropped_meanwhile"] += 1
                continue
            diff = first_difference(state(step), got)
            if diff is not None:
                raise AssertionError(f"step {step} came back different: {diff}")
            counts["restored"] += 1
    return counts


ROLES = {"saver": saver, "gc": gc_loop, "restorer": restorer}

if __name__ == "__main__":
    role, url, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    torch.set_num_threads(1)
    print(json.dumps({role: ROLES[role](url, seconds)}), flush=True)
