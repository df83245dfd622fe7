"""ckptlib.hf.Trainer under a real transformers Trainer.train on CPU (a 2-layer GPT-2 built from a
config, dropout on, shuffled data): checkpoint folders, rotation onto ckptlib's GC, resume (in
process and after a SIGKILL) bit-exact against an uninterrupted run.

Run as a script (``python tests/test_hf.py URL OPTIONS_JSON DIR``) it is the training job the kill
test SIGKILLs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from ckptlib import Checkpointer  # noqa: E402
from ckptlib.hf import Trainer  # noqa: E402

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
STEPS = 12


class StopAt(transformers.TrainerCallback):
    """Stop training after ``step`` (a run interrupted there, with the full run's LR schedule)."""

    def __init__(self, step: int | None = None, sleep: float = 0.0):
        self.step, self.sleep = step, sleep

    def on_step_end(self, args, state, control, **kw):
        time.sleep(self.sleep)
        if state.global_step == self.step:
            control.should_training_stop = True


def train(url: str | None, out, *, resume=None, storage_options=None, callbacks=(), stock=False,
          **options) -> GPT2LMHeadModel:
    # One thread in every process of a comparison: the last bits of CPU kernels depend on the thread
    # count, and a test before this one in the same worker may have changed it (CI saw the resumed
    # run differ from the straight one when the killed job ran on two threads and they on one).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(url, out, resume=resume, storage_options=storage_options, callbacks=callbacks, stock=stock,
                      **options)
    finally:
        torch.set_num_threads(threads)


def _train(url: str | None, out, *, resume, storage_options, callbacks, stock, **options) -> GPT2LMHeadModel:
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": r, "labels": r} for r in torch.randint(0, 64, (40, 16), generator=g)]  # 10 steps an epoch
    args = TrainingArguments(output_dir=str(out), max_steps=STEPS, save_steps=2, save_total_limit=2,
                             per_device_train_batch_size=4, use_cpu=True, seed=0, report_to=[], disable_tqdm=True,
                             logging_steps=1, **options)
    kw = {} if stock else {"checkpoint_url": url, "storage_options": storage_options}
    cls = transformers.Trainer if stock else Trainer
    evals = data[:8] if options.get("load_best_model_at_end") else None
    trainer = cls(model=model, args=args, train_dataset=data, eval_dataset=evals, callbacks=list(callbacks), **kw)
    trainer.train(resume_from_checkpoint=resume)
    model.trainer = trainer
    return model


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return train(None, tmp_path_factory.mktemp("straight"), stock=True)


def test_resume_mid_epoch_is_bit_exact_and_folders_hold_only_pointers(tmp_path, straight):
    url = str(tmp_path / "store")
    train(url, tmp_path / "out", callbacks=[StopAt(6)])  # mid-epoch: the Trainer skips batches, restores RNG
    folders = sorted(os.listdir(tmp_path / "out"))
    assert folders == ["checkpoint-4", "checkpoint-6"]  # save_total_limit=2 rotated checkpoint-2 away
    assert sorted(os.listdir(tmp_path / "out" / "checkpoint-6")) == ["ckptlib.json", "trainer_state.json"]
    ck = Checkpointer(url)
    assert len(ck.steps()) == 2  # the step of the rotated folder was dropped
    assert {ck.manifest(s).meta["hf"]["global_step"] for s in ck.steps()} == {4, 6}

    resumed = train(url, tmp_path / "out", resume=True)
    assert_same_weights(straight, resumed)
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-10", "checkpoint-12"]
    assert len(ck.steps()) == 2


def test_resume_refuses_a_folder_ckptlib_did_not_save(tmp_path):
    train(None, tmp_path / "out", callbacks=[StopAt(2)], stock=True)  # the Trainer's own checkpoint-2
    with pytest.raises(FileNotFoundError, match="not a checkpoint ckptlib.hf saved"):
        train(str(tmp_path / "store"), tmp_path / "out", resume=str(tmp_path / "out" / "checkpoint-2"))


def test_load_best_model_at_end_loads_the_best_step(tmp_path):
    url = str(tmp_path / "store")
    model = train(url, tmp_path / "out", eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                  metric_for_best_model="loss", greater_is_better=True)  # the worst loss is the "best": not the last
    best = model.trainer.state.best_model_checkpoint
    assert best.endswith("checkpoint-2"), best
    saved = Checkpointer(url).restore(json.loads((tmp_path / "out" / "checkpoint-2" / "ckptlib.json").read_text())["step"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved["model"][k]), k


@pytest.mark.s3
def test_sigkill_mid_training_then_resume_is_bit_exact(tmp_path, s3_url, straight):
    out = tmp_path / "out"
    victim = subprocess.Popen([sys.executable, __file__, s3_url.url, json.dumps(s3_url.storage_options), str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    ck = Checkpointer(s3_url.url, s3_url.storage_options)
    while len(ck.steps()) < 2:  # a few saves done: kill it wherever it is now
        assert victim.poll() is None and time.monotonic() < deadline, victim.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert not (out / "done").exists()

    # resume in this process, through the Trainer's own resume call
    resumed = train(s3_url.url, out, resume=True, storage_options=s3_url.storage_options)
    assert_same_weights(straight, resumed)


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[3], storage_options=json.loads(sys.argv[2]), callbacks=[StopAt(sleep=0.3)])
    open(os.path.join(sys.argv[3], "done"), "w").close()
