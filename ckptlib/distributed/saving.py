"""Saving a group's part: each rank's fragment, then the group fragment (docs/distributed.md).

A collective save (every rank of a ``CollectiveCheckpointer`` calls it), through the rank's
``PartWriter`` (``ckptlib.part_writer``):

1. foreground, on each rank: flatten the state (DTensors as their local shards), hash the values
   other ranks may hold too, and exchange those digests (one ``all_gather`` on the checkpointer's
   own gloo group): every rank computes the same ``Plan`` (who stores each shared value);
2. snapshot what this rank stores (a copy for ``save_async``: the caller may go on then);
3. in the background for ``save_async``: encode it against this rank's previous save (deltas,
   unchanged chunks) and write the rank fragment (``put_if_absent`` under a key unique to this
   save), all under the rank's save lease (``PartWriter.writing``), as any save;
4. each rank reports its fragment (or its error) to the leader (rank 0 of the group), which reads
   the rank fragments back, checks them together (``Group.problems``), and writes the group
   fragment: embedded in the manifest it commits (``Checkpointer.save``), or as the part's fragment
   object of a cut (``write_fragment``); every rank gets the outcome (its error included).

A rank that dies before step 4 leaves rank fragments nobody names (GC sweeps them): no commit, and
the next save, of another save id, writes its own. ``write_group`` writes a group's part from one
process, given each rank's state as plain values (a coordinator that averaged groups piece by piece).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from .. import commit
from ..bases import substep_chain
from ..errors import CorruptCheckpoint, ObjectNotFound
from ..manifest import Fragment, Manifest, document_checksum, dumps
from ..part_writer import PartWriter
from ..save import Snapshot
from ..store import Store
from .collective import Collective, Outcome, RemoteError
from .documents import (
    GroupFragment,
    LocalLeaf,
    RankFragment,
    RankLayout,
    RankRef,
    loads_rank_fragment,
    rank_digest,
    rank_fragment_key,
)
from .group import Group, stored_path
from .local import LocalState
from .plan import Candidate, Plan, Summary, candidate_key, make_plan

__all__ = ["Target", "build_group_fragment", "new_save_id", "rank_base_key", "summarize", "stored_values"]


def new_save_id() -> str:
    return secrets.token_hex(8)


def rank_base_key(part: str, rank: int) -> str:
    """The key of a rank's delta base among a Checkpointer's bases (a process may write several ranks)."""
    return f"{part}#r{rank}"


def _skeleton_digest(skeleton: Any) -> str:
    return hashlib.blake2b(json.dumps(skeleton, separators=(",", ":")).encode(), digest_size=16).hexdigest()


def _key(local: LocalState, i: int) -> str:
    spec, _ = local.leaves[i]
    piece = local.pieces.get(i)
    return candidate_key(local.logical[i].path, piece.offsets if piece is not None else None, spec.shape)


def summarize(local: LocalState, rank: int, save_id: str) -> Summary:
    """What this rank tells the others: the digests of the values they may hold too (plain values,
    replicated pieces) and the bytes of the shards only it holds."""
    which = _candidate_leaves(local)
    fixed = local.local_bytes - sum(local.leaves[i][0].nbytes for i in which)
    candidates = tuple(Candidate(_key(local, i), json.dumps(local.logical[i].logical_json(), sort_keys=True),
                                 local.leaves[i][0].nbytes, local.digest(i), must_match=i in local.replicated)
                       for i in which)
    return Summary(rank, save_id, _skeleton_digest(local.skeleton), fixed, candidates)


def _candidate_leaves(local: LocalState) -> list[int]:
    """The leaves other ranks may hold too: every value but the shards only this rank holds."""
    return [i for i in range(len(local.leaves)) if not (i in local.pieces and i not in local.replicated)]


def _candidate_digests(local: LocalState, summary: Summary) -> dict[int, str]:
    return {i: c.digest for i, c in zip(_candidate_leaves(local), summary.candidates)}


def _owner(local: LocalState, plan: Plan, rank: int, i: int) -> int:
    return plan.owner[rank].get(_key(local, i), rank)


def stored_values(local: LocalState, rank: int, plan: Plan) -> tuple[dict[str, dict[str, Any]], list[int]]:
    """The state this rank's fragment stores (its own values, as ``{top-level key: {rest of path:
    value}}``, see ``group.stored_path``) and which of its leaves they are, in stored order."""
    stored: dict[str, dict[str, Any]] = {}
    which: dict[str, list[int]] = {}
    for i, (spec, obj) in enumerate(local.leaves):
        if _owner(local, plan, rank, i) != rank:
            continue
        top, rest = stored_path(local.logical[i].path)[1:].split("/", 1)
        values = stored.setdefault(top, {})
        if rest in values:
            raise ValueError(f"two values of the state are stored under '{stored_path(local.logical[i].path)}': "
                             "give them distinct keys")
        values[rest] = obj.detach() if spec.kind == "torch" else obj
        which.setdefault(top, []).append(i)
    return stored, [i for top in stored for i in which[top]]


def rank_layout(local: LocalState, rank: int, world: int, plan: Plan, order: list[int],
                fragment: Fragment, digests: dict[int, str]) -> RankLayout:
    """This rank's layout, once its fragment (of the leaves ``order``) is encoded."""
    index = {i: j for j, i in enumerate(order)}
    leaves = []
    for i, spec in enumerate(local.logical):
        owner = _owner(local, plan, rank, i)
        digest = fragment.leaves[index[i]].digest if owner == rank else digests[i]
        leaves.append(LocalLeaf(spec, digest, owner, index[i] if owner == rank else 0, local.pieces.get(i)))
    of = plan.skeleton_of[rank]
    return RankLayout(rank, world, plan.save_id, local.skeleton if of is None else None, of, tuple(leaves),
                      rank_digest(local.skeleton, leaves))


