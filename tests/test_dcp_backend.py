"""ckptlib as the storage of ``torch.distributed.checkpoint`` (``ckptlib.dcp``): DCP's own save/load
and default planners on real stores, real gloo ranks running FSDP2 on CPU (tests/dcp_jobs.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.overrides import TorchFunctionMode
from typer.testing import CliRunner

from ckpt.cli import app
from ckptlib import Checkpointer, CheckpointError, CorruptCheckpoint, NoCheckpoint
from ckptlib.dcp import StorageReader, StorageWriter
from ckptlib.dcp.metadata import from_json
from ckptlib.testing.compare import first_difference

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group is up


def failure(e: CheckpointException) -> BaseException:
    """The error rank 0 raised inside a DCP call (DCP gathers them into one CheckpointException)."""
    return e.failures[0][0]


def sample(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(48, 32, generator=g), "b": torch.randn(32, generator=g).bfloat16(),
                      "ids": torch.arange(7), "scale": torch.tensor(2.5)},
            "extra": {"epoch": 3, "name": "run-1", "lr": [0.1, 1e-3], "inner": {"ok": True, "none": None}}}


def blank() -> dict:
    """``sample``'s structure with other values: what a fresh job loads into."""
    return {"model": {"w": torch.zeros(48, 32), "b": torch.zeros(32, dtype=torch.bfloat16),
                      "ids": torch.zeros(7, dtype=torch.long), "scale": torch.tensor(0.0)},
            "extra": {"epoch": 0, "name": "", "lr": [0.0, 0.0], "inner": {"ok": False, "none": None}}}


def test_single_process_round_trip_is_bit_exact_and_a_ckptlib_step(tmp_path):
    url = str(tmp_path / "run")
    writer = StorageWriter(url)
    dcp.save(sample(0), storage_writer=writer, checkpoint_id=1)
    dcp.save(sample(1), storage_writer=writer, checkpoint_id="2")
    for step, seed in ((None, 1), (1, 0)):
        into = blank()
        dcp.load(into, storage_reader=StorageReader(url, step=step))
        assert first_difference(sample(seed), into) is None
    ck = Checkpointer(url)
    assert ck.steps() == [1, 2] and sorted(ck.manifest(2).parts) == ["dcp", "dcp-r0"]
    assert ck.restore(2, part="dcp-r0", select=["model.w@0,0"])["model.w@0,0"].equal(sample(1)["model"]["w"])
    writer.close()


