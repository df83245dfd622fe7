"""The checkpoint benchmark: ckptlib against torch.save, DCP, DCP async and a plain memcpy, side by side.

Who calls what
--------------
``ckpt bench`` (``ckpt/cmd_bench.py``) builds a :class:`BenchConfig` and calls :func:`run_benchmark`,
then :func:`render_table` and :func:`check_targets`. Everything here is importable and has no CLI.

What one run does, per workload (DESIGN.md section 9)
-----------------------------------------------------
1. Train the workload for real, deterministically (seed 0, the workload's own data stream) and
   capture a series of ``saves`` states: ``steps_between`` optimizer steps, then a deep copy of
   ``checkpoint_state()``, repeated. The same captured states are what every system saves.
2. For each system in turn, in a fresh temporary directory: save the whole series (step numbers
   ``k * steps_between``), measuring per save the time the caller is blocked, the time until the
   checkpoint is durable, the bytes that landed in the directory and the peak RSS; then restore
   the latest checkpoint (once with its files evicted from the page cache, once warm) and check
   that the restored state is bit-identical to what was saved.
3. Each figure of a record is the mean over every save after the first (the first is a full
   keyframe for ckptlib and allocates buffers for ckptlib and memcpy; steady state is what a long
   run pays). Saving does not overlap training: the next save starts after the previous one is
   durable, so background work is timed without competing for the cores.

Systems
-------
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

Peak RSS
--------
Linux: before each save the kernel's high-water mark is reset (``echo 5 > /proc/self/clear_refs``)
and ``VmHWM`` is read from ``/proc/self/status`` once the save is durable: the exact peak of this
process over the save, no sampling. Where the reset is not available, a thread samples ``VmRSS``
every millisecond. ``peak_rss_bytes`` is that absolute peak (it includes the captured states and
the workload, the same for every system); ``peak_rss_delta_bytes`` subtracts the RSS measured right
before the system's first save (after ``gc.collect`` and ``malloc_trim``), so it shows what the
system itself holds: ckptlib keeps the previous checkpoint as its delta base and one snapshot.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptlib.testing.compare import first_difference

SYSTEMS = ("ckptlib", "torch.save", "dcp", "dcp_async", "memcpy")
DEFAULT_WORKLOADS = ("tinylm", "recsys", "finetune", "finetune-bf16")
# Training steps between two saves: finetune-bf16 is a publish stream (a bf16 copy of the weights
# after every step, for inference workers); the others checkpoint every 10 steps.
STEPS_BETWEEN = {"finetune-bf16": 1}
DEFAULT_STEPS_BETWEEN = 10
# Dense states, whose order-0 entropy (the bound of a coder without a model) the benchmark reports.
DENSE_WORKLOADS = ("tinylm",)
RECORD_KEYS = ("workload", "device", "system", "bytes_written", "blocked_s", "durable_s", "restore_s",
               "peak_rss_bytes")


@dataclass(frozen=True)
class BenchConfig:
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    saves: int = 17  # the mean is over saves 2..17: long enough for ckptlib's chains to end and restart
    steps_between: int | None = None  # None: each workload's own (STEPS_BETWEEN, else 10)
    size: str = "bench"
    store: str | None = None  # directory for the per-system temporary directories (default: system temp)
    device: str = "cpu"  # where the captured states live while they are saved: "cpu" | "cuda"
    systems: tuple[str, ...] = SYSTEMS
    seed: int = 0
    extra: dict = field(default_factory=dict)  # workload knobs (WorkloadConfig.extra), e.g. a bigger model

    def steps_for(self, workload: str) -> int:
        if self.steps_between is not None:
            return self.steps_between
        return STEPS_BETWEEN.get(workload, DEFAULT_STEPS_BETWEEN)

    def __post_init__(self) -> None:
        if self.saves < 2:
            raise ValueError(f"saves must be >= 2 (the mean is over every save after the first), got {self.saves}")
        if self.steps_between is not None and self.steps_between < 1:
            raise ValueError(f"steps_between must be >= 1, got {self.steps_between}")
        if self.size not in ("small", "bench"):
            raise ValueError(f"size must be 'small' or 'bench', got {self.size!r}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"unknown system(s) {unknown}: choose from {', '.join(SYSTEMS)}")
        if not self.workloads:
            raise ValueError("give at least one workload, e.g. tinylm,recsys,finetune")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available to this torch build; use --device cpu")


# --- states ----------------------------------------------------------------------------------

def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def map_tensors(state: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] = lambda x: x) -> Any:
    """A copy of ``state``'s containers with ``fn`` applied to tensors and ``other`` to other leaves."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, dict):
        return {k: map_tensors(v, fn, other) for k, v in state.items()}
    if isinstance(state, list):
        return [map_tensors(v, fn, other) for v in state]
    if isinstance(state, tuple):
        return tuple(map_tensors(v, fn, other) for v in state)
    return other(state)


