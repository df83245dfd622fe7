"""Protocol test kits: crash an operation after every store call; run a GC between every two calls.

The commit protocol (docs/format.md, "Commit protocol") promises that a save may crash between any
two store calls and leave only unreferenced objects, never a visible partial checkpoint. These kits
replay an operation (a save, a multi-part cut, a commit, a garbage collection) once per store call
it makes, and check the store a restarted process would find::

    from ckptlib.testing.protocol import crash_after_every_call, expect_states, interleave_gc

    def history():                      # a fresh store holding the steps before the operation
        store = Store.from_url(str(tmp_path / uuid.uuid4().hex))
        with Checkpointer(store, chunk_bytes=4096) as ck:
            ck.save(1, state1)
        return store

    def save(store):                    # the operation under test, on the store it is given
        with Checkpointer(store, chunk_bytes=4096) as ck:
            ck.save(2, state2)

    points = crash_after_every_call(history, save, expect_states({1: state1, 2: state2}))
    interleave_gc(history, save, expect_states({1: state1, 2: state2}), expect_committed=[1, 2])

``crash_after_every_call(make_store, op, check)``: for k = 1, 2, ... until the operation finishes
without reaching call k: a fresh ``make_store()``; ``op`` runs on a ``FaultyStore`` that performs
call k and then raises ``SimulatedCrash`` (the process died: that call and every later one).
Then, on the store as a restarted process finds it:

* the operation died (``SimulatedCrash`` reached its caller: nothing swallowed it);
* every step committed before is still committed with the same manifest bytes (``must_keep``,
  default all of them: a GC passes the steps its policy keeps);
* nothing is torn: ``check(store)`` (e.g. ``expect_states``: every committed step restores
  bit-exactly, ``verify`` is []);
* a retry (``retry``, default ``op`` itself) on the plain store succeeds, ``check`` passes again,
  and the steps ``expect_committed`` are committed.

``interleave_gc(make_store, op, check)``: for k = 0, 1, ...: a full garbage collection
(``gc(store)``, default ``keep_last=1, grace_s=0``) runs between store call k and k+1 of ``op``
(k = 0: before it), on the plain store, as another process would; ``op`` must then succeed and
``check`` pass. With ``gc_first=True`` the collection starts first: it takes its lock, reads the
leases and plans, then pauses right before it deletes its first chunk; the operation runs up to
call k; the collection finishes; the operation goes on. That is the interleaving in which a GC
sweeps objects a save re-uses (found already stored, e.g. left by an earlier failed attempt of
the same step) after the save found them.

``run_inside_gc(make_store, op, check)``: the mirror image: for k = 0, 1, ...: the operation (e.g.
a save of a new state) starts and pauses right after its save's first look at ``gc.lock`` (its
save lease written, no GC seen); a full garbage collection starts; after the collection's store call k the
operation runs to its end, as another process would; then the collection goes on. The operation
must succeed, ``check`` pass and ``expect_committed`` be committed. That is the interleaving in
which a GC that listed the steps before a save committed, and read the leases after it ended,
swept with marks that did not know the save's manifest (the new keyframe it wrote was lost).

``interleave_gc_at_lease_looks(make_store, op, check)``: for every look i = 1, 2, ... of the
collection at the leases (a listing of ``leases/``: each decision it takes, to plan, to sweep, to
drop a step, follows one) and every call k of ``op``: the collection starts first and pauses right
after look i; the operation runs its first k calls; the collection finishes; the operation goes on.
That is the interleaving in which a reader's lease is written just after the GC looked: a GC that
decided on an older look must still not sweep what the reader goes on to read. The operation must
succeed (a restore of a step the GC dropped before the reader found its manifest may say so: the
operation decides what it accepts), and ``check`` pass.

They return what they did (``Point``s: k, the call, how it ended) so a test can also assert
coverage (e.g. that some crash fell right after the manifest was published).

Keep states small (a few chunks of ``chunk_bytes=4096``): each point replays the whole operation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptlib.store import Store, WrapperStore
from ckptlib.testing.compare import assert_same_state
from ckptlib.testing.faulty import Call, FaultyStore, SimulatedCrash

__all__ = [
    "Point",
    "age_objects",
    "assert_same_state",  # from ckptlib.testing.compare, where it is defined
    "committed_manifests",
    "crash_after_every_call",
    "default_gc",
    "expect_states",
    "interleave_gc",
    "interleave_gc_at_lease_looks",
    "run_inside_gc",
]

MAX_POINTS = 5000  # an operation that makes more calls than this is not a "small" test


@dataclass(frozen=True)
class Point:
    """One replay: the operation was interrupted after call ``k`` (``call``: what it was; None when
    nothing interrupted it). ``outcome``: "crashed", "completed" (it finished before call k), or
    for interleave_gc "gc ran". ``committed``: the committed steps right after the crash (before
    the retry), or at the end."""

    k: int
    call: Call | None
    outcome: str
    committed: tuple[int, ...]
    look: int = 0  # interleave_gc_at_lease_looks: the GC paused after its look ``look`` at the leases


def committed_manifests(store: Store) -> dict[int, bytes]:
    """Committed step -> the bytes of its manifest."""
    from ckptlib.commit import committed_steps, manifest_key

    return {step: store.get(manifest_key(step)) for step in committed_steps(store)}


def expect_states(expected: Mapping[int, Any], *, loose: Callable[[Any, Any], bool] | None = None,
                  verify: bool = True) -> Callable[[Store], None]:
    """A ``check`` for the kits: every committed step is one of ``expected`` (step -> the state
    ``restore(step)`` must return: a multi-part step's is ``{part: state}``) and restores
    bit-exactly (``assert_same_state``, exact types), read by a fresh Checkpointer; with ``verify``,
    ``Checkpointer.verify`` is []."""
    from ckptlib import Checkpointer

    def check(store: Store) -> None:
        with Checkpointer(store) as ck:
            for step in ck.steps():
                assert step in expected, f"step {step} is committed, but no state was expected for it"
                try:
                    got = ck.restore(step)
                except Exception as e:
                    raise AssertionError(f"committed step {step} does not restore: {type(e).__name__}: {e}") from e
                assert_same_state(expected[step], got, f"step {step}", loose=loose)
                if verify:
                    problems = ck.verify(step)
                    assert problems == [], f"verify of committed step {step}: {[str(p) for p in problems]}"

    return check


def default_gc(store: Store) -> Any:
    """A full garbage collection: keep the newest step, no grace period, no wait for a save that did
    not see it (the interleavings pause that save until a given call of the GC: a wait would only
    add calls)."""
    from ckptlib import Checkpointer, RetentionPolicy

    with Checkpointer(store) as ck:
        return ck.gc(RetentionPolicy(keep_last=1), grace_s=0, wait_s=0)


def age_objects(store: Store, prefix: str, seconds: float) -> int:
    """Make every object under ``prefix`` look ``seconds`` older (local and memory stores, also
    wrapped); returns how many. For tests of grace periods and of objects left by old attempts."""
    import os

    from ckptlib.store import LocalStore, MemoryStore

    while isinstance(store, WrapperStore):
        store = store.inner
    n = 0
    for info in list(store.scan(prefix)):
        when = info.modified - seconds
        if isinstance(store, LocalStore):
            os.utime(os.path.join(store.root, info.key), (when, when), follow_symlinks=False)
        elif isinstance(store, MemoryStore):
            from datetime import UTC, datetime

            store.fs.store[f"{store.root}/{info.key}"].modified = datetime.fromtimestamp(when, tz=UTC)
        else:
            raise NotImplementedError(f"cannot change modification times in {store.url}")
        n += 1
    return n


# --------------------------------------------------------------------------- crash after every call


def _died(e: BaseException) -> bool:
    """Whether ``e`` is, or was caused by, a SimulatedCrash."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, SimulatedCrash):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def crash_after_every_call(make_store: Callable[[], Store], op: Callable[[Store], Any],
                           check: Callable[[Store], None], *, retry: Callable[[Store], Any] | None = None,
                           must_keep: Iterable[int] | None = None, expect_committed: Iterable[int] | None = None,
                           max_points: int = MAX_POINTS) -> list[Point]:
    """See the module docstring. Raises AssertionError naming k and the call at the first failure."""
    points: list[Point] = []
    retry = retry or op
    for k in range(1, max_points + 1):
        store = make_store()
        before = committed_manifests(store)
        faulty = FaultyStore(store).crash_after("*", nth=k)
        error: BaseException | None = None
        try:
            op(faulty)
        except BaseException as e:  # noqa: BLE001 - judged below
            error = e
        crash = next((c for c in faulty.calls if c.fault == "crash"), None)
        where = f"crash after call {k} ({crash.op} {crash.key!r})" if crash else f"call {k}"
        if crash is None:
            if error is not None:
                raise AssertionError(f"the operation failed before {where} without any fault: {error!r}") from error
            _check_after(store, before, check, must_keep, f"the operation completed ({k - 1} calls)")
            points.append(Point(k, None, "completed", tuple(committed_manifests(store))))
            break
        if error is None:
            raise AssertionError(f"{where}: the operation returned normally: something swallowed the SimulatedCrash")
        if not _died(error):
            raise AssertionError(f"{where}: the operation raised {type(error).__name__}: {error} instead of dying "
                                 "(SimulatedCrash)") from error
        _check_after(store, before, check, must_keep, where)
        after_crash = tuple(committed_manifests(store))
        try:
            retry(store)
        except Exception as e:
            raise AssertionError(f"{where}: the retry failed: {type(e).__name__}: {e}") from e
        _check_after(store, before, check, must_keep, f"{where}, then a retry")
        now = committed_manifests(store)
        if expect_committed is not None:
            missing = sorted(set(expect_committed) - set(now))
            assert not missing, f"{where}, then a retry: steps {missing} are not committed"
        points.append(Point(k, crash, "crashed", after_crash))
    else:
        raise AssertionError(f"the operation made more than {max_points} store calls; use a smaller state")
    return points


