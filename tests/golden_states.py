"""The states of the golden checkpoints in tests/data/golden_v1 (format 1, written by ckptlib
0.1.0 at commit 8b29379 with ``python tests/golden_states.py DIR``). Never change what this
module returns: every future ckptlib must restore those checkpoints to exactly these states
(tests/test_golden.py). Values come from numpy's legacy RandomState, whose stream is fixed."""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

CHUNK_BYTES = 4096  # small, so that leaves span several chunks


def _rng(seed: int) -> np.random.RandomState:
    return np.random.RandomState(seed)


def single_state(step: int) -> dict:
    """Step 0, then 1 (a few elements change: sparse deltas), 2 (every element moves a little:
    dense deltas; complex128 has 16-byte elements: XOR deltas)."""
    r = _rng(0)
    w = r.standard_normal((64, 48)).astype(np.float32)           # 12 KiB: 3 chunks
    emb = r.standard_normal((256, 16)).astype(np.float32)        # 16 KiB
    z = (r.standard_normal(600) + 1j * r.standard_normal(600)).astype(np.complex128)  # 9.6 KiB
    ids = np.arange(1000, dtype=np.int64)
    half = r.standard_normal(3000).astype(np.float32)
    if step >= 1:
        rows = _rng(1).choice(256, 5, replace=False)
        emb[rows] += 0.5                                        # sparse change
        ids[::97] += 1
    if step >= 2:
        w *= np.float32(1.0001)                                 # dense change
        z *= 1.000001
        half += np.float32(1e-3)
    return {
        "model": {"w": torch.from_numpy(w.copy()), "emb": torch.from_numpy(emb.copy()),
                  "half": torch.from_numpy(half.copy()).to(torch.bfloat16)},
        "z": torch.from_numpy(z.copy()),
        "ids": ids.copy(),
        "np_scalar": np.float32(step + 0.25),
        "step": step,
        "tags": ("golden", step, None, True),
        "by_int": {0: {"lr": 1e-3 * (step + 1)}, 1: [1.5, float("nan"), float("-inf")]},
        "note": "ckptlib golden checkpoint",
    }


def part_state(part: str, step: int) -> dict:
    """Parts of a multi-writer cut at steps 0 and 1."""
    seed = {"coordinator": 10, "shard-0": 20, "shard-1": 30}[part]
    r = _rng(seed)
    a = r.standard_normal(2500).astype(np.float32)
    if step >= 1:
        a[::50] += 1.0
    return {"params": torch.from_numpy(a.copy()), "round": step, "part": part,
            "loss": None if step == 0 else round(math.log(2 + step), 6)}


PARTS = ("coordinator", "shard-0", "shard-1")


def write(root: str) -> dict:  # pragma: no cover - run once, with the ckptlib that wrote format 1
    import json
    import os

    from ckptlib import Checkpointer

    expected = {"single": {}, "multi": {}}
    with Checkpointer(os.path.join(root, "single"), chunk_bytes=CHUNK_BYTES) as ck:
        for step in (0, 1, 2):
            info = ck.save(step, single_state(step))
            expected["single"][str(step)] = {"digest": info.digest, "chunks": info.chunks}
    for step in (0, 1):
        writers = {p: Checkpointer(os.path.join(root, "multi"), chunk_bytes=CHUNK_BYTES) for p in PARTS}
        for part, ck in writers.items():
            if step:
                ck.restore(step - 1, part=part)  # the previous cut is this writer's delta base
            ck.write_fragment(step, part, part_state(part, step), config_hash="golden")
        with Checkpointer(os.path.join(root, "multi")) as ck:
            info = ck.commit(step, list(PARTS))
        for ck in writers.values():
            ck.close()
        expected["multi"][str(step)] = {"digest": info.digest, "chunks": info.chunks}
    with open(os.path.join(root, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    return expected


if __name__ == "__main__":  # pragma: no cover
    print(write(sys.argv[1]))
