"""Real training loops through ckptlib: every LR scheduler, GradScaler, and a run killed with SIGKILL.

* Every scheduler class of ``torch.optim.lr_scheduler`` (found by enumeration: a new class without
  constructor arguments here fails the test): its ``state_dict()`` round-trips with exact types,
  and an optimizer + scheduler resumed from a checkpoint at step k give the same learning rates
  (and momenta, for the cyclic ones) as an uninterrupted run, bit for bit.
  LambdaLR/MultiplicativeLR: ``state_dict()`` holds ``None`` for a plain function or lambda (torch
  drops it; the resumed scheduler keeps the lambda it was constructed with) and the ``__dict__`` of a
  callable object (restored into that object by ``load_state_dict``); both cases are run.
* ``torch.amp.GradScaler("cpu")``: its state round-trips, and a resumed run (with skipped steps from
  inf gradients before and after the cut) matches an uninterrupted one.
* A small model + AdamW + StepLR + GradScaler + every RNG (torch, numpy, python; data, dropout
  and sampling draw from them) trained N steps with ``save_async`` every k steps, SIGKILLed after it
  committed a checkpoint, resumed in a fresh process with ``restore(into=...)`` +
  ``load_state_dict``: its final state is bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as L

from ckptlib import Checkpointer
from ckptlib.testing.compare import assert_same_state, differences

# --- (a) every LR scheduler ----------------------------------------------------------------------


class DecayingLambda:
    """A callable object with state of its own: LambdaLR saves its __dict__."""

    def __init__(self, rate: float):
        self.rate = rate
        self.scale = 1.0
        self.calls = 0

    def __call__(self, epoch: int) -> float:
        self.calls += 1
        self.scale *= self.rate
        return self.scale


SCHEDULERS = {
    "LambdaLR": lambda o: L.LambdaLR(o, lr_lambda=lambda e: 0.9 ** e),
    "LambdaLR_callable_object": lambda o: L.LambdaLR(o, lr_lambda=DecayingLambda(0.97)),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lr_lambda=lambda e: 0.97),
    "MultiplicativeLR_callable_object": lambda o: L.MultiplicativeLR(o, lr_lambda=DecayingLambda(0.99)),
    "StepLR": lambda o: L.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[3, 6, 6, 9], gamma=0.5),  # milestones: a Counter
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.25, total_iters=5),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.9),
    "SequentialLR": lambda o: L.SequentialLR(o, [L.LinearLR(o, start_factor=0.5, total_iters=3),
                                                  L.ExponentialLR(o, gamma=0.9)], milestones=[4]),
    "SequentialLR_with_MultiStepLR": lambda o: L.SequentialLR(o, [L.ConstantLR(o, factor=0.5, total_iters=2),
                                                                   L.MultiStepLR(o, milestones=[2, 5], gamma=0.1)],
                                                               milestones=[3]),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, T_max=7, eta_min=0.001),
    "ChainedScheduler": lambda o: L.ChainedScheduler([L.ConstantLR(o, factor=0.5, total_iters=3),
                                                      L.ExponentialLR(o, gamma=0.9)]),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, mode="min", factor=0.5, patience=1, threshold=0.01,
                                                       cooldown=1),
    "CyclicLR": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3, mode="triangular2"),
    "CyclicLR_exp_range": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, step_size_down=3,
                                               mode="exp_range", gamma=0.95),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=0.001),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=0.5, total_steps=20),
    "OneCycleLR_three_phase_linear": lambda o: L.OneCycleLR(o, max_lr=0.5, total_steps=20, three_phase=True,
                                                            anneal_strategy="linear"),
}

TOTAL, CUT = 16, 7
METRICS = [1.0, 0.9, 0.9, 0.9, 0.9, 0.8, 0.8, 0.8, 0.8, 0.8, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7]


def _scheduler_classes() -> list[str]:
    return sorted(n for n, c in vars(L).items()
                  if inspect.isclass(c) and issubclass(c, L.LRScheduler) and c.__module__ == L.__name__
                  and not n.startswith("_") and n != "LRScheduler")


def test_every_scheduler_class_is_covered():
    missing = [n for n in _scheduler_classes() if n not in SCHEDULERS]
    assert not missing, f"torch.optim.lr_scheduler has classes this test does not construct: {missing}"


def _fresh(name: str):
    groups = [{"params": [torch.nn.Parameter(torch.ones(3))]},
              {"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.05}]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return opt, SCHEDULERS[name](opt)


def _advance(opt, sched, steps: range) -> list[list[float]]:
    seen = []
    for i in steps:
        opt.step()  # no gradients: parameters stay, but the order step()/sched.step() is the real one
        if isinstance(sched, L.ReduceLROnPlateau):
            sched.step(METRICS[i])
        else:
            sched.step()
        seen.append([g["lr"] for g in opt.param_groups] + [g.get("momentum") for g in opt.param_groups])
    return seen


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_resume_continues_identically(tmp_path, name):
    opt, sched = _fresh(name)
    uninterrupted = _advance(opt, sched, range(TOTAL))

    opt, sched = _fresh(name)
    before = _advance(opt, sched, range(CUT))
    sd = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": CUT}
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(CUT, sd)
    with Checkpointer(str(tmp_path), threads=2) as ck:
        restored = ck.restore()
    # the scheduler's state_dict comes back with its exact types (a Counter stays a Counter ...)
    type_diffs = differences(sd, restored)

    opt2, sched2 = _fresh(name)  # a new process would build these the same way
    opt2.load_state_dict(restored["optimizer"])
    sched2.load_state_dict(restored["scheduler"])
    after = _advance(opt2, sched2, range(CUT, TOTAL))
    problems = [f"restored state differs: {d}" for d in type_diffs]
    if before + after != uninterrupted:
        problems.append(f"learning rates/momenta after resume differ:\n    uninterrupted {uninterrupted[CUT:]}\n"
                        f"    resumed       {after}")
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


def test_lambda_lr_state_dict_drops_plain_functions(tmp_path):
    """Documents what LambdaLR saves: None for a function/lambda, the __dict__ of a callable object."""
    opt, sched = _fresh("LambdaLR")
    assert sched.state_dict()["lr_lambdas"] == [None, None]
    opt, sched = _fresh("LambdaLR_callable_object")
    _advance(opt, sched, range(3))
    saved = sched.state_dict()["lr_lambdas"]
    assert saved[0]["rate"] == 0.97 and saved[0]["calls"] > 0
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(1, sched.state_dict())
        got = ck.restore()
    opt2, sched2 = _fresh("LambdaLR_callable_object")
    sched2.load_state_dict(got)
    assert vars(sched2.lr_lambdas[0]) == vars(sched.lr_lambdas[0])


# --- (b) GradScaler ------------------------------------------------------------------------------

def _scaler(**kw):
    try:
        return torch.amp.GradScaler("cpu", **kw)
    except (TypeError, RuntimeError, AttributeError):  # pragma: no cover - older torch: CPU scaling absent
        pytest.skip("torch.amp.GradScaler('cpu') is not available in this torch")


def _scaler_run(steps: range, model, opt, scaler) -> list[float]:
    scales = []
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, generator=g) for _ in range(max(steps.stop, 1))]
    for i in steps:
        opt.zero_grad()
        scaler.scale(model(xs[i]).square().mean()).backward()
        if i in (2, 9):  # an overflow: the step is skipped and the scale backs off
            next(model.parameters()).grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _scaler_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler(init_scale=2.0 ** 8, growth_interval=3)
    assert scaler.is_enabled()
    return model, opt, scaler


def test_grad_scaler_state_roundtrip_and_resume(tmp_path):
    model, opt, scaler = _scaler_setup()
    ref_scales = _scaler_run(range(14), model, opt, scaler)
    ref = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}

    model, opt, scaler = _scaler_setup()
    first = _scaler_run(range(6), model, opt, scaler)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()}
    assert type(state["scaler"]["scale"]) is float and type(state["scaler"]["_growth_tracker"]) is int
    with Checkpointer(str(tmp_path), threads=2) as ck:
        ck.save(6, state)
    model2, opt2, scaler2 = _scaler_setup()
    with Checkpointer(str(tmp_path), threads=2) as ck:
        got = ck.restore(into={"model": model2.state_dict(), "optimizer": opt2.state_dict(), "scaler": {}})
    assert_same_state(state["scaler"], got["scaler"])
    opt2.load_state_dict(got["optimizer"])
    scaler2.load_state_dict(got["scaler"])
    rest = _scaler_run(range(6, 14), model2, opt2, scaler2)
    assert first + rest == ref_scales
    assert_same_state(ref, {"model": model2.state_dict(), "optimizer": opt2.state_dict(), "scaler": scaler2.state_dict()})


# --- (c) a run killed with SIGKILL, resumed in a fresh process -------------------------------------

N_STEPS, EVERY = 40, 5


def _build():
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = L.StepLR(opt, step_size=7, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=4)
    return model, opt, sched, scaler


def _train_step(step: int, model, opt, sched, scaler) -> None:
    # data, noise, sampling and dropout all draw from the global RNGs: a resume must restore them
    x = torch.randn(16, 8)
    noise = torch.from_numpy(np.random.standard_normal((16, 4)).astype(np.float32))
    idx = random.sample(range(16), 12)
    y = x[:, :4] * 2 + noise
    loss = (model(x[idx]) - y[idx]).square().mean()
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    if step % 11 == 4:  # a deterministic overflow: scaler skips the step and backs off
        model[0].weight.grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    sched.step()


def _full_state(step: int, model, opt, sched, scaler) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "scaler": scaler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "step": step}


def worker_main(store: str, final: str, resume: bool, sleep_s: float) -> None:
    """One training process (run by the test in a subprocess). A resuming one is started early
    (imports take seconds) and waits for a line on stdin before it looks at the store."""
    torch.set_num_threads(1)
    model, opt, sched, scaler = _build()
    start = 0
    if resume:
        sys.stdin.readline()
    ck = Checkpointer(store, threads=2)
    if resume:
        dest = _full_state(0, model, opt, sched, scaler)
        got = ck.restore(into=dest)
        assert all(got["model"][k] is dest["model"][k] for k in dest["model"]), "restore(into=) replaced tensors"
        opt.load_state_dict(got["optimizer"])
        sched.load_state_dict(got["scheduler"])
        scaler.load_state_dict(got["scaler"])
        torch.set_rng_state(got["rng"]["torch"])
        np.random.set_state(got["rng"]["numpy"])
        random.setstate(got["rng"]["python"])
        start = got["step"]
        print(f"RESUMED {start}", flush=True)
    pending = None
    for step in range(start + 1, N_STEPS + 1):
        model.train()
        _train_step(step, model, opt, sched, scaler)
        if step % EVERY == 0:
            if pending is not None:
                pending.result()
            pending = ck.save_async(step, _full_state(step, model, opt, sched, scaler))
        if sleep_s:
            time.sleep(sleep_s)
    if pending is not None:
        pending.result()
    ck.close()
    torch.save(_full_state(N_STEPS, model, opt, sched, scaler), final)
    print("DONE", flush=True)


WORKER = """
import sys
sys.path.insert(0, sys.argv[1])
import test_training_resume as m
m.worker_main(sys.argv[2], sys.argv[3], sys.argv[4] == "1", float(sys.argv[5]))
"""


def _spawn(store: str, final: str, resume: bool, sleep_s: float) -> subprocess.Popen:
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-W", "ignore", "-c", WORKER, here, store, final, "1" if resume else "0",
                             str(sleep_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def test_sigkill_then_resume_is_bit_identical(tmp_path):
    ref_store, run_store = str(tmp_path / "ref"), str(tmp_path / "run")
    victim = _spawn(run_store, str(tmp_path / "never.pt"), False, 0.1)
    resumed = _spawn(run_store, str(tmp_path / "resumed.pt"), True, 0.0)  # imports now, waits for stdin
    try:
        # the uninterrupted reference run, here, while the children start (same code, one thread too)
        threads, rngs = torch.get_num_threads(), (torch.get_rng_state(), np.random.get_state(), random.getstate())
        try:
            worker_main(ref_store, str(tmp_path / "ref.pt"), False, 0.0)
        finally:
            torch.set_num_threads(threads)
            torch.set_rng_state(rngs[0])
            np.random.set_state(rngs[1])
            random.setstate(rngs[2])
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and victim.poll() is None:
            if os.path.isdir(os.path.join(run_store, "manifests")):
                with Checkpointer(run_store, threads=1) as watcher:
                    if watcher.steps():
                        break
            time.sleep(0.05)
        time.sleep(0.3)  # land somewhere in the middle of training (maybe inside a save)
        assert victim.poll() is None, "the run ended before it could be killed: make sleep_s larger"
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
        assert victim.returncode == -signal.SIGKILL
        with Checkpointer(run_store, threads=1) as ck:
            committed = ck.steps()
        assert committed and committed[-1] < N_STEPS and not os.path.exists(tmp_path / "never.pt")

        out, err = resumed.communicate("go\n", timeout=120)
        assert resumed.returncode == 0, f"the resumed run failed (rc {resumed.returncode}):\n{err[-3000:]}"
        assert f"RESUMED {committed[-1]}" in out, out
    finally:
        for proc in (victim, resumed):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    want = torch.load(tmp_path / "ref.pt", weights_only=False)
    got = torch.load(tmp_path / "resumed.pt", weights_only=False)
    diffs = differences(want, got)
    assert not diffs, "resumed run is not bit-identical to the uninterrupted one:\n  " + "\n  ".join(diffs)

    # every checkpoint both runs committed holds the same logical state (same digest)
    with Checkpointer(ref_store, threads=2) as ref_ck, Checkpointer(run_store, threads=2) as run_ck:
        assert ref_ck.steps() == list(range(EVERY, N_STEPS + 1, EVERY))
        for s in run_ck.steps():
            assert run_ck.manifest(s).digest == ref_ck.manifest(s).digest, f"step {s} digests differ"
        assert run_ck.verify() == []
