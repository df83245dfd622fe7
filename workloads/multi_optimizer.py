"""Several torch optimizers behind the one ``optimizer`` attribute of the workload protocol.

recsys needs two: ``SparseAdam`` for the embedding tables (it updates only the rows a batch touched,
and only their moments) and ``Adam`` for the dense MLP (SparseAdam rejects dense gradients, Adam
rejects sparse ones).

``state_dict()`` has the standard single-optimizer layout, so code that reads optimizer states
(validation: "second moments >= 0") needs no special case: ``{"state": {i: ...}, "param_groups":
[...]}`` with the parameters numbered across the parts in order, first part's groups first.
``load_state_dict`` splits it back by the parts' parameter counts.

Not a ``torch.optim.Optimizer`` subclass: ``isinstance(opt, Optimizer)`` is False, so a torch LR
scheduler cannot drive it (recsys has no scheduler).
"""

from __future__ import annotations

from typing import Any

import torch


class MultiOptimizer:
    def __init__(self, *parts: torch.optim.Optimizer) -> None:
        if not parts:
            raise ValueError("MultiOptimizer needs at least one optimizer")
        self.parts = parts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.parts for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.parts:
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self.parts:
            sd = opt.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in opt.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        want = [len(opt.param_groups) for opt in self.parts]
        if len(groups) != sum(want):
            raise ValueError(f"optimizer state has {len(groups)} param groups, this MultiOptimizer has "
                             f"{sum(want)} ({want} per part): saved by a different workload or config?")
        state = {int(k): v for k, v in state_dict["state"].items()}  # JSON round trips may stringify keys
        offset, g0 = 0, 0
        for opt, n_groups in zip(self.parts, want):
            n_params = sum(len(g["params"]) for g in opt.param_groups)
            part_groups = [{**g, "params": [i - offset for i in g["params"]]} for g in groups[g0:g0 + n_groups]]
            part_state = {i - offset: s for i, s in state.items() if offset <= i < offset + n_params}
            opt.load_state_dict({"state": part_state, "param_groups": part_groups})
            offset += n_params
            g0 += n_groups
