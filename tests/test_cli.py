"""The `ckpt` store commands on real local stores, through the real CLI (typer's CliRunner).

Every expected failure must be one ``error: ...`` line on stderr with exit code 2 (verify damage: 1)
and no traceback.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ckpt.cli import app
from ckptlib import Checkpointer
from ckptlib.export import to_weights_only
from ckptlib.testing.compare import first_difference

runner = CliRunner()


def ckpt(*args: str):
    return runner.invoke(app, list(args))


def assert_clean_error(result, code: int, *fragments: str) -> None:
    """Exit ``code``, exactly one ``error:`` line on stderr naming every fragment, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def make_state(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)  # 16 KiB: 4 chunks of 4 KiB
    w[: step % 64] += 0.5  # a few rows change per step
    return {
        "model": {"w": w, "b": torch.zeros(64, dtype=torch.bfloat16) + step, "frozen": torch.ones(2048)},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step)), "exp_avg": w * 0.1}},
                      "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}]},
        "rng": {"numpy": np.random.RandomState(step).get_state(), "python": random.Random(step).getstate()},
        "np_scalar": np.float32(step), "array": np.arange(5, dtype=np.int16), "note": "hello", "nan": float("nan"),
        "data_position": step,
    }


@pytest.fixture
def store(tmp_path):
    """A local store with committed steps 1, 2, 3 (a keyframe and two deltas), 4 KiB chunks."""
    path = tmp_path / "run"
    with Checkpointer(str(path), chunk_bytes=4096) as ck:
        for step in (1, 2, 3):
            ck.save(step, make_state(step), meta={"loss": 1.0 / step})
    return str(path)


# --- ls / show -----------------------------------------------------------------------------------

def test_ls_lists_every_step_with_kind_and_digest(store):
    result = ckpt("ls", store)
    assert result.exit_code == 0, result.output
    with Checkpointer(store) as ck:
        digests = {s: ck.manifest(s).digest for s in ck.steps()}
    for step, digest in digests.items():
        assert digest[:12] in result.stdout
    assert "keyframe" in result.stdout and "delta" in result.stdout


def test_ls_shows_validation_verdicts(store):
    with Checkpointer(store) as ck:
        ck.store.put("validations/2.json", json.dumps({"passed": True}).encode())
        ck.store.put("validations/3.json", json.dumps({"passed": False, "failed": ["nan"]}).encode())
    out = ckpt("ls", store).stdout
    assert "passed" in out and "failed" in out


def test_ls_pages_newest_first_and_before_pages_back(tmp_path):
    path = str(tmp_path / "many")
    with Checkpointer(path, chunk_bytes=4096) as ck:
        for step in range(1, 8):
            ck.save(step, {"w": torch.full((8,), float(step))})

    def rows(result) -> list[int]:
        assert result.exit_code == 0, result.output
        cells = [line.strip("│┃ ").split("│")[0].strip() for line in result.stdout.splitlines()]
        return [int(c) for c in cells if c.isdigit()]

    first = ckpt("ls", path, "--limit", "3")
    assert rows(first) == [5, 6, 7]
    assert f"3 of 7 committed steps (5..7); older: ckpt ls {path} --before 5" in first.stdout
    assert rows(ckpt("ls", path, "-n", "3", "--before", "5")) == [2, 3, 4]
    last = ckpt("ls", path, "-n", "3", "--before", "2")
    assert rows(last) == [1] and "older:" not in last.stdout
    assert rows(ckpt("ls", path, "--limit", "0")) == list(range(1, 8))
    assert rows(ckpt("ls", path)) == list(range(1, 8))  # fewer than a page: every step, no footer
    none = ckpt("ls", path, "--before", "1")
    assert none.exit_code == 0 and "no committed checkpoint before step 1" in none.stdout


def test_ls_empty_store_is_a_message_not_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    result = ckpt("ls", str(tmp_path / "empty"))
    assert result.exit_code == 0
    assert "no committed checkpoints" in result.stdout


