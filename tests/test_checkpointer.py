"""Checkpointer behaviour on real stores: round trips, increments, commit rules, async, GC."""

import os
import random
import threading
import uuid

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptlib import (CheckpointError, Checkpointer, CommitConflict, CorruptCheckpoint, NoCheckpoint, RetentionPolicy,
                     UnsupportedState)
from ckptlib.store import Store, WrapperStore


def assert_same(a, b, path="state"):
    """Bit-exact equality of nested states: types, dtypes, shapes and bytes."""
    if not (isinstance(a, dict) and isinstance(b, dict)):  # an OrderedDict restores as a dict
        assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.cpu().contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8)) if a.numel() else True, path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def small_model_state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    for _ in range(3):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def full_state(model, opt, sched):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
            "step": 3, "note": "hi", "flags": [True, None, 1.5, float("nan"), float("-inf")], "t": (1, "a")}


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    return str(tmp_path / "ck") if request.param == "local" else f"memory://ck-{uuid.uuid4().hex}"


def test_model_optimizer_rng_round_trip(url):
    model, opt, sched = small_model_state()
    state = full_state(model, opt, sched)
    with Checkpointer(url) as ck:
        info = ck.save(10, state)
        assert info.committed and info.step == 10 and len(info.digest) == 32
        assert info.logical_bytes > 0 and info.bytes_written > 0
        assert ck.steps() == [10]
    restored = Checkpointer(url).restore()
    assert_same(state, restored)
    # what restores can be loaded back into the live objects
    model2, opt2, sched2 = small_model_state(seed=1)
    model2.load_state_dict(restored["model"])
    opt2.load_state_dict(restored["optimizer"])
    sched2.load_state_dict(restored["scheduler"])
    assert_same(model.state_dict(), model2.state_dict())


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.int16]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 40), min_size=0, max_size=3),
       chunk=st.sampled_from([4096, 8192, 1 << 20]), seed=st.integers(0, 1000))
