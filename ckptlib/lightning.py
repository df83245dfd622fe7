"""Lightning ``CheckpointIO`` plugin: every Lightning checkpoint becomes an incremental ckptlib step.

    from ckptlib.lightning import CheckpointIO
    trainer = Trainer(plugins=[CheckpointIO("s3://bucket/run-1")], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, data, ckpt_path="last")

Each ``save_checkpoint(checkpoint, path)`` commits the checkpoint dict as the next ckptlib step (a
counter: Lightning saves ``epoch=0-step=4.ckpt`` and ``last.ckpt`` at the same global step, with
slightly different callback states, so its global step cannot name a step), with the path in the
step's meta, then writes a pointer file at ``path`` (``ckptlib.pointer``). The pointer keeps
everything ``ModelCheckpoint`` does with files working unchanged: ``exists`` checks, the version
counter, ``ckpt_path="last"`` (it lists the folder and takes the newest by mtime), ``save_last="link"``
symlinks. Deltas are against the previous step, so ``last.ckpt`` saved right after a top-k file
costs almost nothing.

``remove_checkpoint(path)`` deletes the pointer and GCs (``ckptlib.named``; so does a save that
replaces a pointer, as each ``last.ckpt`` save does): top-k rotation and superseded ``last.ckpt``
saves free their bytes.

Values: ckptlib stores what it can restore exactly (``ckptlib.tree``): tensors, numbers, strings,
containers, OrderedDicts, torch dtypes... A checkpoint holding anything else (a ``pathlib.Path`` or a
``Namespace`` among the hyperparameters, an object a callback put in its state) is refused by
``save_checkpoint`` with ``UnsupportedState`` naming the key, before anything is written: it is never
converted silently. ``load_checkpoint`` never unpickles: a path holding a ``torch.save`` file is refused.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningIO

from .checkpointer import Checkpointer
from .errors import UnsupportedState
from .gc import DEFAULT_GRACE_S
from .named import NamedCheckpoints

META_KEY = "lightning"


class CheckpointIO(_LightningIO):
    """Save Lightning checkpoints into the ckptlib store at ``url``.

    ``storage_options`` and ``checkpointer_options`` go to ``ckptlib.Checkpointer``; ``grace_s`` to its
    GC (objects younger than that are swept by a later GC, so a save in flight is never swept)."""

    def __init__(self, url: str, storage_options: dict | None = None, *, grace_s: float = DEFAULT_GRACE_S,
                 **checkpointer_options: Any):
        self.url = url
        self.named = NamedCheckpoints(url, storage_options, META_KEY, grace_s=grace_s, **checkpointer_options)

    @property
    def checkpointer(self) -> Checkpointer:
        return self.named.checkpointer

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Commit ``checkpoint`` as the next step, then point ``path`` at it."""
        if storage_options is not None:
            raise TypeError("ckptlib.lightning.CheckpointIO takes no storage_options per save: pass them to "
                            "CheckpointIO(url, storage_options=...)")
        name = _name(path)
        try:
            self.named.save(name, checkpoint, {"global_step": checkpoint.get("global_step"),
                                               "epoch": checkpoint.get("epoch")})
        except UnsupportedState as e:
            raise UnsupportedState(
                f"Lightning checkpoint {name}: {e}. ckptlib keeps only values it restores exactly: store such a "
                "value as a str/number/dict (e.g. str(path) in save_hyperparameters, vars(namespace)), or drop it "
                "in LightningModule.on_save_checkpoint") from None

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint ``path`` points at, bit-exact. ``map_location``: None, a device or a device
        string (tensors land there). ``weights_only`` changes nothing: nothing read is ever executed."""
        if map_location is not None and not isinstance(map_location, str | torch.device):
            raise TypeError(f"map_location={map_location!r}: ckptlib.lightning restores onto one device; pass a "
                            "device or a device string")
        return self.named.load(_name(path), device=map_location or "cpu")

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the pointer at ``path``; GC every step no pointer names any more."""
        self.named.remove(_name(path))

    def live_steps(self) -> set[int]:
        """Steps a pointer at the path each step was saved under names now."""
        return self.named.live_steps()

    def teardown(self) -> None:
        """Close the Checkpointer (saves here are synchronous: nothing is in flight); reopened on next use."""
        self.named.close()


def _name(path: Any) -> str:
    """The name a step is saved under: the absolute path (local) or the URL as given."""
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)
