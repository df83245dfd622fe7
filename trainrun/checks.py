"""A training run's validation checks, plugged into ``ckptlib.validate`` (``PartChecks``).

ckptlib judges what any checkpoint holds (integrity, shapes, NaN/Inf, norms, changes, optimizer
counters). A run's cut has a layout ckptlib does not know (``docs/run-layout.md``): a coordinator
part and ``shard-0..N-1``, N in the coordinator's ``config`` (``RunSpec.shards``). These checks add:

| check | fails when |
|---|---|
| ``all_shards_present`` | a shard of the cut is missing |
| ``no_unexpected_parts`` | a shard index >= N |
| ``same_round`` | the parts disagree with the coordinator on the round counter |
| ``round_advanced`` | a part's round did not advance since the previous healthy checkpoint |
| ``data_position_advanced`` | a shard consumed fewer than ``min_data_advance`` batches since then |
| ``rng_states_present`` | a shard lacks one of its ``rng`` states (torch, numpy, python) |

and tell ckptlib that a shard's model starts each round from the coordinator's (relative change
and shapes are judged against it). A single-part checkpoint gets none of these (null columns).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptlib.store import Store
from ckptlib.validate import Check, CutView, Findings, Thresholds, Verdict, validate_checkpoint
from ckptlib.validate.stats import get, integer, mode

from .layout import COORDINATOR, shard_index, shard_part

RNG_KINDS = ("torch", "numpy", "python")


def _true(th: Thresholds, ref: Mapping[str, Any]) -> list[Any]:
    return [True]


class RunChecks:
    """The ``PartChecks`` of a training run (see the module docstring)."""

    checks = (
        Check("all_shards_present", "parts", "present", "every shard of the cut (shard-0..N-1) is present",
              in_set=_true),
        Check("no_unexpected_parts", "parts", "expected", "no shard beyond the run's configured count", in_set=_true),
        Check("same_round", "parts", "round", "every part holds the coordinator's round counter",
              in_set=lambda th, ref: [ref.get("round", -1)]),
        Check("round_advanced", "parts", "round_advance",
              "the round counter advanced since the previous healthy checkpoint", between=lambda th, ref: (1, None)),
        Check("data_position_advanced", "parts", "data_advance",
              "each shard's data position advanced (>= min_data_advance batches) since the previous healthy "
              "checkpoint", between=lambda th, ref: (th.min_data_advance, None)),
        Check("rng_states_present", "parts", "rng_present", "each shard holds its torch, numpy and python RNG states",
              in_set=_true),
    )

    def model_base(self, part: str) -> str:
        return COORDINATOR if shard_index(part_of(part)) is not None else part

    def inspect(self, cut: CutView) -> Findings:
        m = cut.manifest
        present: dict[int, list[str]] = {}  # shard index -> its views: the part, or a group's "<part>/r<k>"
        for name in cut.states:
            if (i := shard_index(part_of(name))) is not None:
                present.setdefault(i, []).append(name)
        if m.single or (not present and COORDINATOR not in m.parts):
            return Findings()
        rows: dict[str, dict[str, Any]] = {}
        for part, state in cut.states.items():
            prev = _previous(cut.previous_states, part)
            rnd, prev_rnd = integer(get(state, "round")), integer(get(prev, "round"))
            pos, prev_pos = integer(get(state, "data_position")), integer(get(prev, "data_position"))
            is_shard = shard_index(part_of(part)) is not None
            rng = _rng_present(state)
            rows[part] = {
                "role": "shard" if is_shard else COORDINATOR if part == COORDINATOR else "part",
                "expected": True, "round": rnd, "prev_round": prev_rnd,
                "round_advance": rnd - prev_rnd if rnd is not None and prev_rnd is not None else None,
                "data_position": pos, "prev_data_position": prev_pos,
                "data_advance": pos - prev_pos if pos is not None and prev_pos is not None else None,
                "rng_present": bool(rng) if is_shard else rng,
            }
        n = _configured_shards(get(cut.states.get(COORDINATOR), "config"))
        if n is None and cut.previous is not None:
            before = [i for i in map(shard_index, cut.previous.parts) if i is not None]
            n = max(before) + 1 if before else None
        if n is None:
            n = max(present) + 1 if present else 0
        for i in range(n):
            if i not in present:
                rows[shard_part(i)] = {"role": "shard", "present": False, "expected": True}
        for i, names in present.items():
            for name in names:
                rows[name]["expected"] = i < n
        coord = rows.get(COORDINATOR)
        rounds = [r["round"] for r in rows.values() if r.get("round") is not None]
        round_no = coord["round"] if coord and coord.get("round") is not None else mode(rounds)
        shards = {p: r for p, r in rows.items() if r["role"] == "shard"}
        summary = {"shards_present": len(present),
                   "shards_expected": n, "round": round_no,
                   "data_positions": {p: r.get("data_position") for p, r in sorted(shards.items())
                                      if r.get("present", True)}}
        return Findings(rows=rows, reference={"round": round_no}, leader=COORDINATOR if coord else None,
                        summary=summary)


RUN_CHECKS = RunChecks()


def part_of(view: str) -> str:
    """The part a validated view belongs to: a group's part is validated rank by rank, as
    ``<part>/r<rank>`` (``ckptlib.validate``); any other part is its own view."""
    return view.split("/", 1)[0]


def _previous(states: Mapping[str, Any], view: str) -> Any:
    """``view``'s state in the previous healthy checkpoint: the same view, else its part's (the
    previous cut was written by another number of ranks per shard: one process, or rank 0)."""
    part = part_of(view)
    for name in (view, part, f"{part}/r0"):
        if name in states:
            return states[name]
    return None


def _rng_present(state: Any) -> bool | None:
    rng = get(state, "rng")
    if rng is None:
        return None
    return isinstance(rng, dict) and all(rng.get(k) is not None for k in RNG_KINDS)


def _configured_shards(config: Any) -> int | None:
    """``shards`` of the coordinator's config (a ``RunSpec`` as JSON), if it holds a valid count."""
    n = config.get("shards") if isinstance(config, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def validate_run_checkpoint(url: str | Store, step: int | None = None, **kw: Any) -> Verdict:
    """``ckptlib.validate.validate_checkpoint`` with the run's checks (same arguments)."""
    return validate_checkpoint(url, step, extensions=(RUN_CHECKS,), **kw)
