"""The workloads' contract: learning, determinism, resume bit for bit, shard data, sparsity, errors.

Small sizes only; the whole file runs in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

# (workloads.base, not workloads: an editable install made before workloads/__init__.py existed
# maps `workloads` as a namespace package, whose __init__ never runs; the submodule works either way)
from workloads.base import BUILTIN_WORKLOADS, WorkloadConfig, build_workload, clone_state, describe, state_nbytes

BUILTINS = ["tinylm", "recsys", "finetune", "finetune-bf16", "dense-lm"]
EXAMPLE = "workloads.example_user:build"
ALL = BUILTINS + [EXAMPLE]
N = 3  # steps per half in the determinism / resume tests

# mean(last 5 losses) must be below mean(first 5) * (1 - margin) after LEARN_STEPS steps
LEARN_STEPS = 40
MARGINS = {"tinylm": 0.25, "recsys": 0.05, "finetune": 0.25, "finetune-bf16": 0.05, "dense-lm": 0.2, EXAMPLE: 0.25}


def build(name: str, shard: int = 0, num_shards: int = 1, **kw):
    return build_workload(WorkloadConfig(name, **kw), shard=shard, num_shards=num_shards)


def assert_same(a, b, path: str = "") -> None:
    """Every tensor equal (dtype, shape, bits) and every other value equal, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"tensor differs at {path}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"keys differ at {path}: {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"value differs at {path}: {a!r} != {b!r}"


def assert_storable(state, path: str = "") -> None:
    """Only what ckptlib.tree stores: containers with str/int keys, tensors, JSON scalars."""
    if isinstance(state, dict):
        for k, v in state.items():
            assert isinstance(k, (str, int)), f"key {k!r} at {path}"
            assert_storable(v, f"{path}/{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            assert_storable(v, f"{path}/{i}")
    else:
        assert state is None or isinstance(state, (torch.Tensor, bool, int, float, str)), \
            f"{type(state).__name__} at {path}"


def run(wl, steps: int) -> list[float]:
    return [wl.train_step() for _ in range(steps)]


# --- learning -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_loss_decreases(name):
    wl = build(name)
    before = wl.evaluate()
    losses = run(wl, LEARN_STEPS)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert all(math.isfinite(x) for x in losses)
    assert last < first * (1 - MARGINS[name]), f"{name}: first 5 mean {first:.4f}, last 5 mean {last:.4f}"
    assert wl.evaluate() < before
    assert wl.data_position == LEARN_STEPS


# --- determinism and resume -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_same_config_same_bits(name):
    a, b = build(name, seed=3), build(name, seed=3)
    assert_same(a.state_dict(), b.state_dict())
    assert run(a, N) == run(b, N)
    assert_same(a.checkpoint_state(), b.checkpoint_state())
    assert a.evaluate() == b.evaluate()


@pytest.mark.parametrize("name", ALL)
def test_resume_is_bit_identical(name):
    straight = build(name)
    straight_losses = run(straight, 2 * N)

    first = build(name)
    run(first, N)
    resumed = build(name)
    resumed.load_state_dict(first.state_dict())  # not a copy: load must copy, first keeps training
    assert resumed.data_position == N
    first_losses = run(first, N)
    resumed_losses = run(resumed, N)

    assert resumed_losses == straight_losses[N:] == first_losses
    assert_same(resumed.state_dict(), straight.state_dict())
    assert_same(first.state_dict(), straight.state_dict())


@pytest.mark.parametrize("name", BUILTINS)
def test_resume_from_checkpoint_state_and_clone(name):
    a = build(name)
    run(a, N)
    saved = clone_state(a.checkpoint_state())
    run(a, N)
    b = build(name)
    b.load_state_dict(saved)
    run(b, N)
    assert_same(b.checkpoint_state(), a.checkpoint_state())


@pytest.mark.parametrize("name", BUILTINS)
def test_seed_changes_init(name):
    a, b = build(name, seed=0), build(name, seed=1)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert any(not torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", ALL)
def test_shards_share_init_but_not_data(name):
    s0, s1 = build(name, shard=0, num_shards=2), build(name, shard=1, num_shards=2)
    assert_same(s0.state_dict(), s1.state_dict())
    assert s0.evaluate() == s1.evaluate()  # the held-out batch is the same for every shard
    assert s0.train_step() != s1.train_step()
    m0, m1 = s0.model.state_dict(), s1.model.state_dict()
    assert any(not torch.equal(m0[k], m1[k]) for k in m0)
    # shard 1 of 2 reads the same data as shard 1 of 4: data depends on (seed, shard, position)
    other = build(name, shard=1, num_shards=4)
    assert other.train_step() == build(name, shard=1, num_shards=2).train_step()


def test_build_in_threads_matches_sequential():
    names = ["tinylm", "recsys", "finetune"]

    def job(i, out):
        wl = build(names[i % 3], shard=i // 3, num_shards=2)
        run(wl, 2)
        out[i] = wl.state_dict()

    threaded: dict = {}
    threads = [threading.Thread(target=job, args=(i, threaded)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    sequential: dict = {}
    for i in range(6):
        job(i, sequential)
    for i in range(6):
        assert_same(threaded[i], sequential[i])


def test_global_rng_untouched():
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    for name in BUILTINS:  # (the example builds its layers the plain way, which draws from it)
        wl = build(name)
        run(wl, 1)
        wl.evaluate()
    assert torch.equal(before, torch.get_rng_state())


# --- state contents -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BUILTINS)
def test_state_is_complete_and_storable(name):
    wl = build(name)
    run(wl, 1)
    state = wl.checkpoint_state()
    assert {"model", "optimizer", "scheduler", "data_position"} <= set(state)
    assert state["data_position"] == 1
    assert_storable(state)
    json.dumps(WorkloadConfig(name, extra={}).to_dict())
    info = describe(wl)
    assert info["params"] == sum(p.numel() for p in wl.model.parameters())
    assert info["state_bytes"] == state_nbytes(state) > info["param_bytes"]
    assert info["optimizer_state_ready"]
    # every trainable parameter has its Adam moments in the state
    n_trainable = sum(1 for p in wl.model.parameters() if p.requires_grad)
    assert len(state["optimizer"]["state"]) == n_trainable
    for s in state["optimizer"]["state"].values():
        assert (s["exp_avg_sq"] >= 0).all()


def test_recsys_updates_few_rows_and_leaves_the_rest_bit_identical():
    wl = build("recsys")
    run(wl, 1)  # creates the SparseAdam moments
    before = clone_state(wl.state_dict())
    run(wl, 10)
    after = wl.state_dict()
    opt_before, opt_after = before["optimizer"]["state"], after["optimizer"]["state"]
    for pid, table in enumerate(["user.weight", "item.weight"]):  # SparseAdam's params come first
        rows = (before["model"][table] != after["model"][table]).any(dim=1)
        frac = rows.float().mean().item()
        print(f"recsys {table}: {frac:.2%} of rows changed in 10 steps")
        assert 0 < frac < 0.20
        for key in ("exp_avg", "exp_avg_sq"):
            moved = (opt_before[pid][key] != opt_after[pid][key]).any(dim=1)
            assert not (moved & ~rows).any(), f"{key} changed on rows whose weights did not"
            assert torch.equal(opt_before[pid][key][~moved], opt_after[pid][key][~moved])


def test_finetune_backbone_frozen():
    wl = build("finetune")
    frozen = {n: p.detach().clone() for n, p in wl.model.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in wl.model.named_parameters() if p.requires_grad}
    assert sum(t.numel() for t in frozen.values()) > 10 * sum(t.numel() for t in trainable.values())
    run(wl, 5)
    now = wl.state_dict()["model"]
    for n, t in frozen.items():
        assert torch.equal(now[n], t), f"frozen {n} changed"
    assert all(not torch.equal(now[n], t) for n, t in trainable.items() if "lora_a" not in n)
    assert all(".lora_" in n or n.startswith("head.") for n in trainable)


def test_finetune_bf16_publishes_bf16_weights_and_few_change():
    wl = build("finetune-bf16")
    prev = wl.checkpoint_state()["weights_bf16"]
    fractions = []
    for _ in range(5):
        wl.train_step()
        state = wl.checkpoint_state()
        cur = state["weights_bf16"]
        for name, p in wl.model.named_parameters():
            assert cur[name].dtype == torch.bfloat16 and torch.equal(cur[name], p.detach().to(torch.bfloat16))
        changed = sum(int((cur[k].view(torch.int16) != prev[k].view(torch.int16)).sum()) for k in cur)
        fractions.append(changed / sum(t.numel() for t in cur.values()))
        prev = cur
    print("finetune-bf16: fraction of bf16 weights changed per step:", [f"{f:.1%}" for f in fractions])
    assert all(0.01 < f < 0.5 for f in fractions)
    assert wl.optimizer.param_groups[0]["lr"] == 1e-5
    assert state["model"]["inp.weight"].dtype == torch.float32  # fp32 master weights


# --- configuration and names ----------------------------------------------------------------------

def test_config_round_trips_through_json():
    cfg = WorkloadConfig("tinylm", seed=7, batch_size=4, lr=1e-3, size="small", extra={"n_layers": 1})
    back = WorkloadConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg
    wl = build_workload(back)
    assert wl.batch_size == 4 and wl.hparams["n_layers"] == 1 and len(wl.model.blocks) == 1


def test_bad_name_lists_builtins():
    with pytest.raises(ValueError) as e:
        build("no-such-workload")
    msg = str(e.value)
    assert all(n in msg for n in BUILTIN_WORKLOADS) and "module:factory" in msg


def test_bad_module_names_module_and_fix():
    with pytest.raises(ImportError) as e:
        build("no_such_pkg.mod:build")
    assert "no_such_pkg.mod" in str(e.value) and "PYTHONPATH" in str(e.value)
    with pytest.raises(ValueError, match="no callable 'nope'"):
        build("workloads.example_user:nope")
    with pytest.raises(TypeError, match="lacks"):
        build("builtins:slice")  # a callable that takes (config, shard, num_shards) but is no workload


def test_bad_config_values():
    with pytest.raises(ValueError, match="size"):
        WorkloadConfig("tinylm", size="huge")
    with pytest.raises(ValueError, match="unknown extra key"):
        build("recsys", extra={"n_userz": 10})
    with pytest.raises(ValueError, match="shard"):
        build("tinylm", shard=2, num_shards=2)


def test_module_factory_loads_example_user():
    wl = build(EXAMPLE, seed=1)
    assert type(wl).__module__ == "workloads.example_user"
    run(wl, 2)
    assert wl.data_position == 2


@pytest.mark.parametrize("name", BUILTINS)
def test_bench_size_builds_and_steps(name):
    wl = build(name, size="bench")
    assert math.isfinite(wl.train_step())
    info = describe(wl)
    assert info["state_bytes"] > 30e6 and info["params"] > 3e6
