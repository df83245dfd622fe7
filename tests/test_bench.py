"""`ckpt bench` produces complete, correct records. No timing is asserted: speed is the benchmark's
business (docs/benchmark.md), not the tests'. Byte ratios that follow from the workloads' structure are."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from bench.checkpoint.config import BenchConfig
from bench.checkpoint.contenders import SYSTEMS
from bench.checkpoint.measure import RECORD_KEYS, check_disk_room, run_benchmark
from bench.checkpoint.probes import PeakRss
from bench.checkpoint.report import check_targets, markdown_table
from bench.checkpoint.series import Series, capture_states
from ckpt.cli import app

runner = CliRunner()


def test_bench_cli_writes_records_for_all_five_systems(tmp_path):
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["bench", "--size", "small", "--saves", "3", "--workloads", "tinylm",
                                 "--steps-between", "1", "--json", str(out), "--store", str(tmp_path)])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert [r["system"] for r in records] == list(SYSTEMS)
    for r in records:
        for key in RECORD_KEYS:
            assert key in r and r[key] is not None, (r["system"], key)
        assert r["workload"] == "tinylm" and r["device"] == "cpu"
        assert r["restore_exact"], (r["system"], r.get("restore_difference"))
        assert len(r["per_save"]["blocked_s"]) == 3
        # durable times are the interleaved pass's (every system saved state k before any saved k+1)
        interleaved = r["per_save"]["durable_interleaved_s"]
        assert len(interleaved) == 3 and r["durable_s"] == pytest.approx(sum(interleaved[1:]) / 2)
        assert r["durable_alone_s"] == pytest.approx(sum(r["per_save"]["durable_s"][1:]) / 2)
        assert r["blocked_s"] > 0 and r["durable_alone_s"] >= r["blocked_s"] and r["durable_s"] > 0 and r["restore_s"] > 0
        assert r["peak_rss_bytes"] > 0
    by = {r["system"]: r for r in records}
    assert by["memcpy"]["bytes_written"] == 0
    assert by["torch.save"]["bytes_written"] >= by["torch.save"]["state_bytes"]  # a full copy every time
    assert by["ckptlib"]["bytes_written"] < by["torch.save"]["bytes_written"]
    kinds = by["ckptlib"]["ckptlib_kinds"]  # per save; dense deltas that save < 25% are keyframes now
    assert len(kinds) == 3 and kinds[0] == "keyframe" and set(kinds) <= {"keyframe", "delta"}
    assert by["torch.save"]["save_peak_extra_bytes"] is not None and by["ckptlib"]["save_peak_extra_bytes"] is not None
    per_step = by["ckptlib"]["restore_per_step_s"]  # every committed step restored, the slowest reported
    assert len(per_step) == 3 and by["ckptlib"]["restore_worst_s"] == max(per_step.values())
    assert "ckptlib" in result.stdout and "torch.save" in result.stdout  # the table
    assert list(tmp_path.iterdir()) == [out]  # every per-system temporary store was removed


def test_frozen_backbone_checkpoints_are_much_smaller_than_torch_save(tmp_path):
    cfg = BenchConfig(workloads=("finetune",), saves=2, steps_between=1, size="small", store=str(tmp_path),
                            systems=("ckptlib", "torch.save"))
    records = run_benchmark(cfg)
    ours, theirs = records
    assert ours["system"] == "ckptlib" and ours["restore_exact"] and theirs["restore_exact"]
    assert ours["bytes_written"] * 3 < theirs["bytes_written"]  # only LoRA + head + moments change


def test_bench_rejects_unknown_workloads_and_systems():
    result = runner.invoke(app, ["bench", "--workloads", "nope"])
    assert result.exit_code == 2 and "unknown workload" in result.stderr and "Traceback" not in result.output
    result = runner.invoke(app, ["bench", "--systems", "ckptlib,tape"])
    assert result.exit_code == 2 and "unknown system" in result.stderr


def test_a_series_whose_stores_do_not_fit_the_disk_is_refused_before_any_save(tmp_path):
    """The interleaved pass holds every system's store at once (dense-lm's 17 saves: about 17 GB):
    on a disk without that room the run is refused up front, naming the need and the fixes, where
    it used to stop midway in DCP's writer ("unexpected pos")."""
    free = __import__("shutil").disk_usage(tmp_path).free
    huge = Series("dense-lm", [0, 1], [{}, {}], state_bytes=free, train_s=0.0)  # 4 systems x 2 saves x the free space
    cfg = BenchConfig(workloads=("dense-lm",), saves=2, store=str(tmp_path))
    with pytest.raises(ValueError, match=r"dense-lm: the benchmark's stores need about .* MiB in .*--store DIR"):
        check_disk_room(huge, cfg)
    check_disk_room(Series("tinylm", [0, 1], [{}, {}], state_bytes=1 << 20, train_s=0.0), cfg)  # 8 MiB: room
    memcpy_only = BenchConfig(workloads=("dense-lm",), saves=2, store=str(tmp_path), systems=("memcpy",))
    check_disk_room(huge, memcpy_only)  # writes nothing
    assert list(tmp_path.iterdir()) == []


def test_peak_rss_sees_an_allocation():
    with PeakRss() as quiet:
        pass
    with PeakRss() as busy:
        block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched
        del block
    assert busy.peak - quiet.peak > 48 << 20


