"""FSDP2 inside a shard's group: a plain model and its optimizer sharded in place (``fully_shard``).

``shard_model(model, optimizer, blocks, methods, ranks)``, called on every rank of the group with
the model and optimizer already holding the shard's full state (the same on every rank):

1. ``fully_shard`` each of ``blocks``, then the root, over ``init_device_mesh("cpu", (ranks,))``:
   FSDP2 replaces every parameter by a new ``nn.Parameter`` holding this rank's dim-0 shard
   (a ``DTensor``), under the same name;
2. the optimizer is moved onto those parameters: its groups name the new ones, and each state
   tensor shaped like its parameter becomes the same DTensor shard of it (``distribute_tensor``
   with ``src_data_rank=None``: each rank cuts its shard from its own full copy, no
   communication); scalars (AdamW's ``step``) stay as they are.

The optimizer's state is moved rather than reloaded with ``set_optimizer_state_dict``: that call
first initialises an empty state by a step with zero gradients, which would give a fresh optimizer
(round 1) a ``step`` of 1 it never took.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def shard_model(model: nn.Module, optimizer: Any, blocks: Sequence[nn.Module], methods: Sequence[str],
                ranks: int) -> None:
    """Shard ``model`` (each of ``blocks``, then the root) and ``optimizer``'s state over the group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    before = dict(model.named_parameters())
    mesh = init_device_mesh("cpu", (ranks,))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name in methods:
        register_fsdp_forward_method(model, name)
    after = dict(model.named_parameters())
    move_optimizer(optimizer, {id(p): after[name] for name, p in before.items()})


def move_optimizer(optimizer: Any, new_of: dict[int, nn.Parameter]) -> None:
    """Point ``optimizer`` (a torch optimizer, or one with ``optimizers``) at the sharded
    parameters ``new_of[id(old)]``, its state sharded like them."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for opt in getattr(optimizer, "optimizers", [optimizer]):
        for group in opt.param_groups:
            group["params"] = [new_of[id(p)] for p in group["params"]]
        moved = {}
        for old, state in opt.state.items():
            new = new_of[id(old)]
            assert isinstance(new, DTensor)
            moved[new] = {k: distribute_tensor(v, new.device_mesh, new.placements, src_data_rank=None)
                          if isinstance(v, torch.Tensor) and v.shape == old.shape and v.dim() > 0 else v
                          for k, v in state.items()}
        opt.state.clear()
        opt.state.update(moved)