class Allocations(TorchFunctionMode):
    """The shapes of the tensors torch.empty makes and Tensor.copy_ fills while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in ("empty", "empty_strided", "copy_") and isinstance(out, torch.Tensor):
            self.seen.append((name, tuple(out.shape)))
        return out


def test_a_load_of_whole_saved_tensors_decodes_into_the_state_without_a_copy(tmp_path):
    url = str(tmp_path / "run")
    dcp.save(sample(2), storage_writer=StorageWriter(url, step=1))
    into = blank()
    targets = dict(into["model"])
    with Allocations() as made:
        dcp.load(into, storage_reader=StorageReader(url))
    assert first_difference(sample(2), into) is None
    assert all(into["model"][k] is t for k, t in targets.items())  # filled in place
    shapes = {tuple(t.shape) for t in targets.values()}
    assert [(f, s) for f, s in made.seen if s in shapes] == [], made.seen  # no staging tensor, no copy


def test_round_trip_through_s3(s3_url):
    writer = StorageWriter(s3_url.url, storage_options=s3_url.storage_options)
    dcp.save(sample(4), storage_writer=writer, checkpoint_id=10)
    into = blank()
    dcp.load(into, storage_reader=StorageReader(s3_url.url, storage_options=s3_url.storage_options))
    assert first_difference(sample(4), into) is None
    writer.close()


def test_a_second_save_with_a_quarter_changed_writes_at_most_half_of_filesystemwriters_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layer{i}.weight": torch.randn(128, 512, generator=g) for i in range(8)}}

    def changed() -> None:
        for i in (1, 6):
            state["model"][f"layer{i}.weight"] += torch.randn(128, 512, generator=g)

    def du(path: Path) -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs1")))
    url = tmp_path / "run"
    long_lived = StorageWriter(str(url))
    dcp.save(state, storage_writer=long_lived, checkpoint_id=1)
    changed()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs2")))
    before = du(url)
    dcp.save(state, storage_writer=long_lived, checkpoint_id=2)
    theirs, ours = du(tmp_path / "fs2"), du(url) - before
    assert ours <= 0.5 * theirs, (ours, theirs)
    changed()  # a writer built for this one save: unchanged chunks still referenced
    before = du(url)
    dcp.save(state, storage_writer=StorageWriter(str(url), step=3))
    assert du(url) - before <= 0.5 * theirs
    into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    dcp.load(into, storage_reader=StorageReader(str(url)))
    assert first_difference(state, into) is None


def test_ckpt_verify_passes_and_a_flipped_byte_fails_the_load(tmp_path):
    url = tmp_path / "run"
    dcp.save(sample(), storage_writer=StorageWriter(str(url), step=5))
    result = CliRunner().invoke(app, ["verify", str(url)])
    assert result.exit_code == 0, result.output
    chunk = max((p for p in (url / "chunks").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as failed:
        dcp.load(blank(), storage_reader=StorageReader(str(url)))
    assert isinstance(failure(failed.value), CorruptCheckpoint), failed.value


def test_async_save_commits_the_state_as_it_was_staged(tmp_path):
    url, state = str(tmp_path / "run"), sample(3)
    response = dcp.async_save(state, storage_writer=StorageWriter(url, step=7))
    upload = getattr(response, "upload_completion", response)
    getattr(response, "staging_completion", upload).result()
    state["model"]["w"].add_(1.0)  # after staging: not in the checkpoint
    upload.result()
    into = blank()
    dcp.load(into, storage_reader=StorageReader(url))
    assert first_difference(sample(3), into) is None


def test_wrong_uses_get_one_clear_error(tmp_path):
    url = str(tmp_path / "run")
    with pytest.raises(CheckpointException) as failed:
        dcp.save(sample(), storage_writer=StorageWriter(url))
    assert isinstance(failure(failed.value), ValueError) and "no step to save" in str(failure(failed.value))
    with pytest.raises(ValueError, match="checkpoint_id is the step"):
        dcp.save(sample(), storage_writer=StorageWriter(url), checkpoint_id="/tmp/x")
    Checkpointer(url).save(1, {"x": torch.ones(2)})  # a plain ckptlib step, not DCP's
    with pytest.raises(CheckpointException) as failed:
        dcp.load(blank(), storage_reader=StorageReader(url))
    assert "step 1 of" in str(failure(failed.value)) and "not saved through ckptlib.dcp" in str(failed.value)
    with pytest.raises(CorruptCheckpoint, match="dtype is 'os.system'"):
        from_json(json.dumps({"format": "ckptlib-dcp-metadata", "version": 1, "state_dict_metadata": {"w": {
            "tensor": {"dtype": "os.system", "layout": "torch.strided", "memory_format": "torch.contiguous_format",
                       "size": [2], "chunks": [[[0], [2]]]}}}, "storage_data": {}}).encode(), 1, "a test")
    with pytest.raises(NoCheckpoint):
        StorageReader(str(tmp_path / "empty")).read_metadata()


def test_loads_that_would_unpickle_or_mix_steps_are_refused(tmp_path):
    url = str(tmp_path / "run")
    writer = StorageWriter(url)
    for step in (1, 2):
        dcp.save(sample(step), storage_writer=writer, checkpoint_id=step)

    class Unpickling(DefaultLoadPlanner):  # wants DCP's pickle bytes for non-tensor values
        def load_bytes(self, read_item, value):
            raise AssertionError("never called: ckptlib.dcp stores no pickle")

    with pytest.raises(CheckpointException) as failed:
        dcp.load(blank(), storage_reader=StorageReader(url), planner=Unpickling())
    assert "not pickles" in str(failure(failed.value)) and "Unpickling" in str(failure(failed.value))

    reader = StorageReader(url)  # read step 2's metadata; the coordinator's plan says step 1
    reader.set_up_storage_reader(reader.read_metadata(), True)
    with pytest.raises(CheckpointError, match="pass step= to StorageReader"):
        reader.read_data(LoadPlan([], storage_data=1), DefaultLoadPlanner())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(name: str, world: int, url: str, out: Path) -> list[dict]:
    """Run job ``name`` of tests/dcp_jobs.py on ``world`` real ranks; each rank's result."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    port = _port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "dcp_jobs.py"), name, str(r), str(world),
                               str(port), url, str(out)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"rank {r} of {name} exited {p.returncode}:\n{err[-4000:]}"
    return [json.loads((out / f"{name}.r{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_fsdp2_on_two_ranks_saves_and_loads_on_two_ranks_and_on_one_process_bit_exact(tmp_path):
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    from distributed_jobs import model

    url, out = str(tmp_path / "run"), tmp_path / "out"
    saved = job("fsdp_save", 2, url, out)
    first, sparse, _ = saved[0]["bytes_written"]
    assert sparse < 0.05 * first, saved[0]  # deltas against the bytes each long-lived writer holds
    assert sorted(Checkpointer(url).manifest(3).parts) == ["dcp", "dcp-r0", "dcp-r1"]

    # 2 -> 1: a plain process (no process group) gets full tensors and the optimizer's moments
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(m, opt)
        into = {"model": msd, "optim": osd}
        dcp.load(into, storage_reader=StorageReader(url, step=3))
        want = Checkpointer(str(out / "ref")).restore(3)
        assert first_difference(want, into, exact_types=False) is None  # a plain model's state_dict is an OrderedDict
        dcp.save(into, storage_writer=StorageWriter(url, step=4))  # 1 -> 2 next

    loaded = job("fsdp_load", 2, url, out)
    assert all(r["diffs"] == {"3": None, "4": None} for r in loaded), loaded


@pytest.mark.slow
def test_fsdp2_on_four_ranks_loads_on_four_and_on_two_bit_exact(tmp_path):
    url = str(tmp_path / "run")
    loaded = job("fsdp_four", 4, url, tmp_path / "out")
    assert sorted(Checkpointer(url).manifest(1).parts) == ["dcp", "dcp-r0", "dcp-r1", "dcp-r2", "dcp-r3"]
    assert [r["diffs"] for r in loaded] == [{"4": None, "2": None}] * 2 + [{"4": None}] * 2, loaded


def test_a_load_holds_its_step_with_one_read_lease_and_one_manifest_read(tmp_path):
    """A load restores its step in several calls (the metadata, then each part): it writes one read
    lease for them all, reads the step's manifest once, and leaves no lease behind. Before, each
    restore took its own lease (a put, a renewal thread, a delete) and read the manifest again: the
    load took 1.25x FileSystemReader's time on the two-rank benchmark."""
    from ckptlib.store import Store
    from ckptlib.testing.faulty import FaultyStore

    url = str(tmp_path / "run")
    dcp.save(sample(0), storage_writer=StorageWriter(url, step=1))
    fs = FaultyStore(Store.from_url(url))
    ck = Checkpointer(fs)
    into = blank()
    dcp.load(into, storage_reader=StorageReader(ck))
    assert first_difference(into, sample(0)) is None
    leases = [c.key for c in fs.calls if c.op in ("put", "put_if_absent") and c.key.startswith("leases/")]
    assert len(leases) == 1 and leases[0].startswith("leases/read-"), leases
    assert [c.op for c in fs.calls if c.key == leases[0]] == ["put", "delete"]
    assert sum(1 for c in fs.calls if c.op == "get" and c.key.startswith("manifests/")) == 1
    assert not fs.list("leases/")
    # a load that fails after its metadata (a plan of another step) leaves no lease either
    reader = StorageReader(ck)
    reader.read_metadata()
    with pytest.raises(CheckpointError, match="coordinator of step 7"):
        reader.read_data(LoadPlan([], storage_data=7), DefaultLoadPlanner())
    assert not fs.list("leases/")