def _cpu_empty(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


# --- memory --------------------------------------------------------------------------------------

def _proc_status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kib = _proc_status_kib("VmRSS")
    return None if kib is None else kib * 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_reset_works() -> bool:
    if not _reset_hwm():
        return False
    hwm, rss = _proc_status_kib("VmHWM"), _proc_status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 1024  # within 1 MiB of the current RSS


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS baselines mean something."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRss:
    """Peak RSS of this process over a ``with`` block (see the module docstring for the method)."""

    method: str = "unavailable"

    def __init__(self) -> None:
        if PeakRss.method == "unavailable" and os.path.exists("/proc/self/status"):
            PeakRss.method = "vmhwm-reset" if _hwm_reset_works() else "sampling-1ms"
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        if self.method == "vmhwm-reset":
            _reset_hwm()
        elif self.method == "sampling-1ms":
            self.peak = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            r = rss_bytes()
            if r is not None and (self.peak is None or r > self.peak):
                self.peak = r

    def __exit__(self, *exc) -> None:
        if self.method == "vmhwm-reset":
            kib = _proc_status_kib("VmHWM")
            self.peak = None if kib is None else kib * 1024
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            r = rss_bytes()
            if r is not None and (self.peak is None or r > self.peak):
                self.peak = r


# --- files ---------------------------------------------------------------------------------------

def dir_bytes(root: str) -> int:
    total = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def evict_page_cache(root: str) -> None:
    """Drop the cached pages of every (fsynced, hence clean) file under ``root``: a cold restore."""
    if not hasattr(os, "posix_fadvise"):
        return
    for folder, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- systems -------------------------------------------------------------------------------------

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
        _copy_tensors(dest, state)
        return seconds + time.perf_counter() - t0

    def close(self) -> None:
        pass


class CkptlibRunner(Runner):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        from ckptlib import Checkpointer

        self.ck = Checkpointer(root)
        self.infos: list[Any] = []

    def save(self, step: int, state: Any) -> tuple[float, float]:
        t0 = time.perf_counter()
        fut = self.ck.save_async(step, state)
        t1 = time.perf_counter()
        self.infos.append(fut.result())
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0

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
        _fsync_path(self.root, directory=True)
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
        target = map_tensors(template, _cpu_empty, lambda _v: "<not loaded>")
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
                self._dst.append(_cpu_empty(t))
                return self._dst[-1]

            self.copy = map_tensors(state, alloc, copy.deepcopy)
        srcs: list[torch.Tensor] = []
        values = map_tensors(state, lambda t: srcs.append(t), copy.deepcopy)
        list(self._pool.map(lambda pair: pair[0].copy_(pair[1].detach()), zip(self._dst, srcs)))
        self.copy = _refill(self.copy, values)
        dt = time.perf_counter() - t0
        return dt, dt

    def restore(self, template: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        state = map_tensors(self.copy, lambda t: t.clone(), copy.deepcopy)
        return state, time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _tensors(state: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(state, found.append)
    return found


def _copy_tensors(dest: Any, src: Any) -> None:
    """Copy every tensor of ``src`` into the tensor at the same place in ``dest``."""
    if isinstance(dest, torch.Tensor):
        dest.copy_(src)
    elif isinstance(dest, dict):
        for k in dest:
            _copy_tensors(dest[k], src[k])
    elif isinstance(dest, (list, tuple)):
        for d, v in zip(dest, src):
            _copy_tensors(d, v)


def _refill(buffers: Any, values: Any) -> Any:
    """``buffers``' tensors with ``values``' non-tensor leaves (same structure)."""
    if isinstance(buffers, torch.Tensor):
        return buffers
    if isinstance(buffers, dict):
        return {k: _refill(buffers[k], values[k]) for k in buffers}
    if isinstance(buffers, (list, tuple)):
        return type(buffers)(_refill(b, v) for b, v in zip(buffers, values))
    return values


RUNNERS: dict[str, type[Runner]] = {
    "ckptlib": CkptlibRunner, "torch.save": TorchSaveRunner, "dcp": DcpRunner, "dcp_async": DcpAsyncRunner,
    "memcpy": MemcpyRunner,
}


# --- the run -------------------------------------------------------------------------------------

@dataclass
class Series:
    """The captured states of one workload."""

    workload: str
    steps: list[int]
    states: list[Any]
    state_bytes: int
    train_s: float
    losses: list[float] = field(default_factory=list)


def _published_state(name: str, wl: Any) -> Any:
    """What the series saves: the checkpoint state, except for finetune-bf16, whose stream is the bf16
    copy of the weights published after every step (to evaluators or inference workers)."""
    state = wl.checkpoint_state()
    return state["weights_bf16"] if name == "finetune-bf16" else state


def capture_states(name: str, cfg: BenchConfig) -> Series:
    """Train ``name`` for real and copy its checkpoint state every ``steps_between`` steps."""
    from workloads.base import WorkloadConfig, build_workload, clone_state, state_nbytes

    wl = build_workload(WorkloadConfig(name=name, seed=cfg.seed, size=cfg.size, extra=dict(cfg.extra)))
    steps, states, losses = [], [], []
    train_s = 0.0
    for _ in range(cfg.saves):
        t0 = time.perf_counter()
        for _ in range(cfg.steps_for(name)):
            loss = wl.train_step()
        train_s += time.perf_counter() - t0
        state = clone_state(_published_state(name, wl))
        if cfg.device != "cpu":
            state = map_tensors(state, lambda t: t.to(cfg.device))
        steps.append(wl.data_position)
        states.append(state)
        losses.append(loss)
    del wl
    return Series(name, steps, states, state_nbytes(states[-1]), train_s, losses)


def measure_system(system: str, series: Series, cfg: BenchConfig) -> dict[str, Any]:
    """Save the whole series with one system, restore the latest, and return its record."""
    release_free_memory()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    baseline = rss_bytes()
    root = tempfile.mkdtemp(prefix=f"ckpt-bench-{system.replace('.', '_')}-", dir=cfg.store)
    runner = RUNNERS[system](root)
    blocked, durable, written, peaks = [], [], [], []
    try:
        for step, state in zip(series.steps, series.states):
            before = dir_bytes(root)
            with PeakRss() as peak:
                b, d = runner.save(step, state)
            blocked.append(b)
            durable.append(d)
            written.append(dir_bytes(root) - before)
            peaks.append(peak.peak)
        template = series.states[-1]
        release_free_memory()
        held = None if baseline is None else rss_bytes() - baseline  # what the system keeps between saves
        expected = map_tensors(template, lambda t: t) if cfg.device == "cpu" else map_tensors(template, lambda t: t.cpu())
        fresh_peak, into_peak = _restore_peaks(runner, template)
        evict_page_cache(root)
        restored, restore_cold = runner.restore(template)
        exact = first_difference(expected, restored, exact_types=False) is None
        del restored
        restored, restore_warm = runner.restore(template)
        diff = first_difference(expected, restored, exact_types=False)
        exact = exact and diff is None
        del restored
        extra: dict[str, Any] = {}
        if isinstance(runner, CkptlibRunner):
            infos = runner.infos[1:]
            per_step = runner.restore_each_step(follow=False)
            following = runner.restore_each_step(follow=True)
            extra = {"restore_worst_s": max(per_step.values()), "restore_per_step_s": per_step,
                     "restore_follow_s": statistics.median(list(following.values())[1:] or list(following.values())),
                     "ckptlib_reported_bytes_written": statistics.fmean(i.bytes_written for i in infos),
                     "ckptlib_kinds": [i.kind for i in runner.infos],
                     "final_digest": runner.infos[-1].digest}
    finally:
        runner.close()
        shutil.rmtree(root, ignore_errors=True)
    tail = slice(1, None)  # every save after the first
    peak_values = [p for p in peaks[tail] if p is not None]
    peak_mean = statistics.fmean(peak_values) if peak_values else None
    record = {
        "workload": series.workload,
        "device": cfg.device,
        "system": system,
        "bytes_written": statistics.fmean(written[tail]),
        "blocked_s": statistics.fmean(blocked[tail]),
        "durable_s": statistics.fmean(durable[tail]),
        "restore_s": restore_warm,
        "peak_rss_bytes": peak_mean,
        "held_bytes": held,  # RSS after the series, above the RSS before its first save
        "restore_peak_bytes": fresh_peak,  # peak RSS of a restore (allocations included) above before it
        "restore_into_peak_bytes": into_peak,  # peak RSS of a restore into allocated tensors, above before it
        # context
        "restore_cold_s": restore_cold,
        "peak_rss_delta_bytes": None if peak_mean is None or baseline is None else peak_mean - baseline,
        "rss_method": PeakRss.method,
        "restore_exact": exact,
        "first_bytes_written": written[0],
        "state_bytes": series.state_bytes,
        "size": cfg.size,
        "saves": cfg.saves,
        "steps_between": cfg.steps_for(series.workload),
        "threads": torch.get_num_threads(),
        "loadavg_1min": [load_before, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
        "blocked_median_s": statistics.median(blocked[tail]),
        "durable_median_s": statistics.median(durable[tail]),
        "per_save": {"blocked_s": blocked, "durable_s": durable, "bytes_written": written, "peak_rss_bytes": peaks},
        "cpus": os.cpu_count(),
        **extra,
    }
    if not exact:
        record["restore_difference"] = diff
    return record


def _restore_peaks(runner: Runner, template: Any) -> tuple[int | None, int | None]:
    """(peak RSS of a restore that allocates what it returns, peak RSS of a restore into tensors
    allocated beforehand), each above the RSS right before it."""
    release_free_memory()
    before = rss_bytes()
    with PeakRss() as fresh:
        restored, _ = runner.restore(template)
    del restored
    dest = map_tensors(template, lambda t: torch.zeros(t.shape, dtype=t.dtype), copy.deepcopy)
    release_free_memory()
    before_into = rss_bytes()
    with PeakRss() as into:
        runner.restore_into(dest)
    del dest
    release_free_memory()
    if before is None or fresh.peak is None or into.peak is None or before_into is None:
        return None, None
    return fresh.peak - before, into.peak - before_into


def entropy_bound(series: Series) -> float | None:
    """How many times smaller than the state the last save could be with an ideal order-0 coder
    of its byte planes (per plane, no model across bytes): of the state itself (a keyframe) and of
    its element-wise integer difference from the save before (a dense delta), whichever is smaller.
    The bound for any coder that, like zstd's entropy stage, codes bytes independently."""
    if len(series.states) < 2:
        return None
    from ckptlib import codecs

    def plane_bits(raw: Any, itemsize: int) -> float:
        planes = raw.reshape(-1, itemsize).T if itemsize > 1 else raw.reshape(1, -1)
        bits = 0.0
        for plane in planes:
            counts = torch.bincount(torch.from_numpy(plane.copy()), minlength=256).double()
            p = counts[counts > 0] / plane.size
            bits += float(-(p * p.log2()).sum()) * plane.size
        return bits

    total = key_bits = delta_bits = 0.0
    for t, o in zip(_tensors(series.states[-1]), _tensors(series.states[-2])):
        raw, base = _raw_bytes(t).numpy(), _raw_bytes(o).numpy()
        k = t.element_size()
        total += raw.size
        key_bits += plane_bits(raw, k)
        if k in (1, 2, 4, 8) and base.size == raw.size:
            delta_bits += plane_bits(codecs.ArithDelta(k, t.is_floating_point()).encode(raw, base), k)
        else:
            delta_bits += plane_bits(raw, k)
    best = min(key_bits, delta_bits) / 8
    return total / best if best else None


def run_benchmark(cfg: BenchConfig, progress: Callable[[str], None] = lambda _msg: None) -> list[dict[str, Any]]:
    """Every (workload, system) record, workload by workload, systems in ``cfg.systems`` order."""
    records = []
    for name in cfg.workloads:
        progress(f"{name}: training {cfg.saves} x {cfg.steps_for(name)} steps ({cfg.size})")
        series = capture_states(name, cfg)
        progress(f"{name}: state {series.state_bytes / 2**20:.1f} MiB, trained in {series.train_s:.1f} s")
        bound = entropy_bound(series) if name in DENSE_WORKLOADS else None
        for system in cfg.systems:
            t0 = time.perf_counter()
            rec = measure_system(system, series, cfg)
            rec["train_s"] = series.train_s
            if system == "ckptlib" and bound is not None:
                rec["entropy_bound_x"] = bound
            records.append(rec)
            progress(f"{name}: {system} done in {time.perf_counter() - t0:.1f} s")
        del series
        release_free_memory()
    return records


# --- reporting -----------------------------------------------------------------------------------

def _find(records: list[dict], workload: str, system: str) -> dict | None:
    return next((r for r in records if r["workload"] == workload and r["system"] == system), None)


def ratios(record: dict, records: list[dict]) -> dict[str, float | None]:
    """x smaller than torch.save (bytes), restore / torch.load and / DCP load (latest, worst),
    blocked / memcpy, memory held and restore peaks / state size."""
    ts = _find(records, record["workload"], "torch.save")
    mc = _find(records, record["workload"], "memcpy")
    dcp = _find(records, record["workload"], "dcp")
    state = record.get("state_bytes") or 0

    def over(value: float | None, reference: float | None) -> float | None:
        return None if value is None or not reference else value / reference

    return {
        "bytes_x_smaller": over(ts["bytes_written"], record["bytes_written"]) if ts and record["bytes_written"] else None,
        "restore_vs_torch": over(record["restore_s"], ts["restore_s"]) if ts else None,
        "restore_vs_dcp": over(record["restore_s"], dcp["restore_s"]) if dcp else None,
        "worst_vs_dcp": over(record.get("restore_worst_s"), dcp["restore_s"]) if dcp else None,
        "blocked_vs_memcpy": over(record["blocked_s"], mc["blocked_s"]) if mc else None,
        "held_x": over(record.get("held_bytes"), state),
        "restore_peak_x": over(record.get("restore_peak_bytes"), state),
        "into_peak_x": over(record.get("restore_into_peak_bytes"), state),
    }


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


TABLE_COLUMNS = ("workload", "system", "MiB/ckpt", "x smaller vs torch.save", "blocked ms", "vs memcpy",
                 "durable ms", "restore ms", "vs DCP load", "worst restore ms", "worst vs DCP", "follower ms",
                 "held / state", "restore peak / state", "into peak / state")


def table_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    for r in records:
        q = ratios(r, records)
        bound = f" (bound {r['entropy_bound_x']:.2f}x)" if r.get("entropy_bound_x") else ""
        rows.append([r["workload"], r["system"], _mib(r["bytes_written"]),
                     "-" if r["system"] == "memcpy" else _x(q["bytes_x_smaller"], 2) + bound,
                     _ms(r["blocked_s"]), _x(q["blocked_vs_memcpy"]), _ms(r["durable_s"]), _ms(r["restore_s"]),
                     _x(q["restore_vs_dcp"]), _ms(r.get("restore_worst_s")), _x(q["worst_vs_dcp"]),
                     _ms(r.get("restore_follow_s")), _x(q["held_x"]), _x(q["restore_peak_x"]), _x(q["into_peak_x"])])
    return rows


def render_table(records: list[dict], title: str = "checkpoint benchmark"):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, name in enumerate(TABLE_COLUMNS):
        table.add_column(name, justify="left" if i < 2 else "right")
    last = None
    for row in table_rows(records):
        if last is not None and row[0] != last:
            table.add_section()
        last = row[0]
        table.add_row(*row)
    return table


def markdown_table(records: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(records)]
    return "\n".join(lines)


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None
    limit: float
    passed: bool | None  # None: not measured in this run

    def __str__(self) -> str:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[self.passed]
        value = "-" if self.measured is None else f"{self.measured:.2f}"
        return f"{self.name}: {value} (limit {self.limit:g}) -> {verdict}"


# The issues' targets: bytes (x smaller than torch.save, >=), restore (x DCP load, latest and worst, <=),
# blocked (x memcpy, <=), memory (x the state, <=).
BYTES_TARGETS = {"recsys": 60.0, "finetune": 37.0, "tinylm": 1.3, "finetune-bf16": 22.0}
RESTORE_DCP_LIMIT = 1.0
WORST_DCP_LIMIT = 1.5
BLOCKED_LIMIT = 1.5
MEMORY_LIMITS = {"held_x": 1.25, "into_peak_x": 0.35, "restore_peak_x": 1.35}


def check_targets(records: list[dict]) -> list[Target]:
    out = []
    workloads = list(dict.fromkeys(r["workload"] for r in records))

    def target(name: str, value: float | None, limit: float, at_least: bool = False) -> Target:
        ok = None if value is None else (value >= limit if at_least else value <= limit)
        return Target(name, value, limit, ok)

    for w in workloads:
        ours = _find(records, w, "ckptlib")
        q = ratios(ours, records) if ours else {}
        if w in BYTES_TARGETS:
            out.append(target(f"{w}: ckptlib bytes x smaller than torch.save (>=)", q.get("bytes_x_smaller"),
                              BYTES_TARGETS[w], at_least=True))
        out.append(target(f"{w}: ckptlib restore latest / DCP load (<=)", q.get("restore_vs_dcp"), RESTORE_DCP_LIMIT))
        out.append(target(f"{w}: ckptlib restore worst step / DCP load (<=)", q.get("worst_vs_dcp"), WORST_DCP_LIMIT))
        out.append(target(f"{w}: ckptlib CPU blocked / memcpy (<=)",
                          q.get("blocked_vs_memcpy") if ours and ours["device"] == "cpu" else None, BLOCKED_LIMIT))
        for key, limit in MEMORY_LIMITS.items():
            label = {"held_x": "memory held after saves", "into_peak_x": "restore(into=) peak above the tensors",
                     "restore_peak_x": "restore() peak"}[key]
            out.append(target(f"{w}: ckptlib {label} / state (<=)", q.get(key), limit))
    return out
