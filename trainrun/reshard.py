"""Resharding: a run resumed with another shard count continues from its last healthy checkpoint.

The round model makes this possible: every shard starts each round from the coordinator's global
model, which does not depend on the shard count. What belongs to a shard is its inner optimizer's
state (AdamW moments, step counts), its LR scheduler, its data position and RNG states. A shard of
a run with ``new`` shards, starting from a cut of ``old`` shards, takes (``sources``):

* ``new < old`` (merge): the old shards ``j, j+new, j+2*new, ...``: their floating-point tensors
  (torch or numpy) are averaged, in float64 and in shard order (deterministic); everything else
  (step counters, the scheduler, the data position, RNG states) is old shard ``j``'s;
* ``new > old`` (split): a copy of old shard ``j mod old`` (shard ``j < old``: its own). Data comes
  from ``(seed, shard, position)``, so a new shard draws its own batches from the copied position.

A resharded run follows a new trajectory from that step on: its later digests are those of "N
shards up to step S, then M", which the same resume reproduces exactly, and which differ from a
run trained with M shards from the start. The change is recorded where the digest covers it: the
coordinator's state carries ``reshards: [{"step": S, "shards": [N, M]}, ...]`` in every later
checkpoint (and the manifests' ``meta`` repeats it). ``rounds.plan_run`` allows it only when it
starts from the latest committed step (later committed steps of the old trajectory would conflict).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ckptlib import Checkpointer

from .layout import shard_index, shard_part


def sources(old: int, new: int, shard: int) -> list[int]:
    """The shards of an ``old``-shard cut that shard ``shard`` of ``new`` shards starts from."""
    if not (old >= 1 and new >= 1 and 0 <= shard < new):
        raise ValueError(f"need old >= 1, new >= 1 and 0 <= shard < new, got old={old}, new={new}, shard={shard}")
    if new >= old:
        return [shard % old]
    return list(range(shard, old, new))


def cut_shards(ck: Checkpointer, cut: Any) -> int:
    """How many shards the cut ``cut`` (a ``documents.Cut``) holds: the generations the coordinator
    combined (every cut a round hands to the next), else its manifest's shard parts (a committed step
    a run starts from). Every shard asks every round: the manifest is read only when needed."""
    names: Iterable[str] = cut.generations if cut.generations or not cut.committed else ck.manifest(cut.step).parts
    return sum(1 for p in names if shard_index(p) is not None)


def reshard_state(ck: Checkpointer, cut: Any, shard: int, shards: int) -> Any:
    """Shard ``shard``'s starting state in a run of ``shards`` shards, from ``cut`` of another shard
    count, built from its ``sources`` one state at a time (memory: two states). It is not a delta
    base: the shard's next write finds the latest committed blob table instead (unchanged chunks are
    still referenced)."""
    mean = TreeMean()
    for i in sources(cut_shards(ck, cut), shards, shard):
        part = shard_part(i)
        mean.add(ck.restore(cut.step, part=part) if cut.committed else
                 ck.read_fragment(cut.step, part, generation=cut.generations.get(part)))
    return mean.result()


class TreeMean:
    """The mean of states of one structure, added one at a time: floating tensors and arrays are
    averaged (float64 accumulators, in the order added); every other value is the first state's."""

    def __init__(self) -> None:
        self.acc: Any = None
        self.n = 0

    def add(self, state: Any) -> None:
        self.acc = _start(state) if self.n == 0 else _add(self.acc, state, "")
        self.n += 1

    def result(self) -> Any:
        if self.n == 0:
            raise ValueError("the mean of no state: add at least one")
        return _finish(self.acc, self.n)


class _Acc:
    """A float64 accumulator standing for a floating tensor or array of the first state."""

    def __init__(self, value: Any):
        self.like = value
        self.sum = value.detach().to(torch.float64).clone() if isinstance(value, torch.Tensor) else value.astype(np.float64)


def _floating(x: Any) -> bool:
    return (isinstance(x, torch.Tensor) and x.is_floating_point()) or \
        (isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating))


def _start(x: Any) -> Any:
    if _floating(x):
        return _Acc(x)
    if isinstance(x, dict):
        out = copy.copy(x)  # keeps the mapping's type (OrderedDict, defaultdict)
        for k in out:
            out[k] = _start(x[k])
        return out
    if isinstance(x, list):
        return [_start(v) for v in x]
    if isinstance(x, tuple) and type(x) is tuple:
        return tuple(_start(v) for v in x)
    return x


def _add(acc: Any, x: Any, path: str) -> Any:
    if isinstance(acc, _Acc):
        if not _floating(x) or tuple(x.shape) != tuple(acc.like.shape):
            raise ValueError(f"cannot average shard states: {path or '/'} differs in type or shape between shards")
        if isinstance(x, torch.Tensor):
            acc.sum.add_(x.detach().to(torch.float64))
        else:
            acc.sum += x.astype(np.float64)
        return acc
    if isinstance(acc, dict):
        if not isinstance(x, dict) or list(x) != list(acc):
            raise ValueError(f"cannot average shard states: {path or '/'} has other keys in another shard")
        for k in acc:
            acc[k] = _add(acc[k], x[k], f"{path}/{k}")
        return acc
    if isinstance(acc, list | tuple):
        if not isinstance(x, list | tuple) or len(x) != len(acc):
            raise ValueError(f"cannot average shard states: {path or '/'} has another length in another shard")
        items = [_add(a, b, f"{path}/{i}") for i, (a, b) in enumerate(zip(acc, x, strict=True))]
        return items if isinstance(acc, list) else tuple(items)
    return acc  # not averaged: the first state's


def _finish(acc: Any, n: int) -> Any:
    if isinstance(acc, _Acc):
        mean = acc.sum / n
        return mean.to(acc.like.dtype) if isinstance(mean, torch.Tensor) else mean.astype(acc.like.dtype)
    if isinstance(acc, dict):
        for k in acc:
            acc[k] = _finish(acc[k], n)
        return acc
    if isinstance(acc, list):
        return [_finish(v, n) for v in acc]
    if isinstance(acc, tuple):
        return tuple(_finish(v, n) for v in acc)
    return acc
