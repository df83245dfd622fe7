"""The systems under test: one ``Runner`` per system saves a series of states into its own directory
and restores the latest.

* ``ckptlib``: ``Checkpointer.save_async`` on a local store; blocked = until save_async returns
  (snapshot taken), durable = until its future's result (chunks + manifest fsynced, published).
  Restore = ``Checkpointer(dir).restore()`` from a fresh Checkpointer (nothing cached).
* ``torch.save``: ``torch.save`` to ``<step>.pt``, then fsync of the file and the directory
  (torch.save does not fsync). Blocked = durable. Restore = ``torch.load(weights_only=True)``.
* ``dcp``: ``torch.distributed.checkpoint.save`` in this one process, no process group (torch 2.13
  takes the no-dist path when none is initialised); its FileSystemWriter fsyncs its files
  (``sync_files=True``). Blocked = durable. Restore = ``dcp.load`` into a pre-allocated state of the
  same structure (how DCP is used: into an existing model), allocation not timed.
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` (thread executor, default stager: a
  copy of the state to CPU memory); blocked = until it returns, durable = until its future completes.
  Restore as ``dcp``.
* ``memcpy``: ``copy_`` of every tensor into host buffers allocated at the first save, in parallel
  over tensors on a pool as large as ckptlib's default: the floor of blocked time for any system that
  snapshots. Durable = blocked, bytes 0, restore = clone of the copy.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from typing import Any

import torch

from .probes import dir_bytes
from .trees import copy_tensors, cpu_empty, map_tensors, refill


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Runner:
    """One system under test, saving a series of states into ``root`` and restoring the latest."""

    def __init__(self, root: str) -> None:
        self.root = root

    def save(self, step: int, state: Any) -> tuple[float, float]:
        """Save ``state``; return (blocked seconds, durable seconds), both from the call."""
        raise NotImplementedError

    def restore(self, template: Any) -> tuple[Any, float]:
        """(the latest state, seconds). ``template`` has the saved structure (for in-place loaders)."""
        raise NotImplementedError

    def restore_into(self, dest: Any) -> float:
        """Load the latest state into the tensors of ``dest`` (allocated by the caller); seconds."""
        state, seconds = self.restore(dest)
        t0 = time.perf_counter()
        copy_tensors(dest, state)
        return seconds + time.perf_counter() - t0

    def stored_bytes(self) -> int:
        """Bytes of the checkpoints in ``root`` (what ``bytes_written`` counts)."""
        return dir_bytes(self.root)

    def settle(self) -> None:
        """Let the system's work after a durable save end (outside every timed region)."""

    def close(self) -> None:
        pass


class CkptlibRunner(Runner):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        from ckptlib import Checkpointer

        # compacted: the latest step restores one object per chunk (its chains stay the stream's)
        self.ck = Checkpointer(root, compact=True)
        self.infos: list[Any] = []
        self.compaction_bytes: list[int] = []  # per save

    def save(self, step: int, state: Any) -> tuple[float, float]:
        t0 = time.perf_counter()
        fut = self.ck.save_async(step, state)
        t1 = time.perf_counter()
        self.infos.append(fut.result())
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0

    def stored_bytes(self) -> int:
        """The stream's bytes: the compaction's are counted apart (``compaction_bytes``)."""
        return dir_bytes(self.root, skip=("compact",))  # one walk: a compaction may be writing meanwhile

    def settle(self) -> None:
        before = self.ck.compaction_bytes
        self.ck.wait()
        self.compaction_bytes.append(self.ck.compaction_bytes - before)

    def restore(self, template: Any) -> tuple[Any, float]:
        from ckptlib import Checkpointer

        with Checkpointer(self.root) as reader:  # a new reader: no base held in memory, none kept
            t0 = time.perf_counter()
            state = reader.restore(keep_base=False)
            return state, time.perf_counter() - t0

    def restore_into(self, dest: Any) -> float:
        from ckptlib import Checkpointer

        with Checkpointer(self.root) as reader:
            t0 = time.perf_counter()
            reader.restore(into=dest)
            return time.perf_counter() - t0

    def restore_each_step(self, *, follow: bool) -> dict[int, float]:
        """Seconds to restore each committed step, in order, by one reader. ``follow``: the reader
        keeps what it restored (``keep_base=True``), as an evaluator or an inference worker that
        picks up every new checkpoint does; else each restore starts from nothing (chains differ in
        length from step to step)."""
        from ckptlib import Checkpointer

        out = {}
        with Checkpointer(self.root) as reader:
            for step in reader.steps():
                t0 = time.perf_counter()
                reader.restore(step, keep_base=follow)
                out[step] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        self.ck.close()