def test_any_dtype_shape_chunking_round_trip(tmp_path_factory, dtype, shape, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1  # other byte values are not valid bools
    t = raw.view(dtype).reshape(shape)
    state = {"t": t, "nc": t.t() if t.dim() == 2 else t, "np": np.arange(7, dtype=np.int16), "s": np.float32(2.5)}
    url = str(tmp_path_factory.mktemp("h"))
    with Checkpointer(url, chunk_bytes=chunk) as ck:
        a = ck.save(1, state)
        t2 = t.clone()
        if t2.numel():
            t2.view(-1).view(torch.uint8)[0] ^= 1
        b = ck.save(2, {**state, "t": t2})
        assert a.digest != b.digest or t.numel() == 0
        assert_same(state, ck.restore(1))
        assert_same({**state, "t": t2}, Checkpointer(url, chunk_bytes=chunk).restore(2))


def test_digest_independent_of_chunking_and_encoding(tmp_path):
    state = {"w": torch.randn(300_000), "b": torch.arange(10)}
    a = Checkpointer(str(tmp_path / "a"), chunk_bytes=4096, zstd_level=1).save(1, state)
    b = Checkpointer(str(tmp_path / "b"), chunk_bytes=1 << 22, zstd_level=9).save(1, state)
    assert a.digest == b.digest
    c = Checkpointer(str(tmp_path / "c")).save(1, {"w": state["w"].clone(), "b": state["b"].clone()})
    assert c.digest == a.digest


def test_a_state_of_64_mib_or_more_is_saved_in_4_mib_chunks(tmp_path):
    """The automatic chunk size (decision 60): about 1/32 of a smaller state, 4 MiB from 64 MiB up
    (finetune's 99 MiB stream is 3% smaller than in 2 MiB chunks at no cost in memory)."""
    for name, state, chunk in (("big", {"w": torch.zeros(64 << 18), "b": torch.zeros(9 << 20, dtype=torch.bfloat16)},
                                4 << 20),  # 82 MiB
                               ("mid", {"w": torch.zeros(18 << 20, dtype=torch.bfloat16)}, 1 << 20)):  # 36 MiB
        with Checkpointer(str(tmp_path / name)) as ck:
            ck.save(1, state)
            (part,) = ck.manifest(1).parts
            assert ck.fragment(1, part).chunk_bytes == chunk, name


def test_incremental_unchanged_and_sparse_changes(tmp_path):
    emb = torch.randn(200_000, 16)
    frozen = torch.randn(500_000)
    with Checkpointer(str(tmp_path), chunk_bytes=1 << 20) as ck:
        first = ck.save(0, {"emb": emb, "frozen": frozen})
        assert first.kind == "keyframe"
        emb[torch.randint(0, 200_000, (300,))] += 0.01  # a few rows change
        second = ck.save(1, {"emb": emb, "frozen": frozen})
        assert second.kind == "delta"
        assert second.chunks["unchanged"] >= 2  # frozen tensor's chunks referenced, not rewritten
        assert second.bytes_written * 20 < second.logical_bytes
        third = ck.save(2, {"emb": emb, "frozen": frozen})  # nothing changed at all
        assert third.bytes_written == 0 and third.chunks["unchanged"] == sum(second.chunks.values())
        assert_same({"emb": emb, "frozen": frozen}, Checkpointer(str(tmp_path)).restore(2))


def test_keyframe_every_bounds_delta_chains(tmp_path):
    x = torch.randn(100_000)
    with Checkpointer(str(tmp_path), keyframe_every=3, chunk_bytes=1 << 16) as ck:
        for step in range(8):
            x[step * 10] += 1.0  # every chunk but one unchanged; chunk 0 changes each step
            ck.save(step, {"x": x})
        for step in range(8):
            m = ck.manifest(step)
            assert max(b.depth for b in ck.fragment(step, "state").blobs.values()) <= 2
        assert_same({"x": x}, Checkpointer(str(tmp_path)).restore())


def test_delta_budget_ends_a_chain_once_its_deltas_add_up_to_the_budget(tmp_path):
    """Each save changes 5% of the elements: a sparse delta of about a tenth of a keyframe. Without
    a budget the chain runs to keyframe_every; with a budget of 0.3 keyframes it ends after a few."""
    gen = torch.Generator().manual_seed(0)
    series, x = [], torch.randn(1 << 18, generator=gen)
    for _ in range(12):
        x = x.clone()
        idx = torch.randint(0, x.numel(), (x.numel() // 20,), generator=gen)
        x[idx] += torch.randn(idx.numel(), generator=gen)
        series.append(x)

    def depths(budget):
        with Checkpointer(str(tmp_path / str(budget)), keyframe_every=32, delta_budget=budget) as ck:
            infos = [ck.save(step, {"x": t}) for step, t in enumerate(series)]
            blobs = ck.fragment(len(series) - 1, "state").blobs
            assert_same({"x": series[-1]}, Checkpointer(str(tmp_path / str(budget))).restore())
            return [i.kind for i in infos], max(b.depth for b in blobs.values()), blobs

    kinds, depth, _ = depths(None)
    assert kinds == ["keyframe"] + ["delta"] * 11 and depth == 11
    kinds, depth, blobs = depths(0.3)
    assert "keyframe" in kinds[1:] and depth < 11
    for blob in blobs.values():  # every chain in the table keeps within the budget
        chain, b = 0, blob
        while b.base is not None:
            chain += b.size
            b = blobs[b.base]
        assert chain <= 0.3 * b.size
    with pytest.raises(ValueError, match="delta_budget must be > 0"):
        Checkpointer(str(tmp_path / "bad"), delta_budget=0)


def test_chains_that_start_together_do_not_all_end_at_the_same_save(tmp_path):
    """16 chunks change a little at every save: with keyframe_every=8 their keyframes are spread over
    two saves instead of re-uploading the whole tensor at one."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16 << 14, generator=gen)  # 16 chunks of 64 KiB
    with Checkpointer(str(tmp_path), chunk_bytes=1 << 16, keyframe_every=8, delta_budget=None) as ck:
        keyframes = []
        for step in range(12):
            x = x.clone()
            x[torch.randint(0, x.numel(), (200,), generator=gen)] += 1.0
            keyframes.append(ck.save(step, {"x": x}).chunks["keyframe"])
        assert keyframes[0] == 16 and sum(keyframes[1:]) == 16  # each chunk's chain restarted once
        assert max(keyframes[1:]) <= 8
        assert max(b.depth for b in ck.fragment(11, "state").blobs.values()) <= 7


def test_a_follower_decodes_only_what_changed_since_the_step_it_holds(tmp_path):
    """Restore step 2 keeping its bytes, then delete every object step 2 needs: step 3 still
    restores in the follower (its chains stop at chunks it holds), not in a fresh reader."""
    gen = torch.Generator().manual_seed(1)
    x, frozen = torch.randn(1 << 18, generator=gen), torch.randn(1 << 17, generator=gen)
    states = []
    with Checkpointer(str(tmp_path), chunk_bytes=1 << 16) as ck:
        for step in range(4):
            x = x.clone()
            x[torch.randint(0, x.numel(), (500,), generator=gen)] += 1.0
            states.append({"x": x, "frozen": frozen})
            ck.save(step, states[-1])
    follower = Checkpointer(str(tmp_path))
    assert_same(states[2], follower.restore(2, keep_base=True))
    store = follower.store
    for blob in follower.fragment(2, "state").blobs.values():
        store.delete(blob.key)
    assert_same(states[3], follower.restore(3))
    with pytest.raises(CorruptCheckpoint, match="missing"):
        Checkpointer(str(tmp_path)).restore(3)
    follower.close()


def test_same_step_same_state_is_noop_different_is_error(url):
    state = {"x": torch.arange(100.0)}
    with Checkpointer(url) as ck:
        first = ck.save(5, state)
    again = Checkpointer(url).save(5, state)
    assert not again.committed and again.digest == first.digest and again.bytes_written == 0
    with pytest.raises(CommitConflict, match="already committed"):
        Checkpointer(url).save(5, {"x": torch.arange(100.0) + 1})
    assert_same(state, Checkpointer(url).restore(5))


def test_concurrent_savers_of_one_step_commit_once(tmp_path):
    url = str(tmp_path)
    states = [{"x": torch.full((50_000,), float(i))} for i in range(6)]
    results, errors = [], []

    def run(i):
        try:
            results.append((i, Checkpointer(url).save(1, states[i])))
        except CommitConflict as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, info in results if info.committed]
    assert len(winners) == 1 and len(errors) == 5
    assert_same(states[winners[0]], Checkpointer(url).restore(1))


def test_save_async_snapshots_before_returning(url):
    x = torch.zeros(2_000_000)
    with Checkpointer(url) as ck:
        fut = ck.save_async(1, {"x": x})
        x.add_(1.0)  # the caller changes the tensor right away
        info = fut.result()
        assert info.blocked_s <= info.durable_s
        fut2 = ck.save_async(2, {"x": x})
        x.add_(1.0)
        fut2.result()
        assert torch.equal(ck.restore(1)["x"], torch.zeros(2_000_000))
        assert torch.equal(ck.restore(2)["x"], torch.ones(2_000_000))


def test_a_background_error_taken_from_its_future_is_not_raised_again(url):
    with Checkpointer(url) as ck:
        ck.save(3, {"x": torch.ones(10)})
        fut = ck.save_async(3, {"x": torch.zeros(10)})  # conflicts with the committed step 3
        with pytest.raises(CommitConflict):
            fut.result()
        ck.save(4, {"x": torch.ones(10)})  # reported once: the next call just works
        assert ck.steps() == [3, 4]
        assert_same({"x": torch.ones(10)}, ck.restore(4))


def test_a_background_error_nobody_took_is_raised_once_by_the_next_call(url):
    with Checkpointer(url) as ck:
        ck.save(3, {"x": torch.ones(10)})
        ck.save_async(3, {"x": torch.zeros(10)})  # its future is dropped
        with pytest.raises(CheckpointError, match="background save of step 3 failed"):
            ck.save(4, {"x": torch.ones(10)})
        assert ck.steps() == [3]  # the call that reported it did nothing else
        ck.save(4, {"x": torch.ones(10)})
        assert ck.steps() == [3, 4]


def test_a_failed_save_raises_once_and_its_retry_succeeds(url):
    ck = Checkpointer(url)
    ck.save(3, {"x": torch.ones(10)})
    with pytest.raises(CommitConflict):
        ck.save(3, {"x": torch.zeros(10)})
    ck.save(4, {"x": torch.full((10,), 4.0)})  # not "the previous save failed"
    assert_same({"x": torch.full((10,), 4.0)}, ck.restore(4))
    assert_same({"x": torch.ones(10)}, ck.restore(3))
    ck.close()
    ck.close()  # idempotent; nothing left to report
    with pytest.raises(CheckpointError, match="closed"):
        ck.save(5, {"x": torch.ones(10)})


def test_unsupported_state_is_refused_with_path(url):
    with pytest.raises(UnsupportedState, match="model/extra"):
        Checkpointer(url).save(1, {"model": {"extra": object()}})
    with pytest.raises(UnsupportedState, match="layout"):
        Checkpointer(url).save(1, {"s": torch.eye(3).to_sparse()})
    with pytest.raises(UnsupportedState, match="object"):
        Checkpointer(url).save(1, {"a": np.array([object()])})
    assert Checkpointer(url).steps() == []


def test_restore_errors_name_the_problem(url):
    with pytest.raises(NoCheckpoint, match="no committed checkpoint"):
        Checkpointer(url).restore()
    Checkpointer(url).save(1, {"x": torch.ones(3)})
    with pytest.raises(NoCheckpoint, match="step 7 is not committed"):
        Checkpointer(url).restore(7)
    with pytest.raises(NoCheckpoint, match="healthy"):
        Checkpointer(url).restore(healthy=True)


def test_gc_keeps_what_kept_checkpoints_need(tmp_path):
    url = str(tmp_path)
    x = torch.randn(300_000)
    with Checkpointer(url, keyframe_every=4, chunk_bytes=1 << 16) as ck:
        states = {}
        for step in range(10):
            x[: 1000 * (step + 1)] += 0.5
            ck.save(step, {"x": x})
            states[step] = x.clone()
        report = ck.gc(RetentionPolicy(keep_last=2, keep_every=4), grace_s=0)
        assert report.kept_steps == [0, 4, 8, 9] and report.dropped_steps == [1, 2, 3, 5, 6, 7]
        assert report.deleted_objects and report.freed_bytes > 0
        assert ck.steps() == [0, 4, 8, 9]
        for step in ck.steps():
            assert not ck.verify(step)
            assert torch.equal(Checkpointer(url).restore(step)["x"], states[step])
        # the writer still has its base: the next save is a delta on top of what GC kept
        x[:10] += 1
        info = ck.save(10, {"x": x})
        assert info.kind == "delta"
        assert torch.equal(Checkpointer(url).restore(10)["x"], x)
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        RetentionPolicy(keep_last=0)


def test_gc_memory_is_the_union_of_marks_not_one_set_per_step(tmp_path, monkeypatch):
    """GC over many steps that share most objects (here 256 unchanged tensors) holds the distinct
    keys once, not one set per committed step (a run with 10,000 checkpoints): its peak memory over
    120 steps is that over 30 (the manifests being read at once), not 4x the marks.

    Manifests are read one at a time here: with 16 readers the peak is how many of them happen to
    be parsing at once (6-11 MiB from run to run on a loaded machine), which hides the ~2 MiB this
    test is about."""
    import tracemalloc

    import ckptlib.gc

    monkeypatch.setattr(ckptlib.gc, "_MARK_THREADS", 1)

    def gc_peak(ck: Checkpointer, policy: RetentionPolicy, dry_run: bool = True) -> float:
        tracemalloc.start()
        try:
            ck.gc(policy, grace_s=0, dry_run=dry_run)
            return tracemalloc.get_traced_memory()[1] / 2**20
        finally:
            tracemalloc.stop()

    frozen = {f"t{i}": torch.full((4,), float(i)) for i in range(256)}
    with Checkpointer(str(tmp_path), chunk_bytes=4096) as ck:
        for step in range(120):
            ck.save(step, {**frozen, "w": torch.full((4,), float(step))})
        many = gc_peak(ck, RetentionPolicy(keep_last=10))
        ck.gc(RetentionPolicy(keep_last=30), grace_s=0)
        assert len(ck.steps()) == 30
        few = gc_peak(ck, RetentionPolicy(keep_last=10))
    # one set per step: ~22 KiB a step, +2 MiB over the 90 more steps; folded: the same peak
    assert many - few < 1.0, f"GC peak {many:.1f} MiB over 120 steps, {few:.1f} MiB over 30"


def test_gc_dry_run_deletes_nothing_and_grace_protects_fresh_chunks(tmp_path):
    url = str(tmp_path)
    with Checkpointer(url) as ck:
        for step in range(4):
            ck.save(step, {"x": torch.randn(10_000)})
        before = sorted(ck.store.list(""))
        dry = ck.gc(RetentionPolicy(keep_last=1), grace_s=0, dry_run=True)
        assert dry.deleted_objects and sorted(ck.store.list("")) == before
        fresh = ck.gc(RetentionPolicy(keep_last=1), grace_s=3600)
        assert ck.steps() == [3]
        assert not any(k.startswith("chunks/") for k in fresh.deleted_objects)  # all younger than grace


def test_fresh_writer_references_unchanged_chunks_of_the_latest_commit(tmp_path):
    state = {"frozen": torch.randn(1_000_000), "head": torch.randn(1000)}
    Checkpointer(str(tmp_path), chunk_bytes=1 << 20).save(1, state)
    state["head"] += 1
    info = Checkpointer(str(tmp_path), chunk_bytes=1 << 20).save(2, state)  # a new process, no restore
    assert info.chunks["unchanged"] == 4 and info.bytes_written < 10_000
    assert_same(state, Checkpointer(str(tmp_path)).restore(2))


def test_upload_bandwidth_limit_spreads_the_upload(tmp_path):
    import time

    from ckptlib.throttle import RateLimiter

    limiter = RateLimiter(1_000_000)  # 1 MB/s
    t0 = time.monotonic()
    waited = sum(limiter.acquire(250_000) for _ in range(8))  # 2 MB: ~1 s of burst, then ~1 s of waiting
    assert waited > 0.5 and time.monotonic() - t0 > 0.5
    state = {"x": torch.randn(200_000).numpy()}  # ~0.8 MB, incompressible-ish
    info = Checkpointer(str(tmp_path), max_upload_bytes_per_s=2_000_000).save(1, state)
    assert info.bytes_written > 500_000
    with pytest.raises(ValueError, match="max_upload_bytes_per_s"):
        RateLimiter(-1)


def test_dense_units_keep_no_base_bytes_and_snapshots_reuse_the_pool(tmp_path):
    """A state that changes everywhere (fresh random floats every save: no delta pays) is written
    as keyframes; once its first delta did not pay, the writer keeps no base bytes for it and each
    snapshot writes into the previous snapshot's buffers (pages already faulted in), so it holds
    one copy of the state. The chunk whose next save tries a delta again keeps its bytes, and the
    buffer of the one that tried last time goes back to the pool in its place, so no snapshot
    after the second allocates a buffer. A sparse tensor beside it keeps its base bytes (its deltas
    pay), and its snapshots patch the changes into them (no copy)."""
    gen = torch.Generator().manual_seed(3)
    sparse = torch.randn(1 << 16, generator=gen)
    with Checkpointer(str(tmp_path), chunk_bytes=1 << 16) as ck:
        addresses, infos, every = [], [], []
        for step in range(5):
            sparse = sparse.clone()
            sparse[torch.randint(0, sparse.numel(), (50,), generator=gen)] += 1.0
            dense = torch.randn(1 << 18, generator=gen)
            fut = ck.save_async(step, {"dense": dense, "sparse": sparse})
            infos.append(fut.result())
            pool = ck._bases.buffers("state")
            addresses.append(sorted(b.__array_interface__["data"][0] for bufs in pool._free.values() for b in bufs))
            held_now = ck._bases.held("state").raw.values()
            every.append(set(addresses[-1]) | {a.__array_interface__["data"][0] for a in held_now})
            assert pool.free_bytes <= (dense.numel() + sparse.numel()) * 4  # never more than a snapshot's worth
        base = ck._bases.held("state")
        dense_units = [u for u in base.units if u[1] == "/dense"]
        assert dense_units and all(base.hints[u].dense for u in dense_units)
        held = sum(a.nbytes for a in base.raw.values())
        # the sparse tensor's bytes, and one dense chunk of 16 (its next save tries a delta again)
        assert held == sparse.numel() * 4 + dense.numel() * 4 // 16
        assert infos[-1].chunks == {"delta": 4, "keyframe": 16, "unchanged": 0}
        # a buffer for every dense chunk, and from the third save on the same buffers: none allocated
        assert len(addresses[-1]) == 16 and pool.free_bytes == dense.numel() * 4
        assert every[2] == every[3] == every[4]
        assert_same({"dense": dense, "sparse": sparse}, Checkpointer(str(tmp_path)).restore())
        sparse_buffers = {base.raw[d].__array_interface__["data"][0] for u, d in base.units.items() if u[1] == "/sparse"}
        sparse = sparse.clone()
        sparse[7] += 1.0
        ck.save_async(5, {"dense": dense, "sparse": sparse}).result()
        after = ck._bases.held("state")
        assert sparse_buffers <= {b.__array_interface__["data"][0] for b in after.raw.values()}  # patched in place
        assert_same({"dense": dense, "sparse": sparse}, Checkpointer(str(tmp_path)).restore())


def test_a_frozen_unit_whose_base_bytes_are_dropped_leaves_its_buffer_to_the_pool(tmp_path):
    """A frozen weight (unchanged save after save) is compared with its base bytes, then, once
    found unchanged twice, keeps none (decision 42) and is copied at each save. Its old base
    buffer goes back to the pool in its place: the snapshot that first copies it reuses those
    pages, so no snapshot after the first allocates a buffer for it (before: each such unit
    faulted a fresh buffer in once, 96 MiB at once in finetune's fourth save)."""
    gen = torch.Generator().manual_seed(4)
    frozen = torch.randn(1 << 18, generator=gen)  # 16 chunks of 64 KiB
    allocated: list[int] = []
    import ckptlib.bases as bases_module

    real = bases_module.host_buffer

    def counting(nbytes: int, pinned: bool = False) -> np.ndarray:
        allocated.append(nbytes)
        return real(nbytes, pinned=pinned)

    with Checkpointer(str(tmp_path), chunk_bytes=1 << 16) as ck:
        bases_module.host_buffer = counting
        try:
            per_save = []
            for step in range(6):
                allocated.clear()
                fut = ck.save_async(step, {"frozen": frozen, "step": step})
                per_save.append(sum(allocated))
                fut.result()
        finally:
            bases_module.host_buffer = real
        base = ck._bases.held("state")
        assert not any(base.raw.get(d) is not None for u, d in base.units.items() if u[1] == "/frozen")
        assert per_save[0] == frozen.numel() * 4  # the first snapshot copies it into new buffers
        assert per_save[1:] == [0] * 5, per_save
        assert_same({"frozen": frozen, "step": 5}, Checkpointer(str(tmp_path)).restore())


def test_a_writer_whose_units_are_copied_each_save_holds_one_copy_of_the_state(tmp_path):
    """A unit whose sparse deltas pay but whose changes are too many to patch (a fifth of its
    elements) is copied into a new buffer at each save, which the new base keeps. The old base's
    buffer is then free, but the pool does not keep it: the base and the pool together hold one
    copy of the state, never a spare one (decision 44; ``reuse_buffers=True`` is the spare)."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(1 << 18, generator=gen)  # 16 chunks of 64 KiB
    with Checkpointer(str(tmp_path), chunk_bytes=1 << 16) as ck:
        for step in range(6):
            w = w.clone()
            w[torch.randperm(w.numel(), generator=gen)[: w.numel() // 5]] += 1.0
            info = ck.save_async(step, {"w": w}).result()
            base, pool = ck._bases.held("state"), ck._bases.buffers("state")
            held = sum(a.nbytes for a in base.raw.values())
            assert held + pool.free_bytes <= w.numel() * 4, (step, held, pool.free_bytes)
        assert info.chunks["delta"] == 16  # its deltas pay: the base holds every unit's bytes
        assert_same({"w": w}, Checkpointer(str(tmp_path)).restore())


def test_a_moderate_change_is_patched_in_place_and_a_large_one_copied(tmp_path):
    """5% of a tensor's elements change between saves (a hot embedding chunk, a bf16 copy of
    weights): the pool holds no buffer of its size (the base holds the last one), so a copy would
    fault in fresh pages, dearer than patching the base's buffer in place: the snapshot patches
    it. A change of 20% is copied. Either way the deltas are the objects a save in place (no
    snapshot) writes, and the restore is exact."""
    gen = torch.Generator().manual_seed(5)
    states, w = [], torch.randn(1 << 16, generator=gen)  # one 256 KiB chunk
    for share in (0, 20, 20, 5):  # 1/share of the elements change; 0: the first save
        w = w.clone()
        if share:
            w[torch.randperm(w.numel(), generator=gen)[: w.numel() // share]] += 1.0
        states.append({"w": w})
    with Checkpointer(str(tmp_path / "async"), chunk_bytes=1 << 18) as ck, \
            Checkpointer(str(tmp_path / "inplace"), chunk_bytes=1 << 18) as plain:
        patched = []
        for step, state in enumerate(states):
            before = {b.__array_interface__["data"][0] for b in ck._bases.held("state").raw.values()} if step else set()
            info = ck.save_async(step, state).result()
            plain.save(step, state)
            (after,) = ck._bases.held("state").raw.values()
            patched.append(before == {after.__array_interface__["data"][0]})
            assert info.chunks == ({"keyframe": 1, "delta": 0, "unchanged": 0} if step == 0
                                   else {"keyframe": 0, "delta": 1, "unchanged": 0}), (step, info.chunks)
            keys = [sorted(b.key for b in c.fragment(step, "state").blobs.values()) for c in (ck, plain)]
            assert keys[0] == keys[1], step
        assert patched == [False, True, True, False]  # 5%, 5% patched; 20% copied
        assert_same(states[-1], Checkpointer(ck.url).restore())


def _objects(root) -> int:
    return sum(len(files) for _, _, files in os.walk(os.path.join(root, "chunks")))


def _blocks(n: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)) for _ in range(n)])


class _Named(torch.nn.Module):  # torchvision-like names: conv1, bn1, layer1.0..., fc
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)
        self.layer1, self.layer2 = _blocks(12), _blocks(12)
        self.fc = torch.nn.Linear(8, 4)


@pytest.mark.parametrize("model", [_blocks, lambda n: _Named()], ids=["sequential", "named"])
def test_a_flat_state_dict_is_packed_like_a_nested_one(tmp_path, model):
    """save(step, model.state_dict()) (a flat dict of dotted names: the most common save) stored
    one object per tensor; its small leaves are packed by name prefix now, about bytes / chunk
    objects as {"model": sd} is, and a restore of one key still reads one object."""
    torch.manual_seed(0)
    sd = model(24).state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    with Checkpointer(str(tmp_path / "flat"), chunk_bytes=4096) as ck:
        ck.save(1, sd)
    with Checkpointer(str(tmp_path / "nested"), chunk_bytes=4096) as ck:
        ck.save(1, {"model": sd})
    flat, nested = _objects(tmp_path / "flat"), _objects(tmp_path / "nested")
    prefixes = {k.split(".")[0] for k in sd if not k[0].isdigit()} | ({"0"} if any(k[0].isdigit() for k in sd) else set())
    # a pack per prefix, element size and kind at most, beside the nested form's packs
    assert len(sd) > 150 and flat <= nested + 2 * len(prefixes) and flat < nbytes // 4096 + 12, (len(sd), flat, nested)

    class Counting(WrapperStore):
        def _forward(self, op, key, *args):
            reads.append(key) if op == "get" and key.startswith("chunks/") else None
            return super()._forward(op, key, *args)

    reads: list[str] = []
    key = next(k for k in sd if k.endswith("running_var"))
    with Checkpointer(Counting(Store.from_url(str(tmp_path / "flat")))) as ck:
        got = ck.restore(1, select=[key])
    assert list(got) == [key] and torch.equal(got[key], sd[key]) and len(reads) == 1, reads