def test_ls_nonexistent_local_path_is_a_clear_error(tmp_path):
    assert_clean_error(ckpt("ls", str(tmp_path / "nope")), 2, "does not exist", str(tmp_path / "nope"))


def test_show_prints_the_exact_digest_line(store):
    with Checkpointer(store) as ck:
        latest, second = ck.manifest(), ck.manifest(2)
    result = ckpt("show", store)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert f"digest: {latest.digest}" in lines
    assert "step: 3" in lines and "parent: 2" in lines
    assert any(line.startswith("chunks: ") for line in lines)
    assert any(line.startswith("  state: generation 0") for line in lines)
    assert 'meta: {"loss": 0.3333333333333333}' in lines
    assert f"digest: {second.digest}" in ckpt("show", store, "--step", "2").stdout.splitlines()


def test_show_multi_part_checkpoint_lists_parts(tmp_path):
    url = str(tmp_path / "multi")
    with Checkpointer(url, chunk_bytes=4096) as ck:
        ck.write_fragment(5, "shard-0", make_state(5), generation=0)
        ck.write_fragment(5, "coordinator", {"round": 5, "w": torch.ones(10)})
        ck.commit(5, ["shard-0", "coordinator"])
    out = ckpt("show", url).stdout
    assert "multi-part (2 parts)" in out and "  shard-0: generation 0" in out and "  coordinator:" in out


def test_show_missing_step_is_a_clear_error(store):
    assert_clean_error(ckpt("show", store, "--step", "99"), 2, "step 99 is not committed")


# --- verify --------------------------------------------------------------------------------------

def test_verify_intact(store):
    result = ckpt("verify", store)
    assert result.exit_code == 0, result.output
    assert "intact" in result.stdout
    result = ckpt("verify", store, "--all")
    assert result.exit_code == 0 and result.stdout.count(": intact") == 3


def test_verify_names_the_damaged_tensor_and_chunk(store, tmp_path):
    with Checkpointer(store) as ck:
        frag = ck.fragment(3, "state")
    leaf = next(leaf for leaf in frag.leaves if leaf.spec.path == "/model/w")
    index = 2
    blob = frag.blobs[leaf.chunks[index]]
    path = tmp_path / "run" / blob.key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    result = ckpt("verify", store, "--step", "3")
    assert result.exit_code == 1, result.output
    problems = [line for line in result.stdout.splitlines() if line.startswith("step 3")]
    assert problems, result.stdout
    assert "tensor '/model/w'" in problems[0] and f"chunk {index}" in problems[0] and blob.key in problems[0]
    assert result.stderr.startswith("error: ") and "Traceback" not in result.output
    # restoring it fails cleanly too
    assert_clean_error(ckpt("export", store, "--out", str(tmp_path / "x.pt")), 2, "/model/w")


def test_verify_step_and_all_together_is_an_error(store):
    assert_clean_error(ckpt("verify", store, "--step", "1", "--all"), 2, "--all")


def test_verify_checks_every_committed_step(tmp_path):
    """A chunk of step 2 (of 3) damaged: `ckpt verify URL` checks every step and says so (before: it
    checked the latest only and said "intact", exit 0). --step checks one step; --all is the default."""
    url = str(tmp_path / "run")
    with Checkpointer(url, chunk_bytes=4096, keyframe_every=1) as ck:
        for step in (1, 2, 3):
            ck.save(step, make_state(step))
        own = {b.key for b in ck.fragment(2, "state").blobs.values()} - {
            b.key for s in (1, 3) for b in ck.fragment(s, "state").blobs.values()}
    key = sorted(own)[0]
    path = tmp_path / "run" / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    for args in ((), ("--all",)):
        result = ckpt("verify", url, *args)
        assert result.exit_code == 1, result.output
        lines = result.stdout.splitlines()
        assert "step 1: intact" in lines and "step 3: intact" in lines and "step 2: damaged (1 problem(s))" in lines
        assert any(line.startswith("step 2, part 'state'") and key in line for line in lines), result.stdout
        assert result.stderr.startswith("error: 1 problem(s) in step(s) 2 ") and "2 of 3 intact" in result.stderr
    one = ckpt("verify", url, "--step", "3")
    assert one.exit_code == 0 and one.stdout.splitlines() == ["step 3: intact", "intact: 1 checkpoint(s) verified"]
    assert ckpt("verify", url, "--step", "2").exit_code == 1
    assert_clean_error(ckpt("verify", url, "--step", "9"), 2, "step 9 is not committed")