def _check_after(store: Store, before: dict[int, bytes], check: Callable[[Store], None],
                 must_keep: Iterable[int] | None, where: str) -> None:
    now = committed_manifests(store)
    keep = set(before) if must_keep is None else set(must_keep)
    for step in sorted(keep & set(before)):
        assert step in now, f"{where}: step {step}, committed before, is no longer committed"
        assert now[step] == before[step], f"{where}: the manifest of step {step} changed"
    try:
        check(store)
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}") from e


# --------------------------------------------------------------------------- GC between two calls


class _Tap(WrapperStore):
    """Calls ``before(op, key)`` and ``after(op, key)`` around every call (children too)."""

    def __init__(self, inner: Store, before: Callable[[str, str], None] | None = None,
                 after: Callable[[str, str], None] | None = None):
        super().__init__(inner)
        self.before, self.after = before, after

    def _forward(self, op: str, key: str, *args: Any) -> Any:
        if self.before:
            self.before(op, key)
        try:
            result = super()._forward(op, key, *args)
            if op in ("scan", "list", "list_dirs"):  # a lazy listing would be read after the call returns
                result = list(result)
        finally:  # also after a call that raised (a get of a missing gc.lock: "no GC")
            if self.after:
                self.after(op, key)
        return result

    def remove_stale_temp(self, older_than: float) -> list[str]:
        return self._forward("remove_stale_temp", older_than)  # type: ignore[arg-type]

    def _wrap_child(self, inner_child: Store) -> Store:
        return _Tap(inner_child, self.before, self.after)


