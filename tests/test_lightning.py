"""ckptlib.lightning.CheckpointIO under a real Lightning Trainer.fit on CPU: round trip, top-k/last
rotation onto ckptlib's GC, refusals, resume (in process and after a SIGKILL) bit-exact.

Run as a script (``python tests/test_lightning.py URL OPTIONS_JSON DIR MAX_STEPS``) it is the
training job the kill test SIGKILLs."""

from __future__ import annotations

import copy
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ckptlib import Checkpointer, UnsupportedState  # noqa: E402
from ckptlib.lightning import CheckpointIO  # noqa: E402
from ckptlib.pointer import NotAPointer  # noqa: E402

warnings.filterwarnings("ignore", module="lightning")


class Net(L.LightningModule):
    """A tiny regressor with saved hyperparameters, AdamW and a step LR schedule."""

    def __init__(self, hidden: int = 16, lr: float = 0.05, extra: object = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    # Two batches an epoch and a save every two steps: Lightning resumes exactly only at an epoch's
    # end (mid-epoch it restarts a plain DataLoader; the same with its own TorchCheckpointIO). No
    # shuffle: the order does not depend on RNG states Lightning does not checkpoint.
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def trainer(io: CheckpointIO | None, folder, max_steps: int, callbacks=()) -> L.Trainer:
    ckpt = ModelCheckpoint(dirpath=str(folder), save_last=True, save_top_k=2, monitor="loss",
                           every_n_train_steps=2)
    return L.Trainer(max_steps=max_steps, precision="bf16-mixed", accelerator="cpu", devices=1,
                     plugins=[io] if io is not None else None, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=[ckpt, *callbacks], num_sanity_val_steps=0)


def fit(io, folder, max_steps: int, ckpt_path=None, callbacks=()) -> Net:
    # One thread in every process of a comparison: the last bits of CPU kernels depend on the thread
    # count, and a test before this one in the same worker may have changed it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        L.seed_everything(0, verbose=False)
        model = Net()
        trainer(io, folder, max_steps, callbacks).fit(model, data(), ckpt_path=ckpt_path)
    finally:
        torch.set_num_threads(threads)
    return model


def assert_same(a, b, path="") -> None:
    """Equal values of equal types, tensors bit for bit (dtype, shape, bytes)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


class Recording(CheckpointIO):
    """The plugin, keeping a deep copy of each checkpoint dict Lightning hands it (by path)."""

    def __init__(self, url: str, **kw):
        super().__init__(url, **kw)
        self.handed: dict[str, dict] = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.handed[os.path.abspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def test_fit_round_trips_exactly_and_rotation_frees_steps(tmp_path):
    io = Recording(str(tmp_path / "store"))
    fit(io, tmp_path / "ckpts", max_steps=10)

    files = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert "last.ckpt" in files and len(files) == 3, files  # top-2 + last: Lightning's rotation ran
    for name in files:
        path = str(tmp_path / "ckpts" / name)
        loaded = io.load_checkpoint(path)
        assert_same(io.handed[path], loaded)
        assert loaded["hyper_parameters"] == {"hidden": 16, "lr": 0.05, "extra": None}
        assert loaded["lr_schedulers"][0]["_last_lr"] == io.handed[path]["lr_schedulers"][0]["_last_lr"]
    # 10 saves (5 top-k candidates + 5 last); only what a pointer names (and the newest) is kept
    ck = Checkpointer(str(tmp_path / "store"))
    assert set(ck.steps()) == io.live_steps() | {ck.steps()[-1]}
    assert len(ck.steps()) == 3
    io.teardown()


def test_resume_last_in_process_is_bit_exact(tmp_path):
    straight = fit(None, tmp_path / "a", max_steps=10)
    fit(CheckpointIO(str(tmp_path / "store")), tmp_path / "b", max_steps=6)
    resumed = fit(CheckpointIO(str(tmp_path / "store")), tmp_path / "b", max_steps=10, ckpt_path="last")
    assert_same(straight.state_dict(), resumed.state_dict())


def test_unrestorable_hyperparameter_is_refused_naming_the_key(tmp_path):
    io = CheckpointIO(str(tmp_path / "store"))
    L.seed_everything(0, verbose=False)
    model = Net(extra=pathlib.Path("/data/x"))
    with pytest.raises(UnsupportedState, match=r"hyper_parameters/extra.*PosixPath|PosixPath.*hyper_parameters/extra"):
        trainer(io, tmp_path / "ckpts", max_steps=2).fit(model, data())
    assert Checkpointer(str(tmp_path / "store")).steps() == []  # refused before anything was written
    assert not (tmp_path / "ckpts" / "last.ckpt").exists()


def test_load_refuses_files_ckptlib_did_not_write(tmp_path):
    io = CheckpointIO(str(tmp_path / "store"))
    foreign = tmp_path / "torch.ckpt"
    foreign.write_bytes(b"PK\x03\x04" + b"\0" * 200)  # the start of a torch.save zip
    with pytest.raises(NotAPointer, match="never unpickles"):
        io.load_checkpoint(foreign)
    foreign.write_bytes(b"{" * (1 << 20))  # a huge file is refused before it is read
    with pytest.raises(NotAPointer, match="bytes, not a ckptlib pointer"):
        io.load_checkpoint(foreign)
    other = CheckpointIO(str(tmp_path / "other"))
    fit(other, tmp_path / "ckpts", max_steps=2)
    with pytest.raises(ValueError, match="construct it with url="):
        io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")


@pytest.mark.s3
def test_sigkill_mid_training_then_resume_last_is_bit_exact(tmp_path, s3_url):
    straight = fit(None, tmp_path / "a", max_steps=16)

    victim = subprocess.Popen([sys.executable, __file__, s3_url.url, json.dumps(s3_url.storage_options),
                               str(tmp_path / "b"), "16"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    ck = Checkpointer(s3_url.url, s3_url.storage_options)
    while len(ck.steps()) < 3:  # a few saves done: kill it wherever it is now (training, saving, in GC)
        assert victim.poll() is None and time.monotonic() < deadline, victim.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "b" / "done").exists()

    # resume in this process, through Lightning's own resume call
    resumed = fit(CheckpointIO(s3_url.url, s3_url.storage_options), tmp_path / "b", 16, ckpt_path="last")
    assert_same(straight.state_dict(), resumed.state_dict())


def test_gc_lock_of_a_run_killed_in_gc_does_not_stall_the_resumed_run(tmp_path):
    url = str(tmp_path / "store")
    fit(CheckpointIO(url), tmp_path / "ckpts", max_steps=2)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from ckptlib.leases import GcLock; "
                               "from ckptlib.store import Store; GcLock(Store.from_url(sys.argv[1])).acquire(); "
                               "print('held', flush=True); time.sleep(600)", url], stdout=subprocess.PIPE)
    assert holder.stdout.readline() == b"held\n"
    holder.send_signal(signal.SIGKILL)  # a GC killed while it holds gc.lock (it expires in two minutes)
    holder.wait()
    t0 = time.monotonic()
    fit(CheckpointIO(url), tmp_path / "ckpts", max_steps=4, ckpt_path="last")
    assert time.monotonic() - t0 < 20  # a save would wait for the lock to expire (120 s)
    assert len(Checkpointer(url).steps()) == 3  # rotation's GC ran too: top-2 and last


def test_importing_ckptlib_loads_neither_framework():
    code = ("import sys, ckptlib, ckptlib.named; ckptlib.Checkpointer; "
            "print(sorted(m for m in ('lightning', 'transformers', 'pytorch_lightning') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def _victim(url: str, options: str, folder: str, max_steps: int) -> None:
    """Train slowly (a pause per batch) with the plugin until killed."""
    class Slow(L.Callback):
        def on_train_batch_end(self, *args):
            time.sleep(0.2)

    fit(CheckpointIO(url, json.loads(options)), folder, max_steps, callbacks=[Slow()])
    pathlib.Path(folder, "done").touch()


if __name__ == "__main__":
    _victim(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
