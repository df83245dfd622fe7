"""Collective checkpoints of real torch.distributed jobs (gloo on CPU, one process per rank): FSDP2
resumed bit-exactly and resharded 2 -> 4 -> 1, DDP written once and restored into FSDP2 (on S3), a
rank killed mid-save, a 2-D mesh (DCP's resharding matrix, HSDP). The ranks run
tests/distributed_jobs.py; each test starts few processes and checks much (each imports torch)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptlib import Checkpointer, RetentionPolicy
from ckptlib.leases import live_leases
from ckptlib.testing.compare import first_difference

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
KILLED_LEASE_TTL_S = 12.0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(name: str, world: int, url: str, out: Path, options: dict | None = None,
        expect: dict[int, int] | None = None, env: dict[str, str] | None = None) -> list[dict | None]:
    """Run job ``name`` of tests/distributed_jobs.py on ``world`` ranks; each rank's result (None for a
    rank that wrote none). ``expect``: exit codes other than 0 expected of some ranks; ``env``: more
    environment for the ranks."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    if options:
        env["CKPT_STORAGE_OPTIONS"] = json.dumps(options)
    port = _port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed_jobs.py"), name, str(r), str(world),
                               str(port), url, str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    results: list[dict | None] = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=600)
        want = (expect or {}).get(r, 0)
        assert p.returncode == want, f"rank {r} of {name} exited {p.returncode} (expected {want}):\n{err[-4000:]}"
        path = out / f"{name}.r{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def test_fsdp2_resume_is_bit_exact_and_other_world_sizes_restore_every_tensor(tmp_path):
    url, out = str(tmp_path / "run"), tmp_path / "out"
    train = job("fsdp_train", 2, url, out)
    resume = job("fsdp_resume", 2, url, out)
    reshard = job("fsdp_reshard", 4, url, out)
    at10 = _load(out / "fsdp_train.step10.pt")

    # a fresh 2-rank job restored step 5 in place and trained on: the same losses and weights, bit for bit
    assert resume[0]["losses"] == train[0]["losses"][5:10] and resume[0]["step"] == 5
    assert first_difference(at10, _load(out / "fsdp_resume.step10.pt")) is None
    # a 4-rank job restored step 10 into its own (uneven) shards: every full tensor is the saving job's
    assert first_difference(at10, _load(out / "fsdp_reshard.step10.pt")) is None
    assert [r["local_shapes"]["0.weight"] for r in reshard] == [[24, 16]] * 4
    assert [r["local_shapes"]["4.weight"] for r in reshard] == [[2, 64], [2, 64], [1, 64], [0, 64]]
    for r in reshard:  # each rank's shards were filled in place (all but an empty one changed)
        assert r["step"] == 10
        assert set(r["changed"]) == {k for k, shape in r["local_shapes"].items() if shape[0]}

    # every rank got the same outcome; the background save blocked its rank far less than it took
    for r in train:
        assert [i["committed"] for i in r["infos"]] == [True, True]
        assert r["infos"][1]["blocked_s"] < r["infos"][1]["durable_s"]
    assert [(i["digest"], i["bytes_written"]) for i in train[0]["infos"]] == [
        (i["digest"], i["bytes_written"]) for i in train[1]["infos"]]

    # a process without a group: full tensors; verify, export, GC and a restore after it
    with Checkpointer(url) as ck:
        full = ck.restore(10)
        assert first_difference(dict(at10["model"]), dict(full["model"])) is None
        assert first_difference(at10["optim"], full["optim"]) is None and full["step"] == 10
        assert ck.verify(5) == [] and ck.verify(10) == []
        ck.export(10, str(tmp_path / "step10.safetensors"), select=["model"])  # the model's own names
        from safetensors.torch import load_file

        exported = load_file(str(tmp_path / "step10.safetensors"))
        assert exported.keys() == at10["model"].keys()
        assert torch.equal(exported["2.weight"], at10["model"]["2.weight"])
        report = ck.gc(RetentionPolicy(keep_last=1), grace_s=0)
        assert report.dropped_steps == [5]
        assert any(k.startswith("fragments/5/state.g0.r1.") for k in report.deleted_objects)
        assert first_difference(dict(at10["model"]), dict(ck.restore(10)["model"])) is None
        assert ck.verify(10) == []


