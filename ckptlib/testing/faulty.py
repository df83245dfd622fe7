"""FaultyStore: a Store wrapper that injects faults by rule, for protocol tests.

    fs = FaultyStore(Store.from_url("memory://t"))
    fs.fail_on("put_if_absent", "manifests/*", times=1)  # InjectedFault before writing: nothing stored
    fs.lose_reply("put_if_absent", "manifests/*")         # stored, then InjectedFault (reply lost)
    fs.truncate_on("put_if_absent", "chunks/*")           # stores only the first half of the bytes
    fs.drop("put", "heartbeats/*")                        # reports success, stores nothing
    fs.delay("get", "chunks/*", 0.5)                      # sleeps before the call
    fs.crash_after("put_if_absent", "fragments/*")        # stored, then SimulatedCrash; dead from then on
    fs.crash_after("*", nth=7)                             # the 7th call of any kind, then SimulatedCrash
    fs.on_call("*", "*", run_gc, nth=3)                    # run_gc() between the 3rd and the 4th call
    ...
    assert fs.keys("put_if_absent") == ["chunks/ab/abcd", "manifests/3.json"]

Rules match the operation and the key with fnmatch (``"put*"`` matches put and put_if_absent,
``"*"`` any key; for ``list`` the key is the prefix). A rule fires on at most ``times`` matching
calls (None: on all of them). Rules are checked in the order they were added: every matching delay
sleeps, then the first matching other rule decides what happens (hooks run besides). Every
call is recorded in ``calls``, with the fault it got. ``nth=n`` lets the first n-1 matching calls
pass before a rule fires. Calls are counted in the order they reach the wrapper: with several
threads, which upload is "the 7th call" varies from run to run.

``InjectedFault`` is a StoreError: the code under test should handle it like any storage failure.
``SimulatedCrash`` is a BaseException, so ``except Exception`` does not swallow it, as a dead
process would not run its handlers; after it, every call on this store (and its children) raises
it again until ``reset()``. Use ``fs.inner`` (or a new wrapper) for the "restarted" process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from ckptlib.errors import StoreError
from ckptlib.store import Store, WrapperStore

OPS = ("get", "put", "put_if_absent", "exists", "scan", "list", "list_dirs", "delete", "modified",
       "remove_stale_temp")
_WRITES = ("put", "put_if_absent", "delete")


class InjectedFault(StoreError):
    """A storage failure injected by FaultyStore."""


class SimulatedCrash(BaseException):
    """The writer "died" here (injected by FaultyStore.crash_after)."""


@dataclass(frozen=True)
class Call:
    """One call on a FaultyStore: the operation, the key (prefix for list), the fault injected."""

    op: str
    key: str
    fault: str | None = None  # None, "fail", "lose_reply", "truncate", "drop", "crash", "dead"


@dataclass
class _Rule:
    kind: str
    op: str
    pattern: str
    times: int | None
    seconds: float = 0.0
    skip: int = 0  # matching calls to let pass before the rule fires
    hook: Callable[[], None] | None = None

    def take(self, op: str, key: str) -> bool:
        """Whether this rule fires for (op, key); uses up one of its ``times``."""
        if self.times == 0 or not (fnmatchcase(op, self.op) and fnmatchcase(key, self.pattern)):
            return False
        if self.skip:
            self.skip -= 1
            return False
        if self.times is not None:
            self.times -= 1
        return True


@dataclass
class _State:  # shared by a FaultyStore and its children
    rules: list[_Rule] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    crashed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __getstate__(self) -> dict:  # a pickled FaultyStore (shipped to a worker) gets its own lock
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d, lock=threading.Lock())


class FaultyStore(WrapperStore):
    """Same API as ``inner``; faults are injected by the rules added with the methods below."""

    def __init__(self, inner: Store, _state: _State | None = None):
        super().__init__(inner)
        self._state = _state or _State()

    # ------------------------------------------------------------------ rules

    def _add(self, kind: str, op: str, pattern: str, times: int | None, allowed: tuple[str, ...] = OPS,
             seconds: float = 0.0, nth: int = 1, hook: Callable[[], None] | None = None) -> FaultyStore:
        if not any(fnmatchcase(o, op) for o in allowed):
            raise ValueError(f"{kind} rule for op {op!r} matches none of {allowed}")
        if not isinstance(nth, int) or nth < 1:
            raise ValueError(f"nth must be an int >= 1, got {nth!r}")
        with self._state.lock:
            self._state.rules.append(_Rule(kind, op, pattern, times, seconds, nth - 1, hook))
        return self

    def fail_on(self, op: str, pattern: str = "*", times: int | None = None, nth: int = 1) -> FaultyStore:
        """Raise InjectedFault instead of performing the call (a crash before the write), from the
        ``nth`` matching call on."""
        return self._add("fail", op, pattern, times, nth=nth)

    def lose_reply(self, op: str, pattern: str = "*", times: int | None = None) -> FaultyStore:
        """Perform the call, then raise InjectedFault as if its reply was lost."""
        return self._add("lose_reply", op, pattern, times)

    def truncate_on(self, op: str, pattern: str = "*", times: int | None = None) -> FaultyStore:
        """Writes store only the first half of the bytes; get returns only the first half."""
        return self._add("truncate", op, pattern, times, allowed=("get", "put", "put_if_absent"))

    def drop(self, op: str, pattern: str = "*", times: int | None = None) -> FaultyStore:
        """Writes report success (put_if_absent: True) but store or delete nothing."""
        return self._add("drop", op, pattern, times, allowed=_WRITES)

    def delay(self, op: str, pattern: str, seconds: float, times: int | None = None) -> FaultyStore:
        """Sleep ``seconds`` before performing the call."""
        return self._add("delay", op, pattern, times, seconds=seconds)

    def crash_after(self, op: str, pattern: str = "*", nth: int = 1) -> FaultyStore:
        """Perform the ``nth`` matching call, then raise SimulatedCrash; every later call raises it too."""
        return self._add("crash", op, pattern, times=1, nth=nth)

    def on_call(self, op: str, pattern: str, hook: Callable[[], None], nth: int = 1,
                times: int | None = 1) -> FaultyStore:
        """Run ``hook()`` right after the ``nth`` matching call has been performed (before it returns
        to its caller), e.g. to run a garbage collection between two calls of a save. The hook's own
        store calls do not go through this wrapper unless it uses it."""
        return self._add("hook", op, pattern, times, nth=nth, hook=hook)

    def reset(self) -> None:
        """Remove all rules and revive a crashed store; keeps ``calls``."""
        with self._state.lock:
            self._state.rules.clear()
            self._state.crashed = False

    @property
    def calls(self) -> list[Call]:
        return self._state.calls

    def keys(self, op: str) -> list[str]:
        """Keys of the recorded calls of ``op``, in call order."""
        return [c.key for c in self.calls if c.op == op]

    # ------------------------------------------------------------------ the wrapper

    def _call(self, op: str, key: str, do: Callable, data: bytes | memoryview | None = None) -> Any:
        state = self._state
        with state.lock:
            if state.crashed:
                state.calls.append(Call(op, key, "dead"))
                raise SimulatedCrash(f"{op} {key!r}: this store's writer crashed earlier")
            pause, fault, hooks = 0.0, None, []
            for rule in state.rules:
                if (rule.kind in ("delay", "hook") or fault is None) and rule.take(op, key):
                    if rule.kind == "delay":
                        pause += rule.seconds
                    elif rule.kind == "hook":
                        hooks.append(rule.hook)
                    else:
                        fault = rule.kind
            state.calls.append(Call(op, key, fault))
            if fault == "crash":
                state.crashed = True
        if pause:
            time.sleep(pause)
        if fault == "fail":
            raise InjectedFault(f"injected failure: {op} {key!r} in {self.url} was not performed")
        if fault == "drop" and op in _WRITES:
            return True if op == "put_if_absent" else None
        if fault == "truncate" and data is not None:
            data = data[: len(data) // 2]
        result = do(data) if data is not None else do()
        if fault == "truncate" and op == "get":
            result = result[: len(result) // 2]
        for hook in hooks:
            if hook is not None:
                hook()
        if fault == "lose_reply":
            raise InjectedFault(f"injected lost reply: {op} {key!r} in {self.url} was performed")
        if fault == "crash":
            raise SimulatedCrash(f"injected crash after {op} {key!r} in {self.url}")
        return result

    def _forward(self, op: str, key: str, *args: Any) -> Any:
        def do(*data: Any) -> Any:
            result = getattr(self.inner, op)(key, *data)
            return list(result) if op == "scan" else result

        if args and op in ("put", "put_if_absent"):
            return self._call(op, key, do, args[0])  # the bytes written (what truncate halves)
        return self._call(op, key, lambda: do(*args))  # e.g. get's max_bytes

    def remove_stale_temp(self, older_than: float) -> list[str]:
        return self._call("remove_stale_temp", "", lambda: self.inner.remove_stale_temp(older_than))

    def _wrap_child(self, inner_child: Store) -> FaultyStore:
        """The inner store's child, wrapped; shares rules, calls and crash state with this one."""
        return FaultyStore(inner_child, self._state)

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r})"
