"""The outer step: the coordinator combines the shards' local models into the new global model.

Local SGD / DiLoCo: each shard trains ``H`` steps from the global model; the cut takes their mean
(``ShardMean``: one shard at a time, so a cut's memory is one model and an accumulator, whatever
the shard count).
With ``outer_lr != 1`` or ``outer_momentum > 0`` the outer gradient ``global - mean`` goes through
SGD with Nesterov momentum, whose buffers are saved as the coordinator's ``outer_optimizer``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .spec import RunSpec


def outer_optimizer(spec: RunSpec, model_state: dict[str, torch.Tensor]) -> tuple[torch.optim.SGD, list[str]]:
    """The outer optimizer over the global model's floating tensors (SGD, Nesterov when momentum > 0)."""
    names = [n for n, t in model_state.items() if t.is_floating_point()]
    params = [torch.nn.Parameter(model_state[n].detach().clone()) for n in names]
    opt = torch.optim.SGD(params, lr=spec.outer_lr, momentum=spec.outer_momentum,
                          nesterov=spec.outer_momentum > 0, foreach=False)
    return opt, names


class ShardMean:
    """The mean of the shards' models, accumulated one shard at a time (in float64, in the order
    added): a cut holds one accumulator and one shard's model, not every shard's, so its memory does
    not grow with the shard count. Non-floating tensors are taken from the first shard."""

    def __init__(self, global_model: dict[str, torch.Tensor]):
        self.ref = global_model
        self.acc: dict[str, torch.Tensor] = {}
        self.n = 0

    def add(self, shard_model: dict[str, torch.Tensor]) -> None:
        for name, ref in self.ref.items():
            if not ref.is_floating_point():
                if self.n == 0:
                    self.acc[name] = shard_model[name].detach().clone()
                continue
            if self.n == 0:
                self.acc[name] = torch.zeros(ref.shape, dtype=torch.float64)
            self.acc[name].add_(shard_model[name].to(torch.float64))
        self.n += 1

    def result(self) -> dict[str, torch.Tensor]:
        if self.n == 0:
            raise ValueError("the mean of no shard: add at least one shard's model")
        return {name: self.acc[name].div_(self.n).to(ref.dtype) if ref.is_floating_point() else self.acc[name]
                for name, ref in self.ref.items()}


def outer_step(spec: RunSpec, global_model: dict[str, torch.Tensor], outer_state: dict,
               shard_models: Sequence[dict[str, torch.Tensor]] | ShardMean) -> tuple[dict[str, torch.Tensor], dict]:
    """The new global model and outer optimizer state.

    ``shard_models``: the shards' models in shard order, or their ``ShardMean`` (what the cut
    passes: it streams them). The mean is accumulated in float64 in shard order (deterministic, and
    exact for one shard). Plain averaging (outer_lr 1, no momentum) takes the mean as is.
    Non-floating tensors are taken from shard 0.
    """
    if not isinstance(shard_models, ShardMean):
        acc = ShardMean(global_model)
        for sm in shard_models:
            acc.add(sm)
        shard_models = acc
    mean = shard_models.result()
    opt, names = outer_optimizer(spec, global_model)
    opt.load_state_dict(outer_state)  # copies the tensors it is given
    if spec.plain_averaging:
        return mean, opt.state_dict()
    params = [p for g in opt.param_groups for p in g["params"]]
    for p, name in zip(params, names, strict=True):
        p.grad = p.detach() - mean[name]
    opt.step()
    new = dict(mean)
    for p, name in zip(params, names, strict=True):
        new[name] = p.detach().clone()
    return new, opt.state_dict()
