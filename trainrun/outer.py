"""The outer step: the coordinator combines the shards' local models into the new global model.

Local SGD / DiLoCo: each shard trains ``H`` steps from the global model; the cut takes their mean
(``ShardMean``: one shard at a time, so a cut's memory is one model and an accumulator, whatever
the shard count).
With ``outer_lr != 1`` or ``outer_momentum > 0`` the outer gradient ``global - mean`` goes through
SGD with Nesterov momentum, whose buffers are saved as the coordinator's ``outer_optimizer``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ckptlib.distributed import ShardInfo

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
    not grow with the shard count. Non-floating tensors are taken from the first shard.

    A shard trained by a group whose ranks held pieces of its tensors (FSDP) is added piece by piece
    (``add_piece``, then ``end_shard``): each piece goes into its block of the accumulator, so no
    full tensor of a shard is ever put together. Every element is added once per shard and in shard
    order, so the mean is the same, bit for bit, as from whole models; ``end_shard`` checks that the
    shard's pieces covered every tensor exactly once."""

    def __init__(self, global_model: dict[str, torch.Tensor]):
        self.ref = global_model
        self.acc: dict[str, torch.Tensor] = {}
        self.n = 0
        self._boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}  # this shard's pieces so far

    def add(self, shard_model: dict[str, torch.Tensor]) -> None:
        """One shard's whole model."""
        self.add_piece(shard_model, {})
        self.end_shard()

    def add_piece(self, piece: dict[str, torch.Tensor], where: Mapping[str, ShardInfo]) -> None:
        """Part of the current shard's model: each tensor of ``piece`` is the whole tensor, or for a
        name in ``where`` the block of it at ``where[name].offsets``. A block given again (a piece
        replicated over ranks) is added once."""
        for name, ref in self.ref.items():
            if name not in piece:
                continue
            t = piece[name]
            info = where.get(name)
            offsets = tuple(info.offsets) if info is not None else (0,) * ref.dim()
            if info is not None and tuple(info.global_shape) != tuple(ref.shape):
                raise ValueError(f"shard {self.n}'s piece of '{name}' is of a {list(info.global_shape)} tensor, "
                                 f"the global model's is {list(ref.shape)}")
            box = (offsets, tuple(t.shape))
            if len(offsets) != ref.dim() or t.dim() != ref.dim() or \
                    any(o < 0 or o + n > m for o, n, m in zip(offsets, t.shape, ref.shape)):
                raise ValueError(f"shard {self.n}'s piece of '{name}' ({list(t.shape)} at {list(offsets)}) does not "
                                 f"fit its {list(ref.shape)} tensor")
            boxes = self._boxes.setdefault(name, [])
            if box in boxes:
                continue
            if any(_overlap(box, b) for b in boxes):
                raise ValueError(f"shard {self.n}'s pieces of '{name}' overlap ({list(t.shape)} at {list(offsets)})")
            boxes.append(box)
            block = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))
            floating = ref.is_floating_point()
            if not floating and self.n > 0:
                continue  # non-floating tensors are the first shard's
            if name not in self.acc:
                self.acc[name] = torch.zeros(ref.shape, dtype=torch.float64) if floating else \
                    torch.empty(ref.shape, dtype=t.dtype)
            if floating:
                self.acc[name][block].add_(t.to(torch.float64))
            else:
                self.acc[name][block] = t.detach()

    def end_shard(self) -> None:
        """The current shard is complete: its pieces covered every tensor of the global model once."""
        for name, ref in self.ref.items():
            covered = sum(math.prod(shape) for _, shape in self._boxes.get(name, []))
            if covered != ref.numel():
                raise ValueError(f"shard {self.n}'s model covers {covered} of the {ref.numel()} elements of "
                                 f"'{name}': a piece is missing")
        self._boxes = {}
        self.n += 1

    def result(self) -> dict[str, torch.Tensor]:
        if self.n == 0:
            raise ValueError("the mean of no shard: add at least one shard's model")
        return {name: self.acc[name].div_(self.n).to(ref.dtype) if ref.is_floating_point() else self.acc[name]
                for name, ref in self.ref.items()}


def _overlap(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """Whether two blocks (offsets, shape) of one tensor share an element."""
    return all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1])) and \
        all(n > 0 for n in (*a[1], *b[1]))


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
