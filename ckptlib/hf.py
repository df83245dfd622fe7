"""Hugging Face ``Trainer`` integration: every Trainer save is an incremental ckptlib step.

    from ckptlib.hf import Trainer              # transformers.Trainer with ckptlib checkpoints
    trainer = Trainer(model=model, args=args, train_dataset=ds, checkpoint_url="s3://bucket/run-1")
    trainer.train(resume_from_checkpoint=True)  # or ".../checkpoint-500"

A ``TrainerCallback`` cannot do this: ``on_save`` runs after the Trainer has written its own folder
(``torch.save`` pickles of the optimizer, scheduler and RNG states, the full weights), and a callback
has no say in loading. So the integration is a mixin over the Trainer's own checkpoint methods
(``_save_checkpoint`` and the ``_load_*`` it calls on resume): ``CheckpointMixin`` for your own Trainer
subclass (``class MyTrainer(CheckpointMixin, SFTTrainer)``), ``Trainer`` for the plain one.

A save commits model, optimizer, scheduler, AMP scaler, RNG states (python, numpy, torch CPU and
CUDA) and the trainer state as the next ckptlib step (``ckptlib.named``), then publishes the
``checkpoint-N`` folder the Trainer expects, holding only ``trainer_state.json`` (the Trainer reads it
on resume) and a pointer ``ckptlib.json``: written aside and renamed into place, so a folder the
Trainer finds (``resume_from_checkpoint=True`` takes the newest) always names a committed step.
``save_total_limit`` rotation deletes folders as usual; the GC that follows drops the steps no
folder points at. ``trainer.save_model()`` still writes the Hugging Face format for inference.

Single-process training only (one writer; per-rank RNG states of a distributed run are not taken):
a distributed, DeepSpeed or FSDP run is refused when the Trainer is built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tempfile
from typing import Any

import numpy as np
import torch
import transformers
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from . import pointer
from .gc import DEFAULT_GRACE_S
from .named import NamedCheckpoints

POINTER = "ckptlib.json"
TRAINER_STATE = "trainer_state.json"
META_KEY = "hf"


def pointer_at(folder: str) -> str:
    return os.path.join(folder, POINTER)


class CheckpointMixin:
    """Checkpoints of a ``transformers.Trainer`` (a base after this one) into the store at ``checkpoint_url``.
    ``storage_options``, ``checkpointer_options``: for ``ckptlib.Checkpointer``; ``grace_s``: for its GC."""

    def __init__(self, *args: Any, checkpoint_url: str, storage_options: dict | None = None,
                 grace_s: float = DEFAULT_GRACE_S, checkpointer_options: dict | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        t: Any = self
        if t.args.world_size > 1 or t.is_deepspeed_enabled or t.is_fsdp_enabled:
            raise ValueError("ckptlib.hf checkpoints single-process training (one writer, this process's RNG "
                             "states): run without torchrun/DeepSpeed/FSDP, or use the Trainer's own checkpoints")
        if t.args.push_to_hub and str(t.args.hub_strategy).endswith("checkpoint"):
            raise ValueError("ckptlib.hf keeps checkpoints in its store, not in folders to push: use "
                             "hub_strategy='every_save' or 'end' (the model is still pushed)")
        self.checkpoints = NamedCheckpoints(checkpoint_url, storage_options, META_KEY, pointer_at=pointer_at,
                                            grace_s=grace_s, **(checkpointer_options or {}))
        self._resumed: tuple[str, dict] | None = None

    # --- saving ------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t: Any = self
        run_dir = t._get_output_dir(trial=trial)
        folder = os.path.abspath(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{t.state.global_step}"))
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        if t.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) \
                and t.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{t.state.best_global_step}")
            if os.path.exists(best):
                t.state.best_model_checkpoint = best
        for cb in [cb for cb in t.callback_handler.callbacks + [t.control] if isinstance(cb, ExportableState)]:
            name = type(cb).__name__  # as Trainer._save_checkpoint: stateful callbacks into the trainer state
            if isinstance(t.state.stateful_callbacks[name], list):
                t.state.stateful_callbacks[name].append(cb.state())
            else:
                t.state.stateful_callbacks[name] = cb.state()
        state = self._training_state()
        step = self.checkpoints.commit(folder, state, {"global_step": t.state.global_step})
        replaced = _publish(folder, state["trainer_state"], pointer.Pointer(self.checkpoints.url, step, folder))
        before = _folders(run_dir)
        rotate_checkpoints(output_dir=run_dir, save_total_limit=t.args.save_total_limit,
                           best_model_checkpoint=t.state.best_model_checkpoint, use_mtime=True)
        if replaced or _folders(run_dir) != before:
            self.checkpoints.collect()  # the steps of replaced or rotated folders are garbage now

    def _training_state(self) -> dict[str, Any]:
        """What a resume needs, as ckptlib state (no pickles): the Trainer's torch.save files' contents."""
        t: Any = self
        state: dict[str, Any] = {"model": t.model.state_dict()}
        if not t.args.save_only_model:
            state["optimizer"] = t.optimizer.state_dict()
            state["scheduler"] = t.lr_scheduler.state_dict()
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
            state["rng"] = {"python": random.getstate(), "numpy": np.random.get_state(),
                            "cpu": torch.random.get_rng_state()}
            if torch.cuda.is_available():
                state["rng"]["cuda"] = torch.cuda.random.get_rng_state()
        # as TrainerState.save_to_json writes it: the folder's copy is what the Trainer reads on resume
        state["trainer_state"] = json.dumps(dataclasses.asdict(t.state), indent=2, sort_keys=True) + "\n"
        return state

    # --- resuming ----------------------------------------------------------------------------------

    def _restored(self, folder: str) -> dict:
        """The state ``folder`` points at, restored once for the several ``_load_*`` calls of a resume."""
        folder = os.path.abspath(folder)
        if not os.path.exists(pointer_at(folder)):
            raise FileNotFoundError(f"{folder} has no {POINTER}: it is not a checkpoint ckptlib.hf saved (the "
                                    "Trainer's own? resume it with transformers.Trainer, never with this one)")
        if self._resumed is None or self._resumed[0] != folder:
            self._resumed = (folder, self.checkpoints.load(folder))
        return self._resumed[1]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        t: Any = self
        (model or t.model).load_state_dict(self._restored(resume_from_checkpoint)["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        t: Any = self
        state = self._restored(checkpoint)
        if "optimizer" in state:
            t.optimizer.load_state_dict(state["optimizer"])
            t.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        t: Any = self
        state = self._restored(checkpoint)
        if "scaler" in state and getattr(t.accelerator, "scaler", None) is not None:
            t.accelerator.scaler.load_state_dict(state["scaler"])
        # the Trainer loads the scaler last but the RNG states: let the restored tensors go
        self._resumed = (os.path.abspath(checkpoint), {"rng": state.get("rng")})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        rng = self._restored(checkpoint).get("rng")
        if rng is None:
            return
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.random.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.random.set_rng_state(rng["cuda"])

    def _load_best_model(self) -> None:
        t: Any = self
        best = t.state.best_model_checkpoint
        t.model.load_state_dict(self.checkpoints.load(os.path.abspath(best), select=["model"])["model"])


class Trainer(CheckpointMixin, transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints are ckptlib steps (``checkpoint_url=`` is required)."""


def _folders(run_dir: str) -> set[str]:
    try:
        return {n for n in os.listdir(run_dir) if n.startswith(f"{PREFIX_CHECKPOINT_DIR}-")}
    except FileNotFoundError:
        return set()


def _publish(folder: str, trainer_state: str, ptr: pointer.Pointer) -> bool:
    """Write ``folder`` (trainer_state.json and the pointer) aside, then rename it into place, so a
    ``checkpoint-N`` the Trainer finds is whole. True if it replaced a folder of the same name."""
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    for stale in os.listdir(parent):  # left by a run killed while publishing
        if stale.startswith(".ckptlib-tmp-"):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".ckptlib-tmp-")
    with open(os.path.join(tmp, TRAINER_STATE), "w", encoding="utf-8") as f:
        f.write(trainer_state)
    pointer.write(pointer_at(tmp), ptr)
    replaced = os.path.isdir(folder)
    if replaced:  # saved again after resuming from an older checkpoint
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    return replaced