def build_group_fragment(rank_frags: list[tuple[RankFragment, str]], *, config_hash: str | None,
                         meta: dict[str, Any] | None) -> GroupFragment:
    """The group fragment naming ``rank_frags`` (each with the checksum of its stored bytes), after
    checking them together; ValueError lists what makes them not a whole part."""
    frags = [f for f, _ in rank_frags]
    problems = Group(frags, None).problems()
    if problems:
        raise CorruptCheckpoint(f"the rank fragments of step {frags[0].step}, part '{frags[0].part}' do not make a "
                                f"whole part: {'; '.join(problems[:5])}")
    blobs = {d: b for f in frags for d, b in f.blobs.items()}
    ranks = []
    for f, checksum in rank_frags:
        assert f.layout is not None
        key = rank_fragment_key(f.step, f.part, f.generation, f.layout.rank, f.layout.save_id)
        ranks.append(RankRef(f.layout.rank, key, checksum, f.layout.digest, f.logical_bytes, f.bytes_written,
                             dict(f.stats)))
    stats: dict[str, int] = {}
    for f in frags:
        for k, v in f.stats.items():
            stats[k] = stats.get(k, 0) + v
    first = frags[0]
    assert first.layout is not None
    from .documents import group_digest

    return GroupFragment(first.step, first.part, first.generation, config_hash, len(frags), first.layout.save_id,
                         tuple(ranks), blobs, group_digest(len(frags), [r.digest for r in ranks]),
                         sum(f.logical_bytes for f in frags), sum(f.bytes_written for f in frags), stats,
                         dict(meta or {}))


def put_rank_fragment(store: Store, frag: RankFragment) -> str:
    """Write a rank fragment (its key is unique to its save); the checksum of its bytes."""
    assert frag.layout is not None
    data = dumps(frag)
    store.put_if_absent(rank_fragment_key(frag.step, frag.part, frag.generation, frag.layout.rank,
                                          frag.layout.save_id), data)
    return document_checksum(data)


