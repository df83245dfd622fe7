"""Shard checkpoints within a round, and every recovery path continuing from the newest one (issue 21).

Fast tests use the runtime without Prefect: the Checkpointer's sub-step fragments, GC of their key
space, where an attempt resumes (a zombie's later checkpoints never), the local tier (a damaged copy
is detected and the store used), a shard round that crashes and continues. The drills are real
Prefect runs with real failures (slow): a crash (Prefect's retry), a hang, a zombie and a stall (the
watchdog's reruns) in one run on threads; a SIGKILLed and a SIGSTOPped Dask worker in one run on
processes; a ``ckpt train`` killed with SIGKILL mid-round and resumed. Each ends on the clean run's
digest at every step, and each recovery recomputes at most N steps (plus, for a kill, the steps
between the last beat and the kill).

Settings are tiny (tinylm with one layer of width 32, 2 shards, 40 steps per round, a shard
checkpoint every 10 steps, a beat every 0.5 s, a watchdog timeout of 2 s: ``tests/drills.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptlib import Checkpointer, CorruptCheckpoint, FencedError, RetentionPolicy, commit
from ckptlib.store import Store
from ckptlib.testing import document_json
from tests.drills import DRILL, TIMEOUT
from tests.drills import train_with_watchdog as beside
from tests.runs import ENV, EXTRA, digests, end_session
from trainrun.chaos import parse_chaos
from trainrun.documents import Cut
from trainrun.local_tier import LocalTier
from trainrun.recovery import read_recoveries
from trainrun.resume_point import resume_point
from trainrun.shard_checkpoint import AUTO_MAX_STEPS, Cadence
from trainrun.shard_round import train_shard_round
from trainrun.spec import RunSpec
from trainrun.step_zero import write_step_zero

N = 10
SPEC = RunSpec(workload="tinylm", workload_extra=EXTRA, shards=2, steps_per_round=40)
TINY = {**DRILL, "shard_checkpoint_every": N}


def state(seed: float) -> dict:
    g = torch.Generator().manual_seed(int(seed))
    return {"w": torch.randn(64, 1024, generator=g), "b": torch.zeros(8) + seed, "step": int(seed)}


# --- ckptlib: sub-step fragments and their key space --------------------------------------------------

def test_sub_step_fragments_chain_their_own_bases_and_leave_the_cuts_as_they_were(tmp_path):
    """Async sub-step writes are deltas against the previous one (the first against the part's base),
    read back bit-exactly; the part's fragment of the cut is the very one written without them."""
    plain, with_substeps = Checkpointer(str(tmp_path / "a")), Checkpointer(str(tmp_path / "b"))
    for ck in (plain, with_substeps):
        ck.write_fragment(1, "p", state(1))
        ck.read_fragment(1, "p", adopt=True)
    seen = {}
    for k in (10, 20):
        s = state(1)
        s["w"][:2] += k  # a few rows change between two checkpoints
        fut = with_substeps.write_fragment_async(2, "p", s, substep=k, meta={"m": k},
                                                 on_written=lambda f, units, k=k: seen.setdefault(k, len(units)))
        s["w"].zero_()  # the caller may change its state once the call returned
        frag = fut.result()
        assert frag.meta == {"m": k, "substep": k} and frag.step == 2 and frag.part == "p"
    assert set(seen) == {10, 20} and all(n > 0 for n in seen.values())  # each one's units, for a local copy
    assert frag.stats["delta"] >= 1  # k20 is a delta against k10 (only two rows changed)
    keys = commit.substep_keys(with_substeps.store, 2, "p", 0)
    assert keys == {10: "fragments/2/p.g0.k10.json", 20: "fragments/2/p.g0.k20.json"}
    expected = state(1)
    expected["w"][:2] += 20
    with Checkpointer(str(tmp_path / "b")) as reader:
        got = reader.read_fragment(2, "p", generation=0, substep=20)
        assert torch.equal(got["w"], expected["w"]) and got["step"] == 1
        reader.store.put("fragments/2/p.g0.k30.json", reader.store.get(keys[20]))  # k20's document under k30
        with pytest.raises(CorruptCheckpoint, match="sub-step 20"):
            reader.read_fragment(2, "p", generation=0, substep=30)
    # the cut's fragment of step 2 deltas against step 1's, with sub-steps written or not: same objects
    final = state(2)
    a, b = plain.write_fragment(2, "p", final), with_substeps.write_fragment(2, "p", final)
    assert a.digest == b.digest and {k: v.key for k, v in a.blobs.items()} == {k: v.key for k, v in b.blobs.items()}
    for ck in (plain, with_substeps):
        ck.close()


def test_uncompressed_writes_store_changed_chunks_raw_skip_unchanged_ones_and_keep_no_dense_bytes(tmp_path):
    """``compress=False`` (what a shard checkpoint asks): a changed chunk is stored raw, byte for
    byte, never coded; an unchanged one is not written; and once a write found a unit changed, its
    bytes are not kept as a base (no delta of it would be tried: the snapshot buffers go round)."""
    gen = torch.Generator().manual_seed(7)
    dense, sparse = torch.randn(1 << 16, generator=gen), torch.randn(1 << 16, generator=gen)
    frozen = torch.randn(1 << 16, generator=gen)  # 256 KiB each: 4 chunks of 64 KiB
    with Checkpointer(str(tmp_path), chunk_bytes=1 << 16) as ck:
        ck.write_fragment(1, "p", {"dense": dense, "sparse": sparse, "frozen": frozen})
        ck.read_fragment(1, "p", adopt=True)
        frags = []
        for k in (1, 2, 3):
            dense += 0.01 * k  # every value changes
            sparse[k * 100] += 1.0  # one value of its first chunk changes
            frags.append(ck.write_fragment_async(2, "p", {"dense": dense, "sparse": sparse, "frozen": frozen},
                                                 substep=k, compress=False).result())
        held = ck._bases.held("p/substeps")
        assert held is not None and held.raw == {}  # the changed units' bytes are not kept
        assert ck._bases.held("p").raw  # the part's own base (the cut's) keeps its bytes
    for f in frags:
        assert (f.stats["keyframe"], f.stats["unchanged"], f.stats["delta"]) == (5, 7, 0), f.stats
        assert f.bytes_written == 5 * (1 << 16)  # raw: exactly the changed chunks' bytes
        written = [b for b in f.blobs.values() if b.nbytes == b.size and b.codecs == ({"name": "raw"},)]
        assert len(written) >= 5
    with Checkpointer(str(tmp_path)) as reader:
        back = reader.read_fragment(2, "p", generation=0, substep=3)
    assert torch.equal(back["dense"], dense) and torch.equal(back["sparse"], sparse) and torch.equal(back["frozen"], frozen)


def test_on_written_gets_every_unit_of_a_dense_state(tmp_path):
    """A dense state (every value new at each write: no delta pays) keeps no base bytes for its
    units once a delta did not pay (docs/decisions.md 42); a local copy still needs every unit, so
    ``on_written`` gets each unit's raw bytes by raw checksum, and a read from them reads no chunk."""
    from ckptlib.codecs import checksum
    from ckptlib.store import WrapperStore

    gen = torch.Generator().manual_seed(5)
    got: dict[int, dict] = {}
    with Checkpointer(str(tmp_path), chunk_bytes=1 << 16) as ck:
        ck.write_fragment(1, "p", {"w": torch.randn(1 << 17, generator=gen)})
        for k in (10, 20, 30):
            s = {"w": torch.randn(1 << 17, generator=gen)}  # 512 KiB: 8 chunks
            ck.write_fragment_async(2, "p", s, substep=k, on_written=lambda f, units, k=k: got.setdefault(
                k, {c: b.copy() for c, b in units.items()})).result()
            assert len(got[k]) == 8 and all(checksum(b) == c for c, b in got[k].items()), (k, len(got[k]))

    class NoChunks(WrapperStore):
        def _forward(self, op, key, *args):
            assert not key.startswith("chunks/"), key  # every unit comes from known=
            return super()._forward(op, key, *args)

    with Checkpointer(NoChunks(Store.from_url(str(tmp_path)))) as reader:
        back = reader.read_fragment(2, "p", generation=0, substep=30, known=got[30])
    assert torch.equal(back["w"], s["w"])


def test_gc_sweeps_the_shard_checkpoints_of_committed_rounds_and_keeps_pending_ones(tmp_path):
    with Checkpointer(str(tmp_path)) as ck:
        for step in (0, 1):
            ck.write_fragment(step, "p", state(step))
            ck.write_fragment_async(step, "p", state(step + 10), substep=5).result()
            ck.commit(step, ["p"])
        ck.write_fragment_async(2, "p", state(20), substep=5).result()  # round 2 in progress: not committed
        report = ck.gc(RetentionPolicy(keep_last=5), grace_s=0)
        assert report.skipped == []  # the key shape is one GC knows
        left = sorted(ck.store.list("fragments/0") + ck.store.list("fragments/1") + ck.store.list("fragments/2"))
        assert left == ["fragments/0/p.g0.json", "fragments/1/p.g0.json", "fragments/2/p.g0.k5.json"]
        assert ck.read_fragment(2, "p", generation=0, substep=5)["step"] == 20  # its chunks were kept
        assert all(ck.verify(s) == [] for s in ck.steps())


def test_an_attempt_resumes_from_its_own_newest_checkpoint_else_the_one_its_fence_records(tmp_path):
    """A zombie's checkpoints written after its fence are never where the rerun continues."""
    with Checkpointer(str(tmp_path)) as ck:
        for k in (10, 20):
            ck.write_fragment_async(3, "shard-0", state(k), substep=k).result()
        own = resume_point(ck.store, "shard-0", 3, 0)
        assert (own.generation, own.round_step) == (0, 20)
        assert resume_point(ck.store, "shard-0", 2, 0) is None  # another round: the cut
        # a watchdog looks before it fences, and records it in the fence
        assert ck.fence("shard-0", 1, reason="silent", details={"resume": own.to_dict()})
        fenced = ck.write_fragment_async(3, "shard-0", state(30), substep=30)  # generation 0 is fenced now
        with pytest.raises(FencedError):
            fenced.result()
        ck.store.put("fragments/3/shard-0.g0.k30.json",  # a zombie's, through its stale view of the fences
                     ck.store.get("fragments/3/shard-0.g0.k20.json"))
        inherited = resume_point(ck.store, "shard-0", 3, 1)
        assert inherited == own  # not the zombie's k30
        ck.write_fragment_async(3, "shard-0", state(25), generation=1, substep=25).result()
        assert resume_point(ck.store, "shard-0", 3, 1).key == "fragments/3/shard-0.g1.k25.json"  # its own now


def test_auto_cadence_spends_about_two_percent_and_a_step_count_is_exact():
    c = Cadence(10)
    assert [k for k in range(1, 41) if c.due(k, 40, busy=False)] == [10, 20, 30]  # never the last step
    assert not Cadence(0).due(10, 40, busy=False)
    auto = Cadence("auto")
    auto.estimate(100_000_000)  # estimated 1 s a checkpoint: one every 50 s of training
    auto.estimate(1)  # (once measured or estimated, it stays)
    assert auto.interval_s == pytest.approx(50.0)
    assert not auto.due(1, 40, busy=False, now=auto.since + 49) and auto.due(1, 40, busy=False, now=auto.since + 51)
    assert not auto.due(1, 40, busy=True, now=auto.since + 99)  # never two writes in flight


def test_auto_cadence_never_lets_more_than_its_step_ceiling_pass_even_with_slow_writes():
    # a loaded machine: a checkpoint costs 10 s, so the time rule alone would wait 500 s of training
    auto = Cadence("auto", cost_s=10.0, max_steps=AUTO_MAX_STEPS)
    now = auto.since + 1
    due = [k for k in range(1, 120) if auto.due(k, 120, busy=True, now=now) and (auto.taken(k, now) or True)]
    assert due == list(range(AUTO_MAX_STEPS, 120, AUTO_MAX_STEPS))  # busy or not: ``take`` waits for the write
    resumed = Cadence("auto", cost_s=10.0, last_step=30)  # an attempt continuing from its checkpoint at step 30
    assert not resumed.due(30 + AUTO_MAX_STEPS - 1, 120, busy=False, now=now)
    assert resumed.due(30 + AUTO_MAX_STEPS, 120, busy=False, now=now)


def _agreeing_ranks(step_s: list[float], cost_s: float, steps_per_round: int, warm_up_s: float = 1.0) -> list[list[int]]:
    """The steps at which each of len(step_s) ranks takes a group's ``auto`` checkpoints, each rank in
    a thread with its own clock (``step_s`` a step, its first step ``warm_up_s`` longer), agreeing
    through a barrier as the ranks' all_reduce(MAX) does."""
    n = len(step_s)
    barrier, proposals = threading.Barrier(n), [0] * n
    taken: list[list[int]] = [[] for _ in range(n)]

    def rank(r: int) -> None:
        def agree(value: int) -> int:
            proposals[r] = value
            barrier.wait()
            largest = max(proposals)
            barrier.wait()
            return largest

        cadence, now = Cadence("auto", cost_s=cost_s, since=0.0, agree=agree), 0.0
        for k in range(1, steps_per_round + 1):
            now += step_s[r] + (warm_up_s if k == 1 else 0.0)
            if cadence.due(k, steps_per_round, busy=False, now=now):
                cadence.taken(k, now)
                taken[r].append(k)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank waited for an agreement the others never joined"
    return taken


def test_a_groups_auto_cadence_is_agreed_by_its_ranks_and_follows_the_time_rule():
    # a checkpoint costs 2 ms: the time rule takes one every 0.1 s of training. Rank 0's steps take
    # 10 ms (one every 10 steps alone), rank 1's 20 ms (every 5): the group agrees on the larger, 10,
    # and its first step's warm-up (1 s) does not count as the pace.
    r0, r1 = _agreeing_ranks([0.010, 0.020], cost_s=0.002, steps_per_round=60)
    assert r0 == r1, (r0, r1)
    assert r0 == [10, 20, 30, 40, 50], r0  # (not after 1: the warm-up is not the pace)
    # a slow write: the time rule would wait 500 s; the step ceiling binds, as for one process
    r0, r1 = _agreeing_ranks([0.010, 0.011], cost_s=10.0, steps_per_round=120)
    assert r0 == r1 == list(range(AUTO_MAX_STEPS, 120, AUTO_MAX_STEPS))
    # slow steps, a cheap write: at most one a step (from the second on), never at the round's last step
    r0, r1 = _agreeing_ranks([0.5, 0.4], cost_s=0.001, steps_per_round=5)
    assert r0 == r1 == [2, 3, 4]


# --- a shard round that fails and continues (no Prefect) ----------------------------------------------

def _round(root: Path, every, *, chaos=(), attempt=1, tier=None):
    ck = Checkpointer(str(root))
    try:
        return train_shard_round(ck, SPEC, 0, 1, Cut.of_step(0), attempt=attempt, chaos=[parse_chaos(c) for c in chaos],
                                 checkpoint_every=every, local_tier=tier)
    finally:
        ck.close()


def test_a_crashed_round_continues_from_its_checkpoint_and_a_damaged_local_copy_is_not_used(tmp_path):
    clean_root, root = tmp_path / "clean", tmp_path / "run"
    for r in (clean_root, root):
        with Checkpointer(str(r)) as ck:
            write_step_zero(ck, SPEC)
    clean = _round(clean_root, 0)
    tier = LocalTier(str(root), root=tmp_path / "tier")
    with pytest.raises(Exception, match="crashes on purpose"):
        _round(root, N, chaos=["crash:shard=0,round=1,step=25"], tier=tier)
    copy = tier.dir / "shard-0.g0.bin"
    assert copy.exists()
    data = bytearray(copy.read_bytes())
    data[-100] ^= 0xFF  # one bit of one unit
    copy.write_bytes(bytes(data))
    again = _round(root, N, attempt=2, tier=tier)
    assert (again.resumed_at_step, again.start_source) == (20, "store")  # detected: the store's copy was used
    assert again.digest == clean.digest
    (rec,) = read_recoveries(Store.from_url(str(root)))
    assert (rec.kind, rec.failed_at_step, rec.resumed_at_step, rec.steps_recomputed, rec.source) == \
        ("crash", 25, 20, 5, "store")
    assert not copy.exists()  # the round is written: its local copies are gone
    # the committed bytes do not depend on shard checkpoints: the round's fragment is the clean one's
    frag = lambda r: document_json(Path(r, "fragments", "1", "shard-0.g0.json").read_bytes())  # noqa: E731
    assert frag(root)["blobs"] == frag(clean_root)["blobs"]
    # an intact local copy is used: crash again in a fresh run, at another step and cadence
    root2 = tmp_path / "run2"
    with Checkpointer(str(root2)) as ck:
        write_step_zero(ck, SPEC)
    tier2 = LocalTier(str(root2), root=tmp_path / "tier")
    with pytest.raises(Exception, match="crashes on purpose"):
        _round(root2, 7, chaos=["crash:shard=0,round=1,step=30"], tier=tier2)
    again = _round(root2, 7, attempt=2, tier=tier2)
    assert (again.resumed_at_step, again.start_source, again.digest) == (28, "local", clean.digest)


def test_the_local_tier_is_bounded(tmp_path):
    import numpy as np

    tier = LocalTier("memory://x", root=tmp_path, max_bytes=10_000)
    units = {"a" * 32: np.zeros(6000, dtype=np.uint8)}
    assert tier.put("shard-0", 0, "k", "d", units)
    assert tier.put("shard-0", 0, "k2", "d", units)  # replaces its own copy
    assert not tier.put("shard-1", 0, "k", "d", units)  # would exceed the budget: the store has it
    assert tier.get("shard-0", 0, "k", "d") is None  # replaced by k2
    assert tier.get("shard-0", 0, "k2", "d") is None  # its unit does not match its (made-up) checksum


# --- the drills: real Prefect runs, real failures -------------------------------------------------------

def params(**kw):
    from flows.params import TrainParams

    return TrainParams(**{**TINY, **kw})


def train_with_watchdog(p):
    """``train_run(p)`` with the watchdog beside it (as ``ckpt train`` runs it)."""
    return beside(p, timeout_s=TIMEOUT)


@pytest.fixture(scope="module")
def clean(prefect_harness, clean_digests):
    """The reference digests (the drills' settings less their shard checkpoints, which change no digest;
    ``test_a_run_killed_mid_round...`` checks a clean run's own recoveries and checkpoints)."""
    return clean_digests(SPEC, TINY["rounds"])


def check_recoveries(rows: list[dict], expected: dict[tuple[int, int], str], *, slack: int = 0) -> dict:
    """One row per struck (shard, round), of the expected kind, that recomputed at most N steps
    (plus ``slack``: the steps between a killed attempt's last beat and the kill)."""
    by = {(r["shard"], r["round"]): r for r in rows}
    assert set(by) == set(expected), rows
    for where, kind in expected.items():
        r = by[where]
        assert r["kind"] == kind, r
        assert r["resumed_at_step"] > 0 and r["source"] in ("local", "store"), r  # from a shard checkpoint
        assert 0 <= r["steps_recomputed"] <= N + slack, r
        assert r["detect_s"] is not None and r["back_to_training_s"] is not None, r
    return by


@pytest.mark.prefect
@pytest.mark.slow
def test_a_retry_and_the_watchdogs_reruns_continue_from_shard_checkpoints(clean, tmp_path):
    """Threads: a crash (round 1), a hang (round 2), a zombie and a stall (round 3)."""
    s, decisions = train_with_watchdog(params(
        store=str(tmp_path), run_id="drills",
        chaos=["crash:shard=0,round=1,step=25", "hang:shard=1,round=2,step=25", "zombie:shard=0,round=3,step=15",
               "stall:shard=1,round=3,step=25"]))
    url = s["run_url"]
    assert digests(url) == clean
    by = check_recoveries(s["recoveries"], {(0, 1): "crash", (1, 2): "silent", (0, 3): "silent",
                                            (1, 3): "stalled"})
    # the zombie went on training after its fence and wrote checkpoints under its fenced generation:
    # the rerun continued from the one its fence recorded, written while it was live
    zombie = by[(0, 3)]
    assert zombie["generation"] == 1 and zombie["checkpoint"] == "fragments/3/shard-0.g0.k10.json"
    later = [k for k in commit.substep_keys(Store.from_url(url), 3, "shard-0", 0) if k > 10]
    assert later, "the zombie wrote no checkpoint after its fence"
    fence = json.loads(Path(url, "fences", "shard-0", "1").read_text())
    assert fence["resume"]["key"] == zombie["checkpoint"]
    assert {d["part"] for d in decisions if d["kind"] == "fenced"} == {"shard-0", "shard-1"}
    # the summary lists them in the artifact's shape; GC leaves no shard checkpoint of a committed round
    assert list(s["recoveries"][0])[:8] == ["shard", "round", "kind", "failed_at_step", "resumed_at_step",
                                            "steps_recomputed", "detect_s", "back_to_training_s"]
    with Checkpointer(url) as ck:
        ck.gc(RetentionPolicy(keep_last=10), grace_s=0)
        assert not [k for r in range(4) for k in ck.store.list(f"fragments/{r}") if ".k" in k.rsplit("/", 1)[1]]
        assert all(ck.verify(step) == [] for step in ck.steps()) and ck.steps() == [0, 1, 2, 3]


@pytest.mark.prefect
@pytest.mark.slow
def test_a_killed_and_a_stopped_dask_worker_continue_from_shard_checkpoints(clean, tmp_path):
    """Processes: a Dask worker SIGKILLs itself (round 2), another is SIGSTOPped (round 3)."""
    s, _ = train_with_watchdog(params(store=str(tmp_path), run_id="dask", task_runner="dask",
                                      chaos=["kill:shard=1,round=2,step=25", "stop:shard=0,round=3,step=25"]))
    assert digests(s["run_url"]) == clean
    slack = int(TINY["steps_per_round"])  # a killed attempt's last beat can be that far behind (beats every 0.5 s)
    by = check_recoveries(s["recoveries"], {(1, 2): "process-died", (0, 3): "silent"}, slack=slack)
    # the strike says where; a kill -9 can also lose the one checkpoint still being written (step 20's,
    # 5 steps before the kill, when its background write is slower than 5 steps): at most 2N, never more,
    # since a write due while another is in flight waits for it (the CI machine lost step 20's: 15)
    assert by[(1, 2)]["failed_at_step"] == 25 and by[(1, 2)]["steps_recomputed"] < 2 * N
    assert by[(0, 3)]["cause"] == "stop"


@pytest.mark.prefect
@pytest.mark.slow
def test_a_run_killed_mid_round_resumes_from_its_shard_checkpoints(prefect_harness, tmp_path):
    """`kill -9` of a whole run (its process group) while round r trains; `ckpt train --resume` continues
    each shard from its newest checkpoint of each round it does again."""
    from flows.train import train_run

    workload = "slow_steps:build"  # tinylm, with a sleep per step taken from the environment
    ref = train_run(params(store=str(tmp_path / "ref"), run_id="ref", workload=workload))
    # a clean run's summary: no recovery, a shard checkpoint at k10, k20 and k30 of each round
    assert ref["recoveries"] == [] and ref["shard_checkpoints"]["count"] == 2 * 3 * 3
    from prefect.settings import PREFECT_API_URL

    env = {**ENV, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_HOME": str(tmp_path / "home"),
           "CKPT_TEST_STEP_SLEEP": "0.05"}
    (tmp_path / "home").mkdir()
    store = str(tmp_path / "store")
    args = [sys.executable, "-m", "ckpt", "train", "--store", store, "--run-id", "killed", "--workload", workload,
            "--shards", "2", "--rounds", "3", "--steps-per-round", "40", "--workload-extra", json.dumps(EXTRA),
            "--heartbeat-every", "0.2", "--shard-checkpoint-every", str(N), "--validation-runner", "threads"]
    proc = subprocess.Popen(args, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = Path(store, "killed")
    killed_in = None
    try:
        deadline = time.monotonic() + 240
        while killed_in is None:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no moment to kill the run in 240 s"
            for r in (2, 3):  # round r trains and both its shards have checkpointed in it
                if not (run / "manifests" / f"{r}.json").exists() \
                        and all((run / "fragments" / str(r) / f"shard-{i}.g0.k10.json").exists() for i in range(2)):
                    killed_in = r
                    break
            time.sleep(0.01)
    finally:
        end_session(proc)
        proc.wait(30)
    assert not (run / "manifests" / f"{killed_in}.json").exists(), "the round ended before the kill"
    with Checkpointer(str(run)) as ck:
        committed = ck.steps()
    out = subprocess.run(args + ["--resume", "--json", str(tmp_path / "s.json")], env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert digests(str(run)) == digests(ref["run_url"])
    s = json.loads((tmp_path / "s.json").read_text())
    # the resume validates the committed steps that have no verdict yet before it decides: it starts
    # from the newest committed one (validations lagged behind the killed run)
    healthy = s["start_step"]
    assert healthy == committed[-1], (healthy, committed)
    # each shard redoes the rounds after it, each from its newest checkpoint of that round (the dead run's,
    # of the same cut)
    rows = {(r["shard"], r["round"]): r for r in s["recoveries"] if r["kind"] == "run-died"}
    assert set(rows) == {(i, r) for i in range(2) for r in range(healthy + 1, killed_in + 1)}, s["recoveries"]
    for (_, rnd), r in rows.items():
        assert r["resumed_at_step"] >= N and r["source"] == "cut", r  # (a resumed run's rows do not say where from)
        # at most N steps again, plus, in the round it died in, those between its last beat and the
        # kill (a beat every 0.2 s of 50 ms steps: 4)
        assert r["steps_recomputed"] <= N + (4 if rnd == killed_in else 0), r
        if rnd == killed_in:
            assert r["failed_at_step"] >= N, r
    assert "recovery        shard-0 round" in out.stdout


def test_the_soak_schedule_is_seeded_and_each_failure_can_strike():
    from trainrun.chaos import RoundSpan, soak_schedule

    spans = [RoundSpan(r, (r - 1) * 4.0, 4.0, 3.6) for r in range(1, 31)]
    kw = {"fail_every_s": 3.0, "kinds": ["crash", "hang", "kill"], "shards": 2, "steps_per_round": 150}
    a, b = soak_schedule(spans, **kw, seed=1), soak_schedule(spans, **kw, seed=1)
    assert a == b and a != soak_schedule(spans, **kw, seed=2) and 20 <= len(a) <= 60
    by: dict = {}
    for c in a:
        by.setdefault((c.shard, c.round), []).append(c)
        assert 1 <= c.step < 150 and c.kind in kw["kinds"]
    for cs in by.values():  # the attempts of one shard's round, in order, later steps, nothing after a kill
        assert [c.attempt for c in cs] == list(range(1, len(cs) + 1)) and len(cs) <= 2
        assert [c.step for c in cs] == sorted({c.step for c in cs})
        assert all(c.kind != "kill" for c in cs[:-1])
    assert len(soak_schedule(spans[:4], **kw, seed=3, count=4)) <= 4
    assert [str(parse_chaos(str(c))) for c in a] == [str(c) for c in a]  # they travel as chaos specs
