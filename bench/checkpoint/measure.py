"""One benchmark run: every system saves the same captured series, then restores the latest.

What one run does, per workload
-------------------------------
1. Train the workload for real and capture a series of ``saves`` states (``series.py``). The same
   captured states are what every system saves.
2. For each system in turn (``contenders.py``), in a fresh temporary directory: save the whole
   series (step numbers ``k * steps_between``), measuring per save the time the caller is blocked,
   the time until the checkpoint is durable, the bytes that landed in the directory and the peak
   RSS (``probes.py``); then restore the latest checkpoint (once with its files evicted from the
   page cache, once warm) and check that the restored state is the saved one, bit for bit
   (``ckptlib.testing.compare``, ``exact_types=False``: DCP and the memcpy floor give plain dicts
   and tensors back; the bytes, dtypes, shapes, keys and value types must be the same).
3. The times of the saves, once more, interleaved (``_time_interleaved``): every system saves
   state ``k`` into a store of its own before any saves state ``k + 1``, in an order that rotates
   from save to save. A cloud VM's disk does not write at one speed for minutes (here, a
   ``torch.save`` + fsync of the same 256 MiB took 0.26 s in one pass and 0.9 s ten minutes
   later), so the save times of systems measured one after the other compare their disks'
   moods as much as the systems. ``durable_s`` is the interleaved pass's; the first pass's, where
   each system ran alone, stays in the record as ``durable_alone_s``. ``blocked_s`` (no disk in
   it) is the first pass's.
4. Each figure of a record is the mean over every save after the first (the first is a full
   keyframe for ckptlib and allocates buffers for ckptlib and memcpy; steady state is what a long
   run pays). Saving does not overlap training: the next save starts after the previous one is
   durable, so background work is timed without competing for the cores.

``peak_rss_bytes`` is the absolute peak over a save (it includes the captured states and the
workload, the same for every system); ``peak_rss_delta_bytes`` subtracts the RSS measured right
before the system's first save (after ``gc.collect`` and ``malloc_trim``), so it shows what the
system itself holds: ckptlib keeps the previous checkpoint as its delta base and one snapshot.
"""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptlib.testing.compare import first_difference

from .config import BenchConfig
from .contenders import RUNNERS, CkptlibRunner, Runner
from .entropy import entropy_bound
from .probes import PeakRss, evict_page_cache, release_free_memory, rss_bytes
from .series import Series, capture_states
from .trees import map_tensors

# Dense states, whose order-0 entropy (the bound of a coder without a model) the benchmark reports.
DENSE_WORKLOADS = ("tinylm", "dense-lm")
RECORD_KEYS = ("workload", "device", "system", "bytes_written", "blocked_s", "durable_s", "restore_s",
               "peak_rss_bytes")


@dataclass
class _Saves:
    """Per save of the series, in order."""

    blocked: list[float] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    peaks: list[int | None] = field(default_factory=list)
    before: list[int | None] = field(default_factory=list)  # RSS right before each save


@dataclass(frozen=True)
class _Restores:
    """The restores of the latest step: seconds, peaks above the RSS before them, bit-exactness."""

    cold_s: float
    warm_s: float
    fresh_peak: int | None
    into_peak: int | None
    difference: str | None  # None: every restore was bit-exact