def _judge(store: Store, check: Callable[[Store], None], expect_committed: Iterable[int] | None,
           where: str) -> dict[int, bytes]:
    """``check`` the store after one interleaving and that ``expect_committed`` are committed
    (AssertionError naming ``where``); the committed manifests."""
    try:
        check(store)
    except AssertionError as e:
        raise AssertionError(f"{where}: {e}") from e
    now = committed_manifests(store)
    if expect_committed is not None:
        missing = sorted(set(expect_committed) - set(now))
        assert not missing, f"{where}: steps {missing} are not committed"
    return now


def interleave_gc(make_store: Callable[[], Store], op: Callable[[Store], Any], check: Callable[[Store], None], *,
                  gc: Callable[[Store], Any] = default_gc, gc_first: bool = False,
                  expect_committed: Iterable[int] | None = None, max_points: int = MAX_POINTS,
                  timeout_s: float = 120.0) -> list[Point]:
    """See the module docstring. Raises AssertionError naming k at the first failure."""
    points: list[Point] = []
    for k in range(max_points + 1):
        store = make_store()
        run = _Interleaving(store, k, gc, _before_first_chunk_delete if gc_first else None, timeout_s)
        call, calls = run.go(op)
        where = f"GC after call {k} ({call.op} {call.key!r})" if call else (
            "GC before the operation" if k == 0 else f"k={k} (no GC ran)")
        now = _judge(store, check, expect_committed, where)
        points.append(Point(k, call, "gc ran" if run.fired else "completed", tuple(now)))
        if k and calls < k:  # the operation made fewer than k calls: every point was tried
            break
    else:
        raise AssertionError(f"the operation made more than {max_points} store calls; use a smaller state")
    return points


