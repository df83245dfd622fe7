"""Stateful objects (state_dict / load_state_dict, as DCP takes them) in Checkpointer.save and restore.

Also run as ``python tests/test_stateful.py <rank> <world> <port> <dir>``: one rank of the 2-rank gloo
test (the test starts both ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptlib import Checkpointer, UnsupportedState

ROOT = Path(__file__).resolve().parent.parent


def trio(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A model, its Adam optimizer and an LR scheduler, trained ``seed % 5 + 2`` steps from seed ``seed``."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(seed % 5 + 2):
        m(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return m, opt, sched


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested state dicts (tensors by bytes, dtype and shape)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b and type(a) is type(b)


class Counter:
    """A user object with state_dict/load_state_dict (no torch base class)."""

    def __init__(self, n: int = 0, seen: list[str] | None = None):
        self.n, self.seen = n, list(seen or [])

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "seen": list(self.seen), "t": torch.full((2,), self.n / 3, dtype=torch.float64)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n, self.seen = sd["n"], list(sd["seen"])


class SaveOnly:
    """state_dict without load_state_dict: saved, not restorable in place."""

    def state_dict(self) -> dict[str, Any]:
        return {"x": 1}


def states(*objs: Any) -> list[Any]:
    return [o.state_dict() for o in objs]


def test_model_optimizer_scheduler_round_trip_bit_exact_into_fresh_objects(tmp_path):
    m, opt, sched = trio(3)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, {"model": m, "optimizer": opt, "scheduler": sched, "epoch": 7})
        m2, opt2, sched2 = trio(11)  # other weights, other moments, another scheduler position
        assert not same(states(m, opt, sched), states(m2, opt2, sched2))
        plain = ck.restore()  # without into: the plain state dicts, as saved
        assert same(plain, {"model": m.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "epoch": 7})
        out = ck.restore(into={"model": m2, "optimizer": opt2, "scheduler": sched2, "epoch": 0})
    assert same(states(m, opt, sched), states(m2, opt2, sched2))
    assert out["epoch"] == 7
    # the restored objects train on exactly as the saved ones would
    for mm, oo, ss in ((m, opt, sched), (m2, opt2, sched2)):
        torch.manual_seed(99)
        mm(torch.randn(4, 8)).square().mean().backward()
        oo.step()
        ss.step()
    assert same(states(m, opt, sched), states(m2, opt2, sched2))


def test_user_class_and_nested_positions(tmp_path):
    m, opt, _ = trio(1)
    state = {"run": {"counters": [Counter(3, ["a"]), {"deep": Counter(5)}], "model": m}, "opt": opt}
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state)
        m2, opt2, _ = trio(2)
        c0, c1 = Counter(), Counter()
        ck.restore(into={"run": {"counters": [c0, {"deep": c1}], "model": m2}, "opt": opt2})
        assert (c0.n, c0.seen, c1.n) == (3, ["a"], 5)
        assert same(states(m, opt), states(m2, opt2))
        # a Stateful as the whole state, and one restored from a selection
        ck.save(2, Counter(4, ["b"]))
        whole = Counter()
        ck.restore(2, into=whole)
        assert (whole.n, whole.seen) == (4, ["b"])
        m3 = trio(4)[0]
        ck.restore(1, into={"run": {"model": m3}}, select=["run/model"])
        assert same(m.state_dict(), m3.state_dict())
        with pytest.raises(ValueError, match=r"picks part of the Stateful Sequential at run/model.*select 'run/model'"):
            ck.restore(1, into={"run": {"model": m3}}, select=["run/model/0.weight"])


def test_refusals_name_the_path_and_the_fix(tmp_path):
    class Bad:
        def state_dict(self) -> dict[str, Any]:
            return {"ok": 1, "fn": lambda: 0}

        def load_state_dict(self, sd: Any) -> None:
            pass

    with Checkpointer(str(tmp_path)) as ck:
        with pytest.raises(UnsupportedState, match=r"trainer/fn"):
            ck.save(1, {"trainer": Bad()})
        assert ck.steps() == []
        ck.save(2, {"hooks": SaveOnly(), "c": Counter(2)})  # saved as its state dict
        assert ck.restore() == {"hooks": {"x": 1}, "c": {"n": 2, "seen": [], "t": pytest.approx([2 / 3, 2 / 3])}}
        c = Counter()
        with pytest.raises(TypeError, match=r"hooks is a SaveOnly, which has state_dict\(\) but no load_state_dict"):
            ck.restore(into={"hooks": SaveOnly(), "c": c})
        assert c.n == 0  # refused before anything was read or loaded


def test_save_async_takes_the_state_dicts_when_called(tmp_path):
    c = Counter(2)
    with Checkpointer(str(tmp_path)) as ck:
        fut = ck.save_async(1, {"c": c})
        c.n = 9  # after save_async returned: not in step 1
        fut.result()
        assert ck.restore()["c"]["n"] == 2


# --- 2 gloo ranks: a collective Checkpointer -------------------------------------------------------

def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        m, opt, sched = trio(rank)  # per-rank values: each rank restores its own
        with Checkpointer(f"{out}/ckpt", process_group=dist.group.WORLD) as ck:
            ck.save(1, {"model": m, "optimizer": opt, "scheduler": sched, "c": Counter(rank + 1)})
            m2, opt2, sched2 = trio(rank + 7)
            c = Counter()
            ck.restore(into={"model": m2, "optimizer": opt2, "scheduler": sched2, "c": c})
        ok = same(states(m, opt, sched), states(m2, opt2, sched2)) and c.n == rank + 1
        Path(f"{out}/r{rank}.json").write_text(json.dumps({"ok": ok}))
    finally:
        dist.destroy_process_group()


def test_collective_checkpointer_saves_and_restores_statefuls_on_two_gloo_ranks(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's ckptlib
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(port), str(tmp_path)], cwd=ROOT, env=env)
             for r in range(2)]
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 0]
    assert [json.loads((tmp_path / f"r{r}.json").read_text())["ok"] for r in range(2)] == [True, True]


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