def run_benchmark(cfg: BenchConfig, progress: Callable[[str], None] = lambda _msg: None) -> list[dict[str, Any]]:
    """Every (workload, system) record, workload by workload, systems in ``cfg.systems`` order."""
    records = []
    for name in cfg.workloads:
        progress(f"{name}: training {cfg.saves} x {cfg.steps_for(name)} steps ({cfg.size})")
        series = capture_states(name, cfg)
        progress(f"{name}: state {series.state_bytes / 2**20:.1f} MiB, trained in {series.train_s:.1f} s")
        check_disk_room(series, cfg)
        bound = entropy_bound(series) if name in DENSE_WORKLOADS else None
        ours = []
        for system in cfg.systems:
            t0 = time.perf_counter()
            rec = measure_system(system, series, cfg)
            rec["train_s"] = series.train_s
            if system == "ckptlib" and bound is not None:
                rec["entropy_bound_x"] = bound
            ours.append(rec)
            progress(f"{name}: {system} done in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        _use_interleaved(ours, _time_interleaved(series, cfg))
        progress(f"{name}: the saves again, interleaved, in {time.perf_counter() - t0:.1f} s")
        records.extend(ours)
        del series
        release_free_memory()
    return records


def check_disk_room(series: Series, cfg: BenchConfig) -> None:
    """Refuse (ValueError naming the need and the fixes) a series whose stores do not fit the disk
    of ``cfg.store``: the interleaved pass holds every system's store at once, each at most the raw
    state per save (ckptlib's is smaller, memcpy writes nothing), and a full disk would stop the run
    midway with another library's error (DCP's "unexpected pos")."""
    writers = [s for s in cfg.systems if s != "memcpy"]
    need = series.state_bytes * len(series.states) * len(writers) * 21 // 20  # 5% for files' metadata
    where = cfg.store or tempfile.gettempdir()
    free = shutil.disk_usage(where).free
    if need > free:
        raise ValueError(
            f"{series.workload}: the benchmark's stores need about {need / 2**20:,.0f} MiB in {where} "
            f"({len(writers)} systems x {len(series.states)} saves of {series.state_bytes / 2**20:.1f} MiB), and "
            f"{free / 2**20:,.0f} MiB are free there: pass --store DIR on a disk with room, or fewer --saves, "
            "--systems or --workloads")


def measure_system(system: str, series: Series, cfg: BenchConfig) -> dict[str, Any]:
    """Save the whole series with one system, restore the latest, and return its record."""
    release_free_memory()
    load_before = _load_1min()
    baseline = rss_bytes()
    root = tempfile.mkdtemp(prefix=f"ckpt-bench-{system.replace('.', '_')}-", dir=cfg.store)
    runner = RUNNERS[system](root)
    try:
        saves = _save_series(runner, series, root)
        release_free_memory()
        now = rss_bytes()
        held = None if baseline is None or now is None else now - baseline  # what the system keeps between saves
        restores = _restore_latest(runner, series.states[-1], cfg, root)
        extra = _ckptlib_figures(runner) if isinstance(runner, CkptlibRunner) else {}
    finally:
        runner.close()
        shutil.rmtree(root, ignore_errors=True)
    record = _record(system, series, cfg, saves, restores, baseline, held)
    record["loadavg_1min"] = [load_before, _load_1min()]
    record["blocked_median_s"] = statistics.median(saves.blocked[1:])
    record["durable_median_s"] = statistics.median(saves.durable[1:])
    record["per_save"] = {"blocked_s": saves.blocked, "durable_s": saves.durable, "bytes_written": saves.written,
                          "peak_rss_bytes": saves.peaks, "rss_before_bytes": saves.before}
    record["cpus"] = os.cpu_count()
    record.update(extra)
    if restores.difference is not None:
        record["restore_difference"] = restores.difference
    return record


def _time_interleaved(series: Series, cfg: BenchConfig) -> dict[str, _Saves]:
    """(blocked, durable) of every save of every system, state by state: each system saves state
    ``k`` into a fresh store of its own before any saves state ``k + 1``, starting one system
    further on each time, so that a disk's drift is shared out evenly."""
    roots = {s: tempfile.mkdtemp(prefix=f"ckpt-bench-{s.replace('.', '_')}-timed-", dir=cfg.store)
             for s in cfg.systems}
    runners: dict[str, Runner] = {}
    timed = {s: _Saves() for s in cfg.systems}
    try:
        for s in cfg.systems:
            runners[s] = RUNNERS[s](roots[s])
        order = list(cfg.systems)
        for k, (step, state) in enumerate(zip(series.steps, series.states)):
            for s in order[k % len(order):] + order[:k % len(order)]:
                blocked, durable = runners[s].save(step, state)
                timed[s].blocked.append(blocked)
                timed[s].durable.append(durable)
                runners[s].settle()
    finally:
        for runner in runners.values():
            runner.close()
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    return timed


def _use_interleaved(records: list[dict[str, Any]], timed: dict[str, _Saves]) -> None:
    """Make the interleaved pass's durable times the records' (the disk's share of a save); keep
    each system's time alone beside it. Blocked time touches no disk: it stays the first pass's,
    where each system ran alone (in the interleaved pass the memcpy floor itself took 1.6-5x its
    time alone, behind the other systems' memory), and the interleaved one is kept per save."""
    for rec in records:
        saves = timed[rec["system"]]
        rec["durable_alone_s"], rec["durable_median_alone_s"] = rec["durable_s"], rec["durable_median_s"]
        rec["durable_s"], rec["durable_median_s"] = statistics.fmean(saves.durable[1:]), statistics.median(saves.durable[1:])
        rec["per_save"]["durable_interleaved_s"] = saves.durable
        rec["per_save"]["blocked_interleaved_s"] = saves.blocked


def _load_1min() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _save_series(runner: Runner, series: Series, root: str) -> _Saves:
    saves = _Saves()
    for step, state in zip(series.steps, series.states):
        before = runner.stored_bytes()
        saves.before.append(rss_bytes())
        with PeakRss() as peak:
            b, d = runner.save(step, state)
        saves.blocked.append(b)
        saves.durable.append(d)
        saves.written.append(runner.stored_bytes() - before)
        saves.peaks.append(peak.peak)
        runner.settle()
    return saves


def _restore_latest(runner: Runner, template: Any, cfg: BenchConfig, root: str) -> _Restores:
    """Peaks of a restore and of a restore into allocated tensors, then a cold and a warm restore,
    each checked against ``template`` (the latest saved state) bit for bit."""
    expected = map_tensors(template, lambda t: t) if cfg.device == "cpu" else map_tensors(template, lambda t: t.cpu())
    fresh_peak, into_peak = _restore_peaks(runner, template)
    evict_page_cache(root)
    restored, cold_s = runner.restore(template)
    difference = first_difference(expected, restored, exact_types=False)
    del restored
    restored, warm_s = runner.restore(template)
    difference = difference or first_difference(expected, restored, exact_types=False)
    del restored
    return _Restores(cold_s, warm_s, fresh_peak, into_peak, difference)


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


def _ckptlib_figures(runner: CkptlibRunner) -> dict[str, Any]:
    """What only ckptlib reports: the restore of every step, a follower's, its own byte counts."""
    infos = runner.infos[1:]
    per_step = runner.restore_each_step(follow=False)
    following = runner.restore_each_step(follow=True)
    return {"restore_worst_s": max(per_step.values()), "restore_per_step_s": per_step,
            "restore_follow_s": statistics.median(list(following.values())[1:] or list(following.values())),
            "ckptlib_reported_bytes_written": statistics.fmean(i.bytes_written for i in infos),
            # written after each commit, beside the stream (not in bytes_written): the latest step's keyframes
            "compaction_bytes": statistics.fmean(runner.compaction_bytes[1:] or [0]),
            "compaction_s": runner.ck.compaction_seconds / max(1, len(runner.compaction_bytes)),
            "ckptlib_kinds": [i.kind for i in runner.infos],
            "final_digest": runner.infos[-1].digest}


def _record(system: str, series: Series, cfg: BenchConfig, saves: _Saves, restores: _Restores,
            baseline: int | None, held: int | None) -> dict[str, Any]:
    """The record's figures: means over every save after the first, then the context."""
    tail = slice(1, None)
    peak_values = [p for p in saves.peaks[tail] if p is not None]
    peak_mean = statistics.fmean(peak_values) if peak_values else None
    extra = [p - b for p, b in zip(saves.peaks[tail], saves.before[tail]) if p is not None and b is not None]
    return {
        "workload": series.workload,
        "device": cfg.device,
        "system": system,
        "bytes_written": statistics.fmean(saves.written[tail]),
        "blocked_s": statistics.fmean(saves.blocked[tail]),
        "durable_s": statistics.fmean(saves.durable[tail]),
        "restore_s": restores.warm_s,
        "peak_rss_bytes": peak_mean,
        "held_bytes": held,  # RSS after the series, above the RSS before its first save
        # what a save adds at its peak to the RSS right before it (what the system already holds excluded)
        "save_peak_extra_bytes": max(0.0, statistics.fmean(extra)) if extra else None,
        "restore_peak_bytes": restores.fresh_peak,  # peak RSS of a restore (allocations included) above before it
        "restore_into_peak_bytes": restores.into_peak,  # peak RSS of a restore into allocated tensors, above before it
        # context
        "restore_cold_s": restores.cold_s,
        "peak_rss_delta_bytes": None if peak_mean is None or baseline is None else peak_mean - baseline,
        "rss_method": PeakRss.method,
        "restore_exact": restores.difference is None,
        "first_bytes_written": saves.written[0],
        "state_bytes": series.state_bytes,
        "size": cfg.size,
        "saves": cfg.saves,
        "steps_between": cfg.steps_for(series.workload),
        "threads": torch.get_num_threads(),
    }