# --- damaged steps, quarantine -------------------------------------------------------------------

def test_a_damaged_manifest_is_one_damaged_step_and_quarantine_moves_it_aside(store, tmp_path):
    """Step 3's manifest is not JSON: ls lists 1 and 2 and marks 3, gc refuses naming the file and
    the command to run; quarantine moves it aside (printing the undo), then gc runs, and --undo puts
    it back exactly (before: ls, restore of the latest and gc failed; the error said ls shows them)."""
    manifest = tmp_path / "run" / "manifests" / "3.json"
    manifest.write_bytes(b"\x89PNG not a manifest")
    ls = ckpt("ls", store)
    assert ls.exit_code == 0, ls.output
    assert "DAMAGED" in next(line for line in ls.stdout.splitlines() if line.split("│")[1:2] == ["    3 "])
    assert "damaged: step 3: " in ls.stdout and "manifests/3.json" in ls.stdout
    assert f"ckpt quarantine file://{tmp_path / 'run'} --step 3" in ls.stdout
    assert sum(1 for line in ls.stdout.splitlines() if "keyframe" in line or "delta" in line) == 2
    assert_clean_error(ckpt("gc", store, "--keep-last", "1", "--grace-seconds", "0"), 2,
                       "manifests/3.json", "ckpt quarantine", "--step 3")
    assert_clean_error(ckpt("export", store, "--out", str(tmp_path / "x.pt")), 2, "step 3", "is damaged")

    assert_clean_error(ckpt("quarantine", store, "--step", "2"), 2, "verifies intact", "--force")
    moved = ckpt("quarantine", store, "--step", "3", "--reason", "disk error")
    assert moved.exit_code == 0, moved.output
    assert "moved to" in moved.stdout and "quarantine/3/" in moved.stdout and "disk error" in moved.stdout
    assert f"--step 3 --undo" in moved.stdout and "nothing was deleted" in moved.stdout
    assert not manifest.exists() and (tmp_path / "run" / "quarantine" / "3" / "manifests" / "3.json").exists()
    listing = ckpt("ls", store).stdout
    assert "in quarantine: step 3" in listing and "DAMAGED" not in listing
    assert "step 3: in quarantine since" in ckpt("quarantine", store).stdout
    gc = ckpt("gc", store, "--keep-last", "1", "--grace-seconds", "0")
    assert gc.exit_code == 0 and "drop 1 step(s): 1" in gc.stdout, gc.output
    with Checkpointer(store) as ck:
        assert ck.steps() == [2] and first_difference(make_state(2), ck.restore()) is None
    back = ckpt("quarantine", store, "--step", "3", "--undo")
    assert back.exit_code == 0 and "committed again" in back.stdout, back.output
    assert manifest.read_bytes() == b"\x89PNG not a manifest"
    assert_clean_error(ckpt("quarantine", store, "--step", "3", "--undo"), 2, "not in quarantine")


def test_quarantine_of_an_intact_step_needs_force(store):
    forced = ckpt("quarantine", store, "--step", "2", "--force")
    assert forced.exit_code == 0 and "not verified" in forced.stdout, forced.output
    with Checkpointer(store) as ck:
        assert ck.steps() == [1, 3]
    assert ckpt("quarantine", store, "--step", "2", "--undo").exit_code == 0
    with Checkpointer(store) as ck:
        assert ck.steps() == [1, 2, 3] and ck.verify(2) == []


# --- gc ------------------------------------------------------------------------------------------

