"""Who stores what in a group's save: values every holder has identical are stored once. Pure.

Each rank describes the values that other ranks may hold too (``Summary``: its plain values and
its replicated DTensor pieces, each with the digest of its bytes); every rank computes the same
``Plan`` from all the summaries (one exchange). A value is stored once, by one of its holders, only
when every holder has the same bytes under the same spec: DDP parameters, ``Replicate()``
placements, equal optimizer step counters. Values that differ (a per-rank RNG state or counter)
are each holder's own. A ``Replicate()`` piece whose copies differ is refused: the replicas
diverged, and no single value is the tensor. Shared values are spread over their holders, largest
first, each to the holder that stores the fewest bytes so far (as DCP's dedup does), so a 2-rank
DDP save writes one replica, half on each rank; the assignment depends only on sizes, so each value
goes to the same rank at every save (its delta base is that rank's previous save).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedState

__all__ = ["Candidate", "Plan", "Summary", "candidate_key", "make_plan"]


def candidate_key(path: str, offsets: tuple[int, ...] | None, shape: tuple[int, ...]) -> str:
    """What makes two ranks' values the same value: the leaf's path and, for a piece, its box."""
    return json.dumps([path, list(offsets) if offsets is not None else None, list(shape)])


@dataclass(frozen=True)
class Candidate:
    """A value other ranks may hold too. ``spec``: the JSON of its logical spec; ``must_match``: a
    ``Replicate()`` piece, whose copies must be equal."""

    key: str
    spec: str
    nbytes: int
    digest: str
    must_match: bool = False


@dataclass(frozen=True)
class Summary:
    """What one rank tells the others before a save: its skeleton's digest, the bytes it stores in
    any case (its shards) and its candidates."""

    rank: int
    save_id: str
    skeleton: str
    fixed_bytes: int
    candidates: tuple[Candidate, ...]

    def to_json(self) -> dict[str, Any]:
        """As it travels between ranks (``ckptlib.distributed.wire``)."""
        return {"rank": self.rank, "save_id": self.save_id, "skeleton": self.skeleton, "fixed_bytes": self.fixed_bytes,
                "candidates": [[c.key, c.spec, c.nbytes, c.digest, c.must_match] for c in self.candidates]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Summary:
        """A summary another rank sent; TypeError/KeyError/ValueError when it is not one."""
        candidates = []
        for key, spec, nbytes, digest, must_match in d["candidates"]:
            candidates.append(Candidate(_of(key, str), _of(spec, str), _of(nbytes, int), _of(digest, str),
                                        _of(must_match, bool)))
        return cls(_of(d["rank"], int), _of(d["save_id"], str), _of(d["skeleton"], str), _of(d["fixed_bytes"], int),
                   tuple(candidates))


def _of(v: Any, kind: type) -> Any:
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise TypeError(f"{type(v).__name__} where {kind.__name__} was expected")
    return v


@dataclass(frozen=True)
class Plan:
    """``owner[r][key]``: the rank that stores rank r's candidate ``key``; ``skeleton_of[r]``: the
    lower rank whose identical skeleton rank r shares (None: r stores its own); ``save_id``: the
    leader's, which names every rank fragment of this save."""

    save_id: str
    owner: tuple[dict[str, int], ...]
    skeleton_of: tuple[int | None, ...]

    def stored_bytes(self, summaries: list[Summary]) -> list[int]:
        """Bytes each rank stores under this plan."""
        out = [s.fixed_bytes for s in summaries]
        for s in summaries:
            for c in s.candidates:
                if self.owner[s.rank][c.key] == s.rank:
                    out[s.rank] += c.nbytes
        return out


def make_plan(summaries: list[Summary]) -> Plan:
    """The plan every rank computes alike from all ranks' summaries (in rank order)."""
    if [s.rank for s in summaries] != list(range(len(summaries))):
        raise ValueError("summaries must be given in rank order, one per rank")
    holders: dict[str, list[tuple[int, Candidate]]] = {}
    for s in summaries:
        for c in s.candidates:
            holders.setdefault(c.key, []).append((s.rank, c))
    load = [s.fixed_bytes for s in summaries]
    owner: list[dict[str, int]] = [{} for _ in summaries]
    shared: list[tuple[str, list[int], int]] = []
    diverged: list[str] = []
    for key, held in holders.items():
        same = len({(c.spec, c.digest) for _, c in held}) == 1
        if len(held) > 1 and same:
            shared.append((key, [r for r, _ in held], held[0][1].nbytes))
            continue
        if len(held) > 1 and any(c.must_match for _, c in held):
            diverged.append(f"{json.loads(key)[0] or '/'} (ranks {[r for r, _ in held][:8]})")
        for r, c in held:
            owner[r][key] = r
            load[r] += c.nbytes
    if diverged:
        raise UnsupportedState(
            f"{len(diverged)} DTensor(s) placed Replicate() hold different values on different ranks: "
            f"{'; '.join(diverged[:5])}. Their replicas diverged (non-deterministic kernels, or a rank that "
            "skipped an update), so no single value is the tensor: make the replicas agree (e.g. broadcast "
            "from rank 0) before saving")
    for key, ranks, nbytes in sorted(shared, key=lambda k: (-k[2], k[0])):
        chosen = min(ranks, key=lambda r: (load[r], r))
        load[chosen] += nbytes
        for r in ranks:
            owner[r][key] = chosen
    first: dict[str, int] = {}
    skeleton_of = []
    for s in summaries:
        skeleton_of.append(first.get(s.skeleton))
        first.setdefault(s.skeleton, s.rank)
    return Plan(summaries[0].save_id, tuple(owner), tuple(skeleton_of))
