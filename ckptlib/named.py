"""Checkpoints saved under names a framework chooses (file or folder paths), each pointed at by a
pointer file (``ckptlib.pointer``): what ``ckptlib.lightning`` and ``ckptlib.hf`` share.

Each save commits the next ckptlib step (a counter, not the framework's global step: a framework
may save two names at one global step, or save a name again after resuming from an older one), with
its name in the step's meta, and then writes the pointer. A name's current step is the one its
pointer names; every other step is garbage once a newer one exists: ``collect`` keeps exactly the
steps pointers name (and the newest). The store and the pointers together are the index, so there is
no index document to disagree with either after a crash: a step committed without its pointer (a kill
between the two) is dropped by the next GC, a pointer always names a committed step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import fsspec

from . import inline_gc, pointer
from .checkpointer import Checkpointer
from .errors import NoCheckpoint
from .gc import DEFAULT_GRACE_S


def _same(name: str) -> str:
    return name


class NamedCheckpoints:
    """Named checkpoints in the ckptlib store at ``url``; ``key``: the meta key naming a step's name;
    ``pointer_at(name)``: where a name's pointer is (default: at the name itself). ``storage_options``
    and ``options`` go to ``Checkpointer``; ``grace_s`` to GC."""

    def __init__(self, url: str, storage_options: dict | None, key: str, *,
                 pointer_at: Callable[[str], str] = _same, grace_s: float = DEFAULT_GRACE_S, **options: Any):
        self.url, self.storage_options, self.key, self.options = url, storage_options, key, options
        self.pointer_at, self.grace_s = pointer_at, grace_s
        self._ck: Checkpointer | None = None
        self._next: int | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        """Opened on first use (frameworks build plugins before they fork or spawn workers)."""
        if self._ck is None:
            self._ck = Checkpointer(self.url, self.storage_options, **self.options)
            inline_gc.clear_dead_lock(self._ck)  # a run killed in a GC would stall our first save
        return self._ck

    def __getstate__(self) -> dict:
        # frameworks copy plugins into spawned workers: each opens its own Checkpointer there
        return {**self.__dict__, "_ck": None, "_next": None}

    def save(self, name: str, state: Any, meta: dict | None = None) -> int:
        """Commit ``state`` as the next step named ``name``, then write its pointer; GC if that
        replaced a pointer (the step it named is garbage now). Returns the step."""
        step = self.commit(name, state, meta)
        where = self.pointer_at(name)
        replaces = pointer.exists(where)
        pointer.write(where, pointer.Pointer(self.url, step, name))
        if replaces:
            self.collect()
        return step

    def commit(self, name: str, state: Any, meta: dict | None = None) -> int:
        """Commit ``state`` as the next step named ``name``; the caller writes its pointer after."""
        ck = self.checkpointer
        if self._next is None:
            steps = ck.steps()
            self._next = steps[-1] + 1 if steps else 0
        step = self._next
        ck.save(step, state, meta={self.key: {"name": name, **(meta or {})}})
        self._next = step + 1
        return step

    def load(self, name: str, *, device: Any = "cpu", select: list[str] | None = None) -> Any:
        """The state the pointer of ``name`` (or a symlink to it) names, bit-exact. The restored
        state is kept as the base of the next save (a delta then), unless ``select`` restores only part."""
        where = self.pointer_at(name)
        ptr = pointer.read(where)
        pointer.check_url(where, ptr, self.url)
        try:
            return self.checkpointer.restore(ptr.step, device=device, select=select, keep_base=select is None)
        except NoCheckpoint:
            raise NoCheckpoint(f"{where} points at step {ptr.step} of {self.url}, which is no longer committed "
                               "(removed by a GC): resume from another checkpoint") from None

    def remove(self, name: str) -> None:
        """Delete the pointer of ``name`` (a symlink itself, not its target), then GC."""
        where = self.pointer_at(name)
        fs, p = fsspec.core.url_to_fs(where)
        if os.path.islink(where) or fs.exists(p):
            fs.rm(p)
        self.collect()

    def collect(self) -> None:
        """GC keeping the steps pointers name now (``inline_gc.collect``: best effort, no waiting)."""
        inline_gc.collect(self.checkpointer, self.live_steps(), self.grace_s)

    def live_steps(self) -> set[int]:
        """The steps that the pointers of the names in the store's steps name now."""
        ck = self.checkpointer
        names = set()
        for step in ck.steps():
            doc = ck.manifest(step).meta.get(self.key)
            if isinstance(doc, dict) and isinstance(doc.get("name"), str):
                names.add(doc["name"])
        live = set()
        for name in names:
            try:
                ptr = pointer.read(self.pointer_at(name))
            except (FileNotFoundError, NotADirectoryError, pointer.NotAPointer):
                continue  # removed, or overwritten by something else: its steps are not needed
            if ptr.url == self.url:
                live.add(ptr.step)
        return live

    def close(self) -> None:
        if self._ck is not None:
            self._ck.close()
            self._ck, self._next = None, None
