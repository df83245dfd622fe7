"""What a watchdog reruns, and what it refuses to run.

A rerun is the ``train-shard`` task of the dead attempt's round: the same cut, spec and settings.
The cut comes from the store (the coordinator's beat, else the dead attempt's own beat). The spec
names a workload, i.e. code, so the store is not trusted with it:

* when the watchdog's own process knows the run's spec (``ckpt train`` runs its watchdog beside
  the run and hands it its spec), that spec is used, and a store that says otherwise is refused;
* otherwise the spec read from the store (the coordinator's beat, else the committed config) is
  used only when its workload is a built-in or one of the ``module:factory`` names the operator
  passed to the watchdog (``ckpt watchdog --allow-workload``, the flow's ``allow_workloads``).

A refusal is a ``RerunRefused`` (reported as a ``cannot-rerun`` decision, nothing imported or run).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from ckptlib.documents import Document

from ..documents import Cut, ShardInfo
from ..errors import RerunRefused
from ..layout import shard_index
from ..spec import RunSettings, RunSpec
from .judge import PartView, RunView


@dataclass(frozen=True)
class RerunRequest(Document):
    """Everything the ``train-shard`` task needs to redo ``shard``'s round ``round`` from ``cut``."""

    KIND = "rerun request"

    run_url: str
    shard: int
    round: int
    cut: Cut
    spec: RunSpec
    settings: RunSettings
    generation: int = 0  # the new (live) generation the rerun will write
    attempt_offset: int = 0  # attempts before it: chaos aimed at the dead attempt does not strike again

    @property
    def key(self) -> str:
        return f"{self.run_url}|shard-{self.shard}|r{self.round}|g{self.generation}"


def builtin_workloads() -> frozenset[str]:
    from workloads.base import BUILTIN_WORKLOADS

    return frozenset(BUILTIN_WORKLOADS)


def check_workload(name: str, allowed: Collection[str]) -> None:
    """RerunRefused unless ``name`` is a built-in workload or in ``allowed`` (the operator's list)."""
    if name in builtin_workloads() or name in allowed:
        return
    raise RerunRefused(
        f"the store names workload {name!r}, which is neither a built-in ({', '.join(sorted(builtin_workloads()))}) "
        f"nor on this watchdog's allow-list: not imported, not run. If you trust it, start the watchdog with "
        f"--allow-workload {name} (flow parameter allow_workloads)")


def plan_rerun(view: RunView, pv: PartView, *, known: RunSpec | None, allowed: Collection[str],
               committed_config: Callable[[], dict[str, Any] | None]) -> RerunRequest:
    """The rerun of ``pv``'s round (see the module docstring); RerunRefused says why there is none.
    ``committed_config()`` reads the run's committed config (only called when nothing else says)."""
    shard = shard_index(pv.part)
    if shard is None:
        raise RerunRefused(f"{pv.part} is not a shard")
    info, coord = view.info, view.coordinator
    round_no = pv.round if pv.round is not None else (coord.round if coord is not None else None)
    if round_no is None:
        raise RerunRefused(f"{pv.part}: no round known")
    mine = ShardInfo.of_beat(pv.beat) if pv.beat is not None else None
    cut = None
    if info is not None and coord is not None and coord.round == round_no and info.cut is not None:
        cut = info.cut
    elif mine is not None and pv.beat is not None and pv.beat.round == round_no:
        cut = mine.cut
    if cut is None:
        raise RerunRefused(f"the cut round {round_no} of {pv.part} starts from is unknown (no coordinator beat for it)")
    stored = _stored_spec(info.spec if info is not None else None, committed_config)
    if known is not None:
        if stored is not None and stored.config_hash() != known.config_hash():
            raise RerunRefused("the store's configuration of this run differs from the one this watchdog was given: "
                               "refusing to rerun from it")
        spec = known
    elif stored is None:
        raise RerunRefused("the run's configuration is unknown (no coordinator beat, no committed config)")
    else:
        check_workload(stored.workload, allowed)
        spec = stored
    if mine is not None and mine.config_hash != spec.config_hash():
        raise RerunRefused("the dead attempt's config hash differs from the run's configuration")
    settings = info.settings if info is not None else RunSettings()
    return RerunRequest(run_url=view.url, shard=shard, round=int(round_no), cut=cut, spec=spec, settings=settings)


def _stored_spec(spec: RunSpec | None, committed_config: Callable[[], dict[str, Any] | None]) -> RunSpec | None:
    if spec is not None:
        return spec
    config = committed_config()
    if config is None:
        return None
    try:
        return RunSpec.from_dict(config)
    except ValueError as e:
        raise RerunRefused(f"the run's committed config does not parse: {e}") from None