@pytest.mark.s3
def test_ddp_writes_one_replica_keeps_per_rank_values_and_restores_into_fsdp2(tmp_path, s3_url):
    out = tmp_path / "out"
    ddp = job("ddp", 2, s3_url.url, out, s3_url.storage_options)
    into_fsdp = job("fsdp_from_ddp", 2, s3_url.url, out, s3_url.storage_options)
    info = ddp[0]["info"]
    # one replica of model and optimizer, not two (plus the two ranks' own 3-element tensors)
    assert info["bytes_written"] <= 1.02 * info["one_replica_bytes"], info
    assert ddp[1]["info"]["digest"] == info["digest"]
    # per-rank values come back to their own rank; replicated ones to both
    assert [(r["seen"], r["name"], r["shared"], r["same_after_restore"]) for r in ddp] == [
        ([0.0] * 3, "rank-0", 7, True), ([1.0] * 3, "rank-1", 7, True)]
    assert [(r["seen"], r["name"]) for r in into_fsdp] == [([0.0] * 3, "rank-0"), ([1.0] * 3, "rank-1")]
    saved, restored = _load(out / "ddp.step3.pt"), _load(out / "fsdp_from_ddp.pt")
    assert first_difference(dict(saved["model"]), dict(restored["model"])) is None
    assert first_difference(saved["optim"]["state"], restored["optim"]["state"]) is None
    with Checkpointer(s3_url.url, s3_url.storage_options) as ck:
        assert ck.verify(3) == []
        assert ck.restore(3, rank=1)["name"] == "rank-1"


def test_a_rank_killed_mid_save_commits_nothing_and_the_next_group_saves(tmp_path):
    url, out = str(tmp_path / "run"), tmp_path / "out"
    # the killed rank's save lease lives KILLED_LEASE_TTL_S, not the default 30 s: long enough to be
    # seen by the GC below, short enough that the wait for it to expire is mostly the next group's save
    killed = job("kill", 2, url, out, expect={1: -9}, env={"LEASE_TTL_S": str(KILLED_LEASE_TTL_S)})
    assert killed[1] is None
    assert killed[0]["error"] == "GroupFailed" and "died" in killed[0]["message"], killed[0]
    with Checkpointer(url) as ck:
        assert ck.steps() == [1]  # all ranks or none
        dead = {p.name for p in (tmp_path / "run" / "fragments" / "2").iterdir()}
        # the killed rank's save lease, renewed by nobody now, keeps GC from sweeping (the chunks the
        # dead group's rank 0 wrote for step 2) until it expires, as any writer's that died would
        leases = live_leases(ck.store)
        report = ck.gc(RetentionPolicy(keep_last=2), grace_s=0, wait_s=0.5)
        assert report.deferred and "a save is in flight" in report.deferred, report
        assert any(lease.id in report.deferred for lease in leases), (leases, report.deferred)
    again = job("save_again", 2, url, out)
    assert again[0]["info"]["committed"] and again[0]["info"]["digest"] == again[1]["info"]["digest"]
    with Checkpointer(url) as ck:
        assert ck.steps() == [1, 2]
        want = _load(out / "save_again.step2.pt")
        got = ck.restore(2)
        assert first_difference(dict(want["model"]), dict(got["model"])) is None
        assert first_difference(want["optim"], got["optim"]) is None
        deadline = time.monotonic() + KILLED_LEASE_TTL_S + 10
        while live_leases(ck.store) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert live_leases(ck.store) == []  # ... then it expires by itself
        swept = set(ck.gc(RetentionPolicy(keep_last=2), grace_s=0).deleted_objects)
        assert {f"fragments/2/{name}" for name in dead} <= swept  # the dead group's rank fragment
        assert ck.verify(2) == [] and ck.verify(1) == []


def test_2d_mesh_resharding_matrix_and_hsdp_into_fsdp2(tmp_path):
    url, out = str(tmp_path / "run"), tmp_path / "out"
    results = job("mesh2d", 4, url, out)
    for r in results:
        assert r["failures"] == []
        assert r["hsdp_model_equal"] and r["hsdp_optim_equal"]
        # HSDP (replicated over one mesh dim) stores one copy, as FSDP2 of the same model does
        assert r["hsdp_bytes"] == r["fsdp_bytes"]
    with Checkpointer(url) as ck:
        for step in ck.steps():
            assert ck.verify(step) == []
        assert torch.equal(ck.restore(3, select=["model"])["model"]["uneven"],
                           torch.arange(35, dtype=torch.float64).view(5, 7) / 3)