def read_rank_fragments(store: Store, pool: Executor, refs: list[tuple[str, str]]) -> list[RankFragment]:
    """The rank fragments at these (key, checksum of its bytes), each checked against its checksum.
    Bounded: each is read with the fragment cap (a larger object is refused unread: ObjectTooLarge),
    and a batch at a time in rank order, so the first missing or wrong one stops the read whatever
    world the group fragment declares."""
    from ..manifest import MAX_FRAGMENT_BYTES

    def read(ref: tuple[str, str]) -> RankFragment:
        key, checksum = ref
        where = f"{store.url}/{key}"
        try:
            data = store.get(key, max_bytes=MAX_FRAGMENT_BYTES)
        except ObjectNotFound:
            raise CorruptCheckpoint(f"{where}, a rank's fragment of a committed part, is missing from the store "
                                    "(deleted?); restore another step") from None
        if document_checksum(data) != checksum:
            raise CorruptCheckpoint(f"{where} does not match the checksum its group names: replaced or damaged")
        return loads_rank_fragment(data, where)

    out: list[RankFragment] = []
    for i in range(0, len(refs), _READ_BATCH):
        out += pool.map(read, refs[i:i + _READ_BATCH])
    return out


_READ_BATCH = 64  # rank fragments read at once (read_rank_fragments)


# --- the collective save -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """What a collective save makes: a committed step (``commit``) or a part's fragment of a cut."""

    part: str
    generation: int = 0
    config_hash: str | None = None
    commit: bool = True
    substep: int | None = None  # a sub-step fragment of the part (``commit.substep_key``), not its fragment of the cut
    compress: bool = True  # False: raw chunks (``EncodeOptions.compress``)

    def base_key(self, rank: int) -> str:
        """The chain of delta bases the rank's fragment belongs to."""
        key = rank_base_key(self.part, rank)
        return substep_chain(key) if self.substep is not None else key


@dataclass
class Pending:
    """A collective save between its foreground and its background half."""

    step: int
    target: Target
    meta: dict | None
    local: LocalState
    plan: Plan
    order: list[int]
    digests: dict[int, str]
    snap: Snapshot


def _plan_together(coll: Collective, local: LocalState | BaseException) -> tuple[Plan, list[Summary]]:
    """Exchange summaries; every rank gets the same plan, or the same error."""
    save_id = new_save_id() if coll.leader else ""
    mine: Summary | RemoteError
    try:
        if isinstance(local, BaseException):
            raise local
        mine = summarize(local, coll.rank, save_id)
    except Exception as e:  # noqa: BLE001 - every rank must take part in the exchange, and raise it
        mine = RemoteError.of(coll.rank, e)
    found = coll.all_gather(mine, "planning a save")
    for s in found:
        if isinstance(s, RemoteError):
            if s.rank == coll.rank and isinstance(local, BaseException):
                raise local
            raise s.exception()
    summaries = [s for s in found if isinstance(s, Summary)]
    return make_plan(summaries), summaries


def begin(writer: PartWriter, coll: Collective, step: int, state: Any, target: Target, meta: dict | None, *,
          copy: bool) -> Pending:
    """The foreground half: flatten, plan with the other ranks, snapshot what this rank stores."""
    from .local import local_state

    try:
        local: LocalState | BaseException = local_state(state)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the exchange
        local = e
    plan, summaries = _plan_together(coll, local)
    assert isinstance(local, LocalState)
    digests = _candidate_digests(local, summaries[coll.rank])
    try:
        stored, order = stored_values(local, coll.rank, plan)
        snap = writer.snapshot(stored, rank_base_key(target.part, coll.rank), copy=copy,
                               chain=target.base_key(coll.rank))
    except Exception as e:
        _report_failure(coll, e)  # the other ranks wait for this rank's report
        raise
    return Pending(step, target, meta, local, plan, order, digests, snap)


def _report_failure(coll: Collective, e: BaseException) -> None:
    """Tell the leader this rank failed (so that nobody waits for it); the caller raises ``e``."""
    try:
        _report(coll, RemoteError.of(coll.rank, e))
    except Exception:  # noqa: BLE001 - the outcome is this rank's own error (or the group's failure)
        pass