def interleave_gc_at_lease_looks(make_store: Callable[[], Store], op: Callable[[Store], Any],
                                 check: Callable[[Store], None], *, gc: Callable[[Store], Any] = default_gc,
                                 expect_committed: Iterable[int] | None = None, max_points: int = MAX_POINTS,
                                 timeout_s: float = 120.0) -> list[Point]:
    """See the module docstring. Raises AssertionError naming the look and k at the first failure."""
    points: list[Point] = []
    for look in range(1, max_points + 1):
        for k in range(1, max_points + 1):
            run = _Interleaving(make_store(), k, gc, _after_lease_look(look), timeout_s)
            if not run.paused.is_set():  # the GC ended before its look ``look``: every look was tried
                run.go(lambda store: None)  # reports a GC that failed
                if look == 1:
                    raise AssertionError("the GC never looked at the leases")
                return points
            call, calls = run.go(op)
            where = f"GC paused after its lease look {look}, finished after call {k} of the operation ({call})"
            now = _judge(run.store, check, expect_committed, where)
            points.append(Point(k, call, "gc ran" if call else "completed", tuple(now), look))
            if calls < k:  # the operation made fewer than k calls: every point of this look was tried
                break
        else:
            raise AssertionError(f"the operation made more than {max_points} store calls; use a smaller state")
    raise AssertionError(f"the GC looked at the leases more than {max_points} times; use a smaller store")


# Where a GC started first pauses (``when``: "before" or "after" its store call ``op`` on ``key``).
PausePoint = Callable[[str, str, str], bool]


def _before_first_chunk_delete(when: str, op: str, key: str) -> bool:
    return when == "before" and op == "delete" and key.startswith("chunks/")


def _after_lease_look(n: int) -> PausePoint:
    looks = 0

    def at(when: str, op: str, key: str) -> bool:
        nonlocal looks
        if when == "after" and op == "scan" and key.startswith("leases"):
            looks += 1
            return looks == n
        return False

    return at


class _Interleaving:
    """One run of interleave_gc: the operation on a tapped store, a GC at its call k (with
    ``pause``: the GC started first and paused there)."""

    def __init__(self, store: Store, k: int, gc: Callable[[Store], Any], pause: PausePoint | None,
                 timeout_s: float):
        self.store, self.k, self.gc, self.timeout_s, self.pause = store, k, gc, timeout_s, pause
        self.calls = 0
        self.lock_gets = 0
        self.fired = False
        self.call: Call | None = None
        self.gc_error: BaseException | None = None
        self.lock = threading.Lock()
        self.resume = threading.Event()
        self.paused = threading.Event()
        self.thread: threading.Thread | None = None
        self.gc_store: Store = store
        if pause is not None:
            self.gc_store = _Tap(store, before=lambda op, key: self._gc_at("before", op, key),
                                 after=lambda op, key: self._gc_at("after", op, key))
            self.thread = threading.Thread(target=self._run_gc, name="interleaved-gc", daemon=True)
            self.thread.start()
            # wait until it pauses, or ends (it never reached the point: e.g. nothing to delete)
            while not self.paused.wait(0.01) and self.thread.is_alive():
                pass

    def _run_gc(self) -> None:
        try:
            self.gc(self.gc_store)
        except BaseException as e:  # noqa: BLE001 - reported by go()
            self.gc_error = e

    def _gc_at(self, when: str, op: str, key: Any) -> None:
        assert self.pause is not None
        if not self.paused.is_set() and self.pause(when, op, str(key)):
            self.paused.set()
            if not self.resume.wait(self.timeout_s):
                raise AssertionError("the interleaved GC was never resumed")

    def _finish_gc(self) -> None:
        self.fired = True
        if self.thread is None:
            self._run_gc()
            return
        self.resume.set()
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            raise AssertionError(f"k={self.k}: the interleaved GC did not finish within {self.timeout_s:.0f} s")

    def _before(self, op: str, key: Any) -> None:
        # a paused GC resumes as soon as the operation would start waiting for it (its second
        # look at gc.lock: a save before publishing, a reader before reading), so it never waits
        if self.thread is not None and op == "get" and key == "gc.lock":
            with self.lock:
                if not self.fired and self.lock_gets >= 1:
                    self.call = Call(op, str(key))
                    self._finish_gc()

    def _after(self, op: str, key: Any) -> None:
        with self.lock:  # other threads of the operation wait here while the GC runs
            self.calls += 1
            if op == "get" and key == "gc.lock":
                self.lock_gets += 1
            if not self.fired and self.calls == self.k:
                self.call = Call(op, str(key))
                self._finish_gc()

    def go(self, op: Callable[[Store], Any]) -> tuple[Call | None, int]:
        if self.k == 0:
            self._finish_gc()
            target: Store = self.store
        else:
            target = _Tap(self.store, before=self._before, after=self._after)
        try:
            op(target)
        except Exception as e:
            where = f"GC after call {self.k} ({self.call})" if self.call else f"k={self.k}"
            raise AssertionError(f"{where}: the operation failed: {type(e).__name__}: {e}") from e
        finally:
            if self.thread is not None and not self.fired:
                self.resume.set()
                self.thread.join(self.timeout_s)
        if self.gc_error is not None:
            err = self.gc_error
            raise AssertionError(f"GC at call {self.k} ({self.call}) failed: {type(err).__name__}: {err}") from err
        return self.call, self.calls


