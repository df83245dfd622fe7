"""The commit and GC protocols, crashed after every store call and interleaved with a full GC
between every two calls (ckptlib.testing.protocol). Small states: each point replays the operation."""

from __future__ import annotations

import shutil
import uuid

import pytest
import torch

from ckptlib import Checkpointer, NoCheckpoint, RetentionPolicy, StoreError
from ckptlib.store import Store, WrapperStore
from ckptlib.testing import FaultyStore, SimulatedCrash
from ckptlib.testing.protocol import (
    age_objects,
    assert_same_state,
    crash_after_every_call,
    expect_states,
    interleave_gc,
    interleave_gc_at_lease_looks,
    run_inside_gc,
)

CHUNK = 4096
PARTS = ("shard-0", "shard-1")
pytestmark = pytest.mark.timeout(300)


def state(step: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(2500, generator=g)  # 10 KB: 3 chunks
    b = torch.randn(64, generator=g)  # small: packed
    if step >= 2:
        w[:40] += 0.5 * step  # a sparse change of the first chunk
        b += step
    if step >= 3:
        w[2048:] *= 1.01  # a dense change of the last chunk
    return {"w": w, "b": b, "step": step, "opt": {0: {"lr": 0.1 * step}}}


def cut(step: int) -> dict:
    return {p: state(step, seed=i + 1) for i, p in enumerate(PARTS)}


@pytest.fixture
def new_store(tmp_path):
    def make() -> Store:
        return Store.from_url(str(tmp_path / uuid.uuid4().hex[:10]))

    return make


@pytest.fixture(params=["memory"])
def template(request, tmp_path):
    """template(build) -> make_store: ``build`` runs once on a template store; each make_store()
    is a copy of it (modification times kept), so a point does not pay for the history again.
    memory:// by default (no fsync: many points per second); tests parametrise "local" too."""
    kind = request.param
    made: list[Store] = []

    def make(build):
        if kind == "local":
            tpl = tmp_path / f"template-{uuid.uuid4().hex[:6]}"
            build(Store.from_url(str(tpl)))

            def copy() -> Store:
                dst = tmp_path / uuid.uuid4().hex[:10]
                shutil.copytree(tpl, dst, symlinks=True)
                return Store.from_url(str(dst))

            return copy
        src = Store.from_url(f"memory://protocol-{uuid.uuid4().hex}")
        made.append(src)
        build(src)
        infos = list(src.scan())

        def copy() -> Store:
            dst = Store.from_url(f"memory://protocol-{uuid.uuid4().hex}")
            made.append(dst)
            for info in infos:
                dst.put(info.key, src.get(info.key))
                dst.fs.store[f"{dst.root}/{info.key}"].modified = src.fs.store[f"{src.root}/{info.key}"].modified
            return dst

        return copy

    yield make
    for store in made:
        for info in list(store.scan()):
            store.delete(info.key)


def save(store: Store, *steps: int, follow: bool = True) -> None:
    with Checkpointer(store, chunk_bytes=CHUNK) as ck:
        if follow and ck.steps():
            ck.restore(keep_base=True)  # the previous step's bytes: the next save writes deltas
        for step in steps:
            ck.save(step, state(step))


def write_cut(store: Store, step: int, parts=PARTS) -> None:
    for i, part in enumerate(parts):
        with Checkpointer(store, chunk_bytes=CHUNK) as ck:
            if step > 1 and ck.steps():
                ck.restore(ck.steps()[-1], part=part, keep_base=True)
            ck.write_fragment(step, part, state(step, seed=PARTS.index(part) + 1), config_hash="h")


def commit_cut(store: Store, step: int) -> None:
    with Checkpointer(store, chunk_bytes=CHUNK) as ck:
        ck.commit(step, list(PARTS), timeout=5)


def failed_attempt(store: Store, step: int) -> None:
    """A save of ``step`` whose publish failed: its objects stay behind, unreferenced, and look old."""
    faulty = FaultyStore(store).fail_on("put_if_absent", "manifests/*")
    with pytest.raises(StoreError), Checkpointer(faulty, chunk_bytes=CHUNK) as ck:
        ck.save(step, state(step))
    age_objects(store, "chunks", 3600)


# ----------------------------------------------------------------------------- crash after every call


@pytest.mark.parametrize("template", ["memory", "local"], indirect=True)
@pytest.mark.parametrize("follow", [False, True], ids=["fresh-writer", "follower"])
def test_crash_after_every_call_of_a_save(template, follow):
    history = template(lambda store: save(store, 1))
    points = crash_after_every_call(history, lambda s: save(s, 2, follow=follow),
                                    expect_states({1: state(1), 2: state(2)}), expect_committed=[1, 2])
    crashed = [p for p in points if p.outcome == "crashed"]
    assert len(crashed) >= 8
    # coverage: crashes before and right after the commit point
    assert any(p.call.key == "manifests/2.json" for p in crashed)
    assert any(2 not in p.committed for p in crashed[:1])


def test_crash_after_every_call_of_an_async_save(template):
    history = template(lambda store: save(store, 1))

    def op(store):
        with Checkpointer(store, chunk_bytes=CHUNK) as ck:
            ck.restore(keep_base=True)
            s = state(2)
            fut = ck.save_async(2, s)
            s["w"].zero_()  # the caller may change its state once save_async returned
            fut.result(timeout=60)

    crash_after_every_call(history, op, expect_states({1: state(1), 2: state(2)}), expect_committed=[1, 2])


def test_crash_after_every_call_of_a_multi_part_cut(template):
    def build(store):
        write_cut(store, 1)
        commit_cut(store, 1)

    history = template(build)

    def op(store):
        write_cut(store, 2)
        commit_cut(store, 2)

    crash_after_every_call(history, op, expect_states({1: cut(1), 2: cut(2)}), expect_committed=[1, 2])


def test_crash_after_every_call_of_a_commit(template):
    def build(store):
        write_cut(store, 1)
        commit_cut(store, 1)
        write_cut(store, 2)

    history = template(build)

    points = crash_after_every_call(history, lambda s: commit_cut(s, 2), expect_states({1: cut(1), 2: cut(2)}),
                                    expect_committed=[1, 2])
    assert points[-1].outcome == "completed"


def _gc_history(store):
    save(store, 1, 2, 3, 4)
    store.put("validations/1.json", b'{"passed": true}')
    store.put("reports/1/summary.json", b"{}")
    store.put("reports/2/index.html", b"<html/>")
    failed_attempt(store, 5)  # orphans for the sweep


def _gc(store):
    with Checkpointer(store) as ck:
        return ck.gc(RetentionPolicy(keep_last=2), grace_s=0, wait_s=0)  # see default_gc


@pytest.fixture
def short_gc_wait(monkeypatch):
    """Saves and readers that find gc.lock wait for that GC to end (10 min by default): 3 s here,
    so that a test of it fails fast instead of hanging."""
    from ckptlib import leases

    monkeypatch.setattr(leases, "GC_WAIT_S", 3.0)


@pytest.mark.timeout(120)
def test_crash_after_every_call_of_gc(template, short_gc_wait):
    """A GC killed anywhere leaves every kept step restorable (read by step, as a validation or an
    evaluation does) and every step still committed intact; a GC run again (after its stale lock is
    removed, as its error says) completes the job."""

    def retry(store):
        store.delete("gc.lock")  # what the refusal says to do once that GC's process is gone
        _gc(store)

    expected = {s: state(s) for s in (1, 2, 3, 4)}
    crash_after_every_call(template(_gc_history), _gc, expect_states(expected), retry=retry, must_keep=[3, 4])


def test_crash_after_every_call_of_gc_once_its_lock_is_cleared(template):
    """The same, with the killed GC's lock removed before the store is read (an operator cleaned up):
    GC's own order (reports, verdict, manifest last; objects after) is what is checked here."""

    def check(store):
        store.delete("gc.lock")
        expect_states({s: state(s) for s in (1, 2, 3, 4)})(store)

    def retry(store):
        _gc(store)

    points = crash_after_every_call(template(_gc_history), _gc, check, retry=retry, must_keep=[3, 4])
    assert len(points) > 10
    final = points[-1]
    assert final.outcome == "completed" and final.committed == (3, 4)
    # some crash fell between a dropped step's report and its manifest
    assert any(p.call.key.startswith("reports/") and 1 in p.committed for p in points if p.call)


def test_a_gc_killed_mid_way_blocks_the_next_with_a_clear_error(template):
    store = template(_gc_history)()
    with pytest.raises(SimulatedCrash):
        _gc(FaultyStore(store).crash_after("delete", "chunks/*"))
    with pytest.raises(StoreError, match="gc.lock"):
        _gc(store)


# ----------------------------------------------------------------------------- GC between two calls


def _retry_history(store):
    save(store, 1)
    failed_attempt(store, 2)  # the same step's objects, already stored, old


@pytest.mark.parametrize("template", ["memory", "local"], indirect=True)
@pytest.mark.parametrize("gc_first", [False, True], ids=["gc-between-calls", "gc-started-first"])
def test_gc_between_every_two_calls_of_a_retried_save(template, gc_first, caplog):
    """The save re-uses objects its failed first attempt left (old, unreferenced): a GC beside it
    must not leave it committing a checkpoint whose objects were swept."""
    caplog.set_level("WARNING", logger="ckptlib")
    points = interleave_gc(template(_retry_history), lambda s: save(s, 2, follow=False),
                           expect_states({1: state(1), 2: state(2)}), gc_first=gc_first, expect_committed=[2])
    assert sum(p.outcome == "gc ran" for p in points) >= 8
    if gc_first:  # the dangerous interleaving happened: swept re-used objects were written again
        assert "while this save re-used it: writing it again" in caplog.text


@pytest.mark.parametrize("gc_first", [False, True], ids=["gc-between-calls", "gc-started-first"])
def test_gc_between_every_two_calls_of_an_async_follower_save(template, gc_first):
    def op(store):
        with Checkpointer(store, chunk_bytes=CHUNK) as ck:
            ck.restore(1, keep_base=True)
            ck.save_async(2, state(2)).result(timeout=60)

    interleave_gc(template(_retry_history), op, expect_states({1: state(1), 2: state(2)}), gc_first=gc_first,
                  expect_committed=[2])


@pytest.mark.parametrize("gc_first", [False, True], ids=["gc-between-calls", "gc-started-first"])
def test_gc_between_every_two_calls_of_a_multi_part_cut(template, gc_first):
    def build(store):
        write_cut(store, 1)
        commit_cut(store, 1)
        write_cut(store, 2, parts=PARTS[:1])  # an earlier attempt of shard-0 whose cut never committed
        for key in store.list("fragments/2"):
            store.delete(key)
        age_objects(store, "chunks", 3600)

    def op(store):
        write_cut(store, 2)
        commit_cut(store, 2)

    interleave_gc(template(build), op, expect_states({1: cut(1), 2: cut(2)}), gc_first=gc_first, expect_committed=[2])


# ----------------------------------------------------------------------------- a restore beside a GC


def _restore_exactly(step: int | None, outcomes: dict[str, int]):
    """A restore of ``step`` that must return its exact state, or NoCheckpoint when the GC dropped
    the step before the reader found its manifest (never a chunk "missing from the store")."""
    def op(store):
        with Checkpointer(store) as ck:
            try:
                got = ck.restore(step)
            except NoCheckpoint:
                outcomes["not committed"] = outcomes.get("not committed", 0) + 1
                return
        assert_same_state(state(step if step is not None else 2), got)
        outcomes["restored"] = outcomes.get("restored", 0) + 1

    return op


@pytest.mark.parametrize("template", ["memory", "local"], indirect=True)
def test_a_restore_of_a_step_gc_drops_beside_every_look_of_the_gc_at_the_leases(template):
    """The race CI found (a leased restore of an old step failed: "chunk ... is missing from the
    store"): the GC read the leases, the reader wrote its lease and read the manifest, the GC
    dropped the step and swept its objects. Wherever the reader's lease lands between the GC's
    looks at the leases, the restore returns the exact state or says the step is not committed."""
    outcomes: dict[str, int] = {}
    points = interleave_gc_at_lease_looks(template(lambda s: save(s, 1, 2, follow=False)),
                                          _restore_exactly(1, outcomes), expect_states({1: state(1), 2: state(2)}))
    assert len({p.look for p in points}) >= 3, points  # planning, sweeping and dropping each looked
    assert outcomes.get("restored", 0) >= 3 and outcomes.get("not committed", 0) >= 1, outcomes


class _PauseAtFirstChunk(WrapperStore):
    """Pauses the reader right before it reads its first chunk (its manifest read already)."""

    def __init__(self, inner, reached, go_on):
        super().__init__(inner)
        self.reached, self.go_on = reached, go_on

    def _forward(self, op, key, *args):
        if op == "get" and key.startswith("chunks/") and not self.reached.is_set():
            self.reached.set()
            assert self.go_on.wait(60), "never resumed"
        return super()._forward(op, key, *args)


def test_a_restore_of_the_latest_step_outlives_a_newer_commit_and_a_gc(new_store):
    """The newest step is never dropped, but it stops being the newest: a reader of the latest
    step, a save of the next one and a GC keeping only the newest, all while the reader reads."""
    import threading

    store = new_store()
    save(store, 1, 2, follow=False)
    reached, go_on = threading.Event(), threading.Event()
    outcomes: dict[str, int] = {}
    errors: list[BaseException] = []

    def read():
        try:
            _restore_exactly(None, outcomes)(_PauseAtFirstChunk(store, reached, go_on))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    assert reached.wait(60)
    save(store, 3, follow=False)
    with Checkpointer(store) as ck:
        report = ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
    go_on.set()
    reader.join(60)
    assert not errors, errors[0]
    assert outcomes == {"restored": 1} and 2 in report.kept_steps, (outcomes, report)


# ----------------------------------------------------------------------------- a save inside a GC


def _keep_last_2(store):
    with Checkpointer(store) as ck:
        return ck.gc(RetentionPolicy(keep_last=2), grace_s=0, wait_s=0)  # see default_gc


@pytest.mark.parametrize("template", ["memory", "local"], indirect=True)
@pytest.mark.parametrize("follow", [False, True], ids=["fresh-writer", "follower"])
def test_a_save_between_every_two_calls_of_a_gc(template, follow):
    """The interleaving that lost commits: a GC lists the steps, then a whole save of a new state
    (a new keyframe of the dense chunk) runs and commits, then the GC reads the leases (none: the
    save is done) and sweeps with marks that do not know the new manifest. Every committed step
    must still restore, and so must the next save's deltas built on it."""
    def history(store):
        save(store, 1, 2)

    def op(store):
        save(store, 3, follow=follow)

    points = run_inside_gc(template(history), op, expect_states({1: state(1), 2: state(2), 3: state(3)}),
                           gc=_keep_last_2, expect_committed=[3])
    assert sum(p.outcome == "op ran" for p in points) >= 8


def test_the_kits_see_a_broken_protocol(template):
    """Self-test: a save that skips its lease (so GC sweeps what it re-uses) is caught."""
    from ckptlib import leases

    class NoLease(leases.Lease):
        def acquire(self):
            self.held = False
            return self

    def op(store):
        original = leases.Lease.acquire
        try:
            leases.Lease.acquire = NoLease.acquire
            save(store, 2, follow=False)
        finally:
            leases.Lease.acquire = original

    with pytest.raises(AssertionError):
        interleave_gc(template(_retry_history), op, expect_states({1: state(1), 2: state(2)}))