def test_ckpt_bench_distributed_runs_every_system_and_restores_bit_exactly(tmp_path):
    """`ckpt bench --distributed`: a 2-rank and a 1-rank FSDP2 job; ckptlib, DCP's save and DCP's
    async_save each have a complete record and every restore (same world size, and 2 -> 1 ranks) is
    bit-exact. No timing is asserted but that a synchronous save's blocked time is its durable time."""
    from typer.testing import CliRunner

    from ckpt.cli import app

    out = tmp_path / "records.json"
    result = CliRunner().invoke(app, ["bench", "--distributed", "--workloads", "finetune", "--ranks", "2,1",
                                      "--saves", "2", "--steps-between", "1", "--store", str(tmp_path),
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    systems = ("ckptlib", "dcp", "dcp_async")
    assert [(r["world"], r["system"]) for r in records] == [(w, s) for w in (2, 1) for s in systems]
    for r in records:
        assert r["exact_same"] and r.get("exact_other", True), r
        assert r["bytes_per_save"] > 0 and r["durable_s"] >= r["blocked_s"] > 0 and r["restore_same_s"] > 0
        assert r["peak_extra_mib"] >= 0
    assert all(r["restore_other_from"] == 2 and "restore_other_s" in r for r in records[3:])
    dcp, dcp_async = records[1], records[2]
    assert dcp["durable_s"] - dcp["blocked_s"] < 0.01  # dcp.save returns once written
    # the same writer, the same files (their metadata names the directory)
    assert abs(dcp_async["bytes_per_save"] - dcp["bytes_per_save"]) < 0.01 * dcp["bytes_per_save"]
    # the frozen backbone is referenced, not written again: far fewer bytes per save than DCP's full copy
    assert records[0]["bytes_per_save"] * 5 < dcp["bytes_per_save"]
    assert "DCP writes" in result.output and "(dcp_async)" in result.output


def test_a_groups_sub_step_fragments_are_written_in_the_background_chained_and_read_back_whole(tmp_path):
    """``write_fragment_async(substep=)`` in a collective Checkpointer (what a shard's group writes
    within a round): every rank gets the same group fragment, each a delta against the one before,
    read back whole by a fresh process group, and refused once the generation is fenced."""
    url = str(tmp_path / "run")
    r0, r1 = job("substeps", 2, url, tmp_path / "out")
    assert r0["written"] == r1["written"] and [w["substep"] for w in r0["written"]] == [2, 4, 6]
    assert {w["world"] for w in r0["written"]} == {2}
    assert all(w["bytes_written"] < w["logical_bytes"] for w in r0["written"])
    assert r0["same_at_4"] and r1["same_at_4"] and (r0["i"], r1["i"]) == (4, 4)
    assert (r0["mine"], r1["mine"]) == (0, 1)  # a value of each rank's own comes back to its rank
    # adopted, the sub-step read is the base of the next: the same state again costs (almost) nothing
    assert r0["again_bytes"] < 0.05 * r0["again_logical"], r0
    assert r0["fenced"] and r1["fenced"] and "generation" in r0["fenced"]
    assert r0["keys"] == [f"fragments/1/p.g0.k{k}.json" for k in (2, 4, 5, 6)]
    with Checkpointer(url) as ck:  # the round's fragment is the part's own, beside its sub-steps
        assert ck.read_fragment(1, "p", generation=0, select=["model"])["model"]
        assert ck.read_fragment(1, "p", generation=0, substep=6, rank=1)["mine"] == 1


def test_a_groups_sub_step_hands_each_rank_its_units_and_reads_back_from_them_without_the_store(tmp_path):
    """``write_fragment_async(substep=, on_written=)`` in a collective Checkpointer (what a group's
    local tier keeps): each rank gets the group fragment and the units it stored; every rank's units
    together restore the sub-step whole, FSDP2 pieces of both ranks included, with no chunk read."""
    r0, r1 = job("local_copies", 2, str(tmp_path / "run"), tmp_path / "out")
    for r in (r0, r1):
        assert r["kind"] == "GroupFragment" and r["same_digest"] and r["units"] > 0, r
        assert r["same"] and r["same_again"], r
        assert r["chunk_reads_with_known"] == 0 and r["chunk_reads_without"] > 0, r
    assert r0["known"] == r1["known"] == r0["units"] + r1["units"]  # each rank stored its own shards


def test_a_collective_checkpointer_closed_ends_its_gloo_group(tmp_path):
    """A rank that makes a collective Checkpointer per round (a warm group's rank) keeps no socket
    of the rounds before: each Checkpointer's own gloo group is destroyed when it is closed."""
    r0, r1 = job("checkpointer_per_round", 2, str(tmp_path / "run"), tmp_path / "out")
    for r in (r0, r1):
        assert max(r["fds"][1:]) <= r["fds"][0], r  # without the destroy: one socket more a round
