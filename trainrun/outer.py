"""The outer step: the coordinator combines the shards' local models into the new global model.

Local SGD / DiLoCo: each shard trains ``H`` steps from the global model; the cut takes their mean.
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


def outer_step(spec: RunSpec, global_model: dict[str, torch.Tensor], outer_state: dict,
               shard_models: Sequence[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict]:
    """The new global model and outer optimizer state.

    The shards' mean is accumulated in float64 in shard order (deterministic, and exact for one
    shard). Plain averaging (outer_lr 1, no momentum) takes the mean as is. Non-floating tensors
    are taken from shard 0.
    """
    n = len(shard_models)
    mean: dict[str, torch.Tensor] = {}
    for name, ref in global_model.items():
        if ref.is_floating_point():
            acc = torch.zeros(ref.shape, dtype=torch.float64)
            for sm in shard_models:
                acc.add_(sm[name].to(torch.float64))
            mean[name] = acc.div_(n).to(ref.dtype)
        else:
            mean[name] = shard_models[0][name].detach().clone()
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