# --------------------------------------------------------------------------- an operation around a GC


def run_inside_gc(make_store: Callable[[], Store], op: Callable[[Store], Any], check: Callable[[Store], None], *,
                  gc: Callable[[Store], Any] = default_gc, expect_committed: Iterable[int] | None = None,
                  max_points: int = MAX_POINTS, timeout_s: float = 120.0) -> list[Point]:
    """See the module docstring. Raises AssertionError naming k (the GC's call) at the first failure."""
    points: list[Point] = []
    for k in range(max_points + 1):
        run = _OpAroundGc(make_store(), op, gc, k, timeout_s)
        where = run.go()
        now = _judge(run.store, check, expect_committed, where)
        points.append(Point(k, run.call, "op ran" if run.call else "completed", tuple(now)))
        if run.call is None:  # the GC made fewer than k calls: every point was tried
            break
    else:
        raise AssertionError(f"the GC made more than {max_points} store calls; use a smaller store")
    return points


class _OpAroundGc:
    """One run of run_inside_gc: the operation starts first and pauses right after its save's first
    look at gc.lock (its lease is written: it saw no GC); the GC runs; after the GC's call k the operation
    runs to its end; then the GC goes on."""

    def __init__(self, store: Store, op: Callable[[Store], Any], gc: Callable[[Store], Any], k: int,
                 timeout_s: float):
        self.store, self.op, self.gc, self.k, self.timeout_s = store, op, gc, k, timeout_s
        self.call: Call | None = None
        self.op_error: BaseException | None = None
        self.paused, self.resume = threading.Event(), threading.Event()
        self.gc_calls = 0
        self.saving = False
        self.thread = threading.Thread(target=self._run_op, name="op-around-gc", daemon=True)

    def _run_op(self) -> None:
        try:
            self.op(_Tap(self.store, after=self._op_after))
        except BaseException as e:  # noqa: BLE001 - reported by go()
            self.op_error = e
        finally:
            self.paused.set()

    def _op_after(self, name: str, key: Any) -> None:
        if name == "put" and str(key).startswith("leases/save-"):
            self.saving = True  # a restore before the save (a follower's) looks at gc.lock for its read lease
        if name == "get" and key == "gc.lock" and self.saving and not self.paused.is_set():
            self.paused.set()
            if not self.resume.wait(self.timeout_s):
                raise AssertionError("the operation was never resumed")

    def _finish_op(self, call: Call) -> None:
        self.call = call
        self.resume.set()
        self.thread.join(self.timeout_s)
        if self.thread.is_alive():
            raise AssertionError(f"after call {self.k} of the GC ({call.op} {call.key!r}) the operation did not "
                                 f"finish within {self.timeout_s:.0f} s: it waits for the GC, which it never saw")

    def _gc_after(self, name: str, key: Any) -> None:
        self.gc_calls += 1
        if self.call is None and self.gc_calls == self.k:
            self._finish_op(Call(name, str(key)))

    def go(self) -> str:
        self.thread.start()
        self.paused.wait(self.timeout_s)
        if self.k == 0:
            self._finish_op(Call("start", ""))
        try:
            self.gc(_Tap(self.store, after=self._gc_after))
        finally:
            if self.call is None:  # the GC made fewer than k calls: the operation ends after it
                self.resume.set()
                self.thread.join(self.timeout_s)
        where = (f"the operation finished after call {self.k} of the GC ({self.call.op} {self.call.key!r})"
                 if self.call else f"k={self.k} (the GC made {self.gc_calls} calls)")
        if self.op_error is not None:
            err = self.op_error
            raise AssertionError(f"{where}: the operation failed: {type(err).__name__}: {err}") from err
        return where