def test_targets_and_ratios_from_records():
    def rec(system, nbytes, blocked, restore, **more):
        return {"workload": "recsys", "device": "cpu", "system": system, "bytes_written": nbytes,
                "blocked_s": blocked, "durable_s": blocked, "restore_s": restore, "peak_rss_bytes": 1,
                "state_bytes": 100e6, **more}

    records = [rec("ckptlib", 0.4e6, 0.012, 0.2, restore_worst_s=0.4, held_bytes=110e6, restore_peak_bytes=150e6,
                   restore_into_peak_bytes=10e6),
               rec("torch.save", 30e6, 1.0, 0.1), rec("dcp", 30e6, 1.0, 0.25), rec("memcpy", 0, 0.01, 0.05)]
    targets = {t.name.split(":")[1].strip(): t for t in check_targets(records)}
    assert targets["ckptlib bytes x smaller than torch.save (>=)"].passed  # 75x >= 60x
    assert targets["ckptlib CPU blocked / memcpy (<=)"].passed  # 1.2x <= 1.5x
    latest = targets["ckptlib restore latest / DCP load (<=)"]
    assert latest.passed and latest.measured == 0.8
    assert not targets["ckptlib restore worst step / DCP load (<=)"].passed  # 1.6x > 1.5x
    assert targets["ckptlib memory held after saves / state (<=)"].passed  # 1.1x
    assert not targets["ckptlib restore() peak / state (<=)"].passed  # 1.5x > 1.35x
    assert targets["ckptlib restore(into=) peak above the tensors / state (<=)"].passed  # 0.1x
    assert "| recsys | ckptlib | 0.4 | 75.00x |" in markdown_table(records)


def test_dense_targets_against_torch_save_and_load():
    def rec(system, nbytes, durable, restore, **more):
        return {"workload": "dense-lm", "device": "cpu", "system": system, "bytes_written": nbytes,
                "blocked_s": 0.03, "durable_s": durable, "restore_s": restore, "peak_rss_bytes": 1,
                "state_bytes": 256e6, **more}

    records = [rec("ckptlib", 200e6, 0.45, 0.09, save_peak_extra_bytes=20e6, compaction_bytes=3 * 2**20),
               rec("torch.save", 256e6, 0.5, 0.08, save_peak_extra_bytes=0.0)]
    targets = {t.name.split(":")[1].strip(): t for t in check_targets(records)}
    assert not targets["ckptlib bytes x smaller than torch.save (>=)"].passed  # 1.28x < 1.33x (0.78x the bytes)
    save = targets["ckptlib periodic save (durable) / torch.save + fsync (<=)"]
    assert save.passed and save.measured == 0.9
    assert not targets["ckptlib fresh restore / torch.load (<=)"].passed  # 1.125x
    assert targets["ckptlib save peak above before it / state (<=)"].passed  # 0.08x
    table = markdown_table(records)
    assert "| dense-lm | ckptlib | 190.7 | 1.28x | 3.0 | 30.0 | - | 450.0 | 0.90x | 90.0 | 1.12x |" in table
    assert "| dense-lm | torch.save | 244.1 | 1.00x | - | 30.0 |" in table  # compaction: ckptlib's own column


def test_workload_extra_sizes_the_state_and_bad_json_is_refused(tmp_path):
    def state_bytes(extra):  # the captured series every system saves (a record's state_bytes is its size)
        cfg = BenchConfig(workloads=("tinylm",), saves=2, steps_between=1, size="small", store=str(tmp_path),
                          systems=("ckptlib",), extra=extra)
        return capture_states("tinylm", cfg).state_bytes

    assert state_bytes({"d_model": 64}) < state_bytes({})
    result = runner.invoke(app, ["bench", "--workload-extra", "{d_model: 64}"])
    assert result.exit_code == 2 and "--workload-extra is not valid JSON" in result.stderr


def test_gpu_check_stops_at_once_without_a_cuda_device(tmp_path):
    """bench/gpu_check.sh on a machine without CUDA (this one) says so and exits non-zero before
    training anything, instead of running a CPU benchmark under a GPU name."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        return  # on a GPU machine the script runs the real check (minutes): not a unit test
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "sees no CUDA device" in done.stderr and "run this on a GPU machine" in done.stderr
    assert not (tmp_path / "gpu-bench.json").exists()


@pytest.mark.s3
def test_bench_s3_measures_ckptlib_and_the_parallel_client_on_a_real_seaweedfs(tmp_path):
    """`ckpt bench --s3`: the bench starts SeaweedFS itself; both systems save and restore the same
    8 MiB (each restore checked against the saved digest in its child) and their rows are complete."""
    out = tmp_path / "s3.json"
    result = runner.invoke(app, ["bench", "--s3", "--s3-size-mib", "8", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == ["ckptlib", "s3fs-parallel"]
    for r in rows:
        assert r["save_s"] > 0 and r["restore_s"] > 0 and r["peak_extra_mib"] >= 0, r
        assert r["state_bytes"] == 8 << 20 and r["bytes"] > 0, r
    ours, ceiling = rows
    assert ceiling["bytes"] == ours["state_bytes"]  # the raw bytes, one object per chunk
    assert ceiling["objects"] == ours["state_bytes"] // ours["chunk_bytes"]
    assert ceiling["threads"] == ours["threads"] >= 16  # ckptlib's pool size for a remote store
    assert "ckptlib / s3fs-parallel: save" in result.output


def test_bench_s3_refuses_an_empty_state_before_starting_anything():
    result = runner.invoke(app, ["bench", "--s3", "--s3-size-mib", "0"])
    assert result.exit_code == 2 and "--s3-size-mib must be at least 1" in result.stderr