class TorchSaveRunner(Runner):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.last: str | None = None

    def save(self, step: int, state: Any) -> tuple[float, float]:
        path = os.path.join(self.root, f"{step}.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.root, directory=True)
        dt = time.perf_counter() - t0
        self.last = path
        return dt, dt

    def restore(self, template: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        state = torch.load(self.last, map_location="cpu", weights_only=True)
        return state, time.perf_counter() - t0


class DcpRunner(Runner):
    asynchronous = False

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.last: str | None = None

    def save(self, step: int, state: Any) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.root, f"step-{step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... single process"
            t0 = time.perf_counter()
            if self.asynchronous:
                fut = dcp.async_save(state, checkpoint_id=path, no_dist=True)
                t1 = time.perf_counter()
                fut.result()
            else:
                dcp.save(state, checkpoint_id=path, no_dist=True)
                t1 = time.perf_counter()
            t2 = time.perf_counter()
        self.last = path
        return t1 - t0, t2 - t0

    def restore_into(self, dest: Any) -> float:
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            dcp.load(dest, checkpoint_id=self.last, no_dist=True)
            return time.perf_counter() - t0

    def restore(self, template: Any) -> tuple[Any, float]:
        import torch.distributed.checkpoint as dcp

        # Tensors: uninitialised CPU memory; other values: a sentinel, so a value DCP did not load
        # shows up in the bit-exactness check instead of being copied from the template.
        target = map_tensors(template, cpu_empty, lambda _v: "<not loaded>")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            dcp.load(target, checkpoint_id=self.last, no_dist=True)
            dt = time.perf_counter() - t0
        return target, dt


class DcpAsyncRunner(DcpRunner):
    asynchronous = True


class MemcpyRunner(Runner):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        from concurrent.futures import ThreadPoolExecutor

        self.copy: Any = None
        self._dst: list[torch.Tensor] = []
        # Copies run in parallel over tensors with as many threads as ckptlib's default pool, so the
        # floor gets the same share of the cores as ckptlib's snapshot (copy_ releases the GIL).
        self._pool = ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 2) * 2))

    def save(self, step: int, state: Any) -> tuple[float, float]:
        t0 = time.perf_counter()
        if self.copy is None:  # first save: allocate the buffers (reused afterwards)
            self._dst = []

            def alloc(t: torch.Tensor) -> torch.Tensor:
                self._dst.append(cpu_empty(t))
                return self._dst[-1]

            self.copy = map_tensors(state, alloc, copy.deepcopy)
        srcs: list[torch.Tensor] = []
        values = map_tensors(state, lambda t: srcs.append(t), copy.deepcopy)
        list(self._pool.map(lambda pair: pair[0].copy_(pair[1].detach()), zip(self._dst, srcs)))
        self.copy = refill(self.copy, values)
        dt = time.perf_counter() - t0
        return dt, dt

    def restore(self, template: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        state = map_tensors(self.copy, lambda t: t.clone(), copy.deepcopy)
        return state, time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=True)


RUNNERS: dict[str, type[Runner]] = {
    "ckptlib": CkptlibRunner, "torch.save": TorchSaveRunner, "dcp": DcpRunner, "dcp_async": DcpAsyncRunner,
    "memcpy": MemcpyRunner,
}
SYSTEMS = tuple(RUNNERS)  # every system, in the order `ckpt bench` runs them by default