def test_gc_dry_run_then_real(store):
    result = ckpt("gc", store, "--keep-last", "1", "--grace-seconds", "0", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "would drop 2 step(s): 1, 2" in result.stdout and "nothing was deleted" in result.stdout
    with Checkpointer(store) as ck:
        assert ck.steps() == [1, 2, 3]

    result = ckpt("gc", store, "--keep-last", "1", "--keep", "1", "--grace-seconds", "0")
    assert result.exit_code == 0, result.output
    assert "kept 2 step(s): 1, 3" in result.stdout and "drop 1 step(s): 2" in result.stdout
    with Checkpointer(store) as ck:
        assert ck.steps() == [1, 3]
        assert ck.verify(3) == [] and ck.verify(1) == []


def test_gc_says_why_it_swept_nothing_beside_a_save_in_flight(store):
    from ckptlib.leases import Lease
    from ckptlib.store import Store

    lease = Lease(Store.from_url(store), "save", 3).acquire()  # a save that began before the GC
    try:
        result = ckpt("gc", store, "--keep-last", "1", "--grace-seconds", "0", "--wait-seconds", "0.2")
    finally:
        lease.release()
    assert result.exit_code == 0, result.output
    assert "delete 2 object(s) (0 chunks)" in result.stdout  # the two dropped manifests only
    assert f"stopped early: a save is in flight (lease {lease.doc.id}" in result.stdout
    assert "waited 0.2 s" in result.stdout and "run GC again later" in result.stdout
    with Checkpointer(store) as ck:
        assert ck.steps() == [3] and ck.verify(3) == []


def test_gc_rejects_a_bad_policy(store):
    assert_clean_error(ckpt("gc", store, "--keep-last", "0"), 2, "keep_last must be >= 1")


# --- export --------------------------------------------------------------------------------------

def test_export_refuses_what_the_format_would_change_naming_it(store, tmp_path):
    """numpy arrays (an RNG state's), numpy scalars: weights_only gives them back as other types,
    so an export without --convert refuses, naming the first, and writes nothing."""
    out = tmp_path / "state.pt"
    assert_clean_error(ckpt("export", store, "--out", str(out)), 2, "/rng/numpy/1", "numpy.ndarray", "--convert")
    assert_clean_error(ckpt("export", store, "--out", str(tmp_path / "s.safetensors")), 2,
                       "/optimizer/param_groups", "--convert")
    assert os.listdir(tmp_path) == ["run"]


def test_export_pt_loads_with_weights_only_and_equals_the_restore(store, tmp_path):
    out = tmp_path / "state.pt"
    result = ckpt("export", store, "--out", str(out), "--convert")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[:3] == ["converted /rng/numpy/1: numpy.ndarray -> torch.Tensor",
                         "converted /np_scalar: numpy.float32 -> float", "converted /array: numpy.ndarray -> torch.Tensor"]
    assert lines[-1].endswith(", 3 values converted"), lines
    loaded = torch.load(out, weights_only=True)
    with Checkpointer(store) as ck:
        restored = ck.restore()
    expected, converted = to_weights_only(restored, convert=True)
    assert len(converted) == 3 and first_difference(expected, loaded) is None
    assert loaded["rng"]["numpy"][1].dtype == torch.uint32  # numpy arrays became tensors
    assert isinstance(loaded["rng"]["python"], tuple) and loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(loaded["model"]["w"], make_state(3)["model"]["w"])


def test_export_safetensors_flattens_to_dotted_names(store, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    out = tmp_path / "state.safetensors"
    result = ckpt("export", store, "--step", "2", "--out", str(out), "--convert")
    assert result.exit_code == 0, result.output
    assert "converted /optimizer/param_groups: list -> its nearest JSON in the metadata" in result.stdout
    assert "converted /note" not in result.stdout and "converted /data_position" not in result.stdout
    tensors = load_file(str(out))
    expected = make_state(2)
    assert torch.equal(tensors["model.w"], expected["model"]["w"])
    assert torch.equal(tensors["model.b"], expected["model"]["b"]) and tensors["model.b"].dtype == torch.bfloat16
    assert torch.equal(tensors["optimizer.state.0.exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(tensors["array"], torch.arange(5, dtype=torch.int16))
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["data_position"]) == 2 and json.loads(meta["note"]) == "hello"
    assert json.loads(meta["optimizer.param_groups"])[0]["lr"] == 0.01
    assert json.loads(meta["__ckpt__"])["step"] == 2


def _training_like_run(url: str) -> torch.nn.Module:
    """A multi-part cut shaped like a training run's: the coordinator's model and outer optimizer,
    each shard's model and Adam moments."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with Checkpointer(url, chunk_bytes=4096) as ck:
        ck.write_fragment(3, "coordinator", {"model": model.state_dict(), "outer_optimizer": {"momentum": 0.9},
                                             "round": 3})
        for i in range(2):
            opt = torch.optim.Adam(model.parameters())
            model(torch.ones(1, 8)).sum().backward()
            opt.step()
            ck.write_fragment(3, f"shard-{i}", {"model": model.state_dict(), "optimizer": opt.state_dict()})
        ck.commit(3, ["coordinator", "shard-0", "shard-1"])
    return model


def test_export_select_gives_the_trained_models_weights_under_their_own_names(tmp_path):
    """`--select coordinator/model`: the coordinator's model alone, named as its state_dict (before: the
    file mixed the coordinator's model, every shard's model and the Adam moments, and names had to be
    stripped of `coordinator.model.` by hand). Several paths keep their whole names."""
    from safetensors.torch import load_file

    url = str(tmp_path / "run")
    _training_like_run(url)
    with Checkpointer(url) as ck:
        expected = ck.restore(3, part="coordinator")["model"]
    out = tmp_path / "model.safetensors"
    result = ckpt("export", url, "--select", "coordinator/model", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "exported coordinator/model of step 3" in result.stdout
    weights = load_file(str(out))
    assert sorted(weights) == sorted(expected) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fresh.load_state_dict(weights)
    assert all(torch.equal(fresh.state_dict()[k], expected[k]) for k in expected)
    pt = tmp_path / "model.pt"
    assert ckpt("export", url, "--select", "coordinator/model", "--out", str(pt)).exit_code == 0
    fresh.load_state_dict(torch.load(pt, weights_only=True))

    both = tmp_path / "both.safetensors"
    result = ckpt("export", url, "--select", "coordinator/model", "--select", "shard-1/optimizer/state",
                  "--out", str(both))
    assert result.exit_code == 0, result.output
    names = sorted(load_file(str(both)))
    assert "coordinator.model.0.weight" in names and "shard-1.optimizer.state.0.exp_avg" in names
    assert not any(n.startswith(("shard-0", "coordinator.outer")) for n in names), names
    assert_clean_error(ckpt("export", url, "--select", "model", "--out", str(tmp_path / "m.pt")), 2,
                       "'model' names no part of step 3", "coordinator/model")
    assert_clean_error(ckpt("export", url, "--select", "coordinator/nope", "--out", str(tmp_path / "m.pt")), 2,
                       "/nope", "not in the saved state")
    assert not (tmp_path / "m.pt").exists()


def test_export_select_of_a_single_writer_checkpoint(store, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "w.safetensors"
    assert ckpt("export", store, "--select", "model", "--out", str(out)).exit_code == 0
    tensors = load_file(str(out))
    assert sorted(tensors) == ["b", "frozen", "w"] and torch.equal(tensors["w"], make_state(3)["model"]["w"])
    one = tmp_path / "w.pt"
    assert ckpt("export", store, "--select", "model/w", "--out", str(one)).exit_code == 0
    assert torch.equal(torch.load(one, weights_only=True), make_state(3)["model"]["w"])


def test_export_other_suffix_is_a_clear_error(store, tmp_path):
    assert_clean_error(ckpt("export", store, "--out", str(tmp_path / "x.bin")), 2, ".pt", ".safetensors")


# --- bad inputs ----------------------------------------------------------------------------------

def test_unknown_scheme_is_a_clear_error():
    assert_clean_error(ckpt("ls", "ftp://host/run"), 2, "unsupported store URL scheme")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_malformed_storage_options_name_the_option_and_an_example(store, text):
    assert_clean_error(ckpt("ls", store, "--storage-options", text), 2, "--storage-options", "endpoint_url")


def test_storage_options_on_a_local_store_are_refused(store):
    assert_clean_error(ckpt("show", store, "--storage-options", '{"key": "k"}'), 2, "s3://")


def test_memory_store_without_checkpoints(tmp_path):
    result = ckpt("ls", "memory://ckpt-cli-test-empty")
    assert result.exit_code == 0 and "no committed checkpoints" in result.stdout
    assert_clean_error(ckpt("show", "memory://ckpt-cli-test-empty"), 2, "no committed checkpoint")


# --- demo ----------------------------------------------------------------------------------------

def test_demo_trains_saves_verifies_and_restores_bit_exactly(tmp_path):
    url = str(tmp_path / "demo")
    result = ckpt("demo", "--store", url, "--saves", "2", "--steps-between", "1")
    assert result.exit_code == 0, result.output
    assert "sync" in result.stdout and "async" in result.stdout
    assert "verify: all 2 checkpoints intact" in result.stdout and "bit-exact" in result.stdout
    with Checkpointer(url) as ck:
        assert ck.steps() == [1, 2]
    result = ckpt("demo", "--store", url, "--saves", "2", "--steps-between", "1")  # resumes
    assert result.exit_code == 0, result.output
    assert "resumed from step 2" in result.stdout
    with Checkpointer(url) as ck:
        assert ck.steps() == [1, 2, 3, 4]


# --- S3 (a real SeaweedFS server on loopback) -------------------------------------------------------

def test_s3_store_with_storage_options(s3_url, tmp_path):
    with Checkpointer(s3_url.url, s3_url.storage_options, chunk_bytes=4096) as ck:
        ck.save(7, make_state(7))
        digest = ck.manifest(7).digest
    options = json.dumps(s3_url.storage_options)
    result = ckpt("ls", s3_url.url, "--storage-options", options)
    assert result.exit_code == 0, result.output
    assert digest[:12] in result.stdout
    assert f"digest: {digest}" in ckpt("show", s3_url.url, "--storage-options", options).stdout.splitlines()
    assert ckpt("verify", s3_url.url, "--storage-options", options).exit_code == 0
    out = tmp_path / "s3.pt"
    assert ckpt("export", s3_url.url, "--storage-options", options, "--out", str(out), "--convert").exit_code == 0
    assert torch.load(out, weights_only=True)["data_position"] == 7
    wrong = json.dumps({**s3_url.storage_options, "secret": "wrong-secret"})
    assert_clean_error(ckpt("ls", s3_url.url, "--storage-options", wrong), 2, "credentials")


# --- run ids -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["../h", "a/b", "..", ".hidden", "x y"])
def test_every_command_refuses_the_same_bad_run_ids(tmp_path, bad):
    from typer.testing import CliRunner

    from ckpt.cli import app

    outs = []
    for args in (["train", "--store", str(tmp_path), "--run-id", bad],
                 ["watchdog", str(tmp_path), "--run-id", bad, "--duration", "0.5"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        outs.append(r.output.strip())
    assert outs[0] == outs[1] and f"run id {bad!r} must be" in outs[0], outs


# --- the error tree ------------------------------------------------------------------------------

def test_every_error_class_of_the_cli_and_the_benchmark_is_a_checkpoint_error():
    """An error raised on purpose is one of ckptlib's (stdlib mixins allowed), so callers catch one tree."""
    import importlib
    import inspect
    import pkgutil

    import bench
    import ckpt
    from ckptlib import CheckpointError

    outside = []
    for package in (ckpt, bench):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith(".__main__"):  # runs the command
                continue
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if (inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
                        and not issubclass(obj, CheckpointError)):
                    outside.append(f"{module.__name__}.{name}")
    assert not outside, f"error classes outside ckptlib.errors.CheckpointError: {outside}"