def _report(coll: Collective, report: tuple[str, str] | RemoteError,
            finish: Callable[[list[Any]], Any] | None = None) -> Any:
    """Send this rank's report (its fragment's key and checksum, or its error) to the leader, which
    runs ``finish(reports)``; every rank gets its outcome."""
    reports = coll.gather(report, "reporting the rank fragments")
    outcome = None
    if coll.leader:
        assert reports is not None
        failed = [r for r in reports if isinstance(r, RemoteError)]
        if failed:
            outcome = Outcome(error=failed[0])
        else:
            try:
                outcome = Outcome(finish(reports) if finish is not None else None)
            except Exception as e:  # noqa: BLE001 - delivered to every rank
                outcome = Outcome(error=RemoteError.of(coll.rank, e))
    got = coll.broadcast(outcome, "committing the group's save")
    assert isinstance(got, Outcome)
    return got.result()


def persist(writer: PartWriter, coll: Collective, p: Pending) -> tuple[Manifest, bool] | GroupFragment:
    """The background half: this rank's fragment, then the leader's group fragment and commit."""
    reported = False
    target = p.target
    store = writer.store

    def finish(reports: list[Any]) -> tuple[Manifest, bool] | GroupFragment:
        frags = read_rank_fragments(store, writer.pool, reports)
        group = build_group_fragment(list(zip(frags, [c for _, c in reports])), config_hash=target.config_hash,
                                     meta=None if target.commit else p.meta)
        if not target.commit:
            commit.check_live(store, target.part, target.generation)
            key = None if target.substep is None else commit.substep_key(p.step, target.part, target.generation,
                                                                           target.substep)
            commit.put_fragment(store, group, key)
            return group
        base = writer.bases.held(rank_base_key(target.part, 0))
        return commit.commit_step(store, p.step, {target.part: (group, None)},
                                  parent=base.step if base else None, single=True, meta=p.meta)

    try:
        with writer.writing(p.snap, target.part, p.step, base_key=target.base_key(coll.rank), compress=target.compress,
                            generation=target.generation, config_hash=target.config_hash) as enc:
            if not target.commit:
                commit.check_live(store, target.part, target.generation)
            layout = rank_layout(p.local, coll.rank, coll.world, p.plan, p.order, enc.fragment, p.digests)
            frag = RankFragment.of(enc.fragment, layout)
            checksum = put_rank_fragment(store, frag)
            key = rank_fragment_key(frag.step, frag.part, frag.generation, coll.rank, layout.save_id)
            reported = True
            outcome = _report(coll, (key, checksum), finish)
    except BaseException as e:
        if not reported:
            _report_failure(coll, e)
        raise
    return outcome


def write_group(writer: PartWriter, step: int, part: str, locals_: list[LocalState], *, generation: int,
                config_hash: str | None, meta: dict | None) -> GroupFragment:
    """Write a group's part from one process: each rank's fragment, then the group fragment at the
    part's fragment key (as ``write_fragment`` does for a part of a cut)."""
    save_id = new_save_id()
    summaries = [summarize(local, r, save_id) for r, local in enumerate(locals_)]
    plan = make_plan(summaries)
    written: list[tuple[RankFragment, str]] = []
    for r, local in enumerate(locals_):
        digests = _candidate_digests(local, summaries[r])
        stored, order = stored_values(local, r, plan)
        base_key = rank_base_key(part, r)
        snap = writer.snapshot(stored, base_key, copy=False)
        with writer.writing(snap, part, step, base_key=base_key, generation=generation,
                            config_hash=config_hash) as enc:
            commit.check_live(writer.store, part, generation)
            frag = RankFragment.of(enc.fragment, rank_layout(local, r, len(locals_), plan, order, enc.fragment, digests))
            written.append((frag, put_rank_fragment(writer.store, frag)))
    group = build_group_fragment(written, config_hash=config_hash, meta=meta)
    commit.check_live(writer.store, part, generation)
    commit.put_fragment(writer.store, group)
    return group
