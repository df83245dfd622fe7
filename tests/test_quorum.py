"""Quorum mode (``min_shards``) for real: Prefect runs of a tiny tinylm with a shard crashed by chaos.

A quorum cut goes ahead without the shard that failed (its part carried, its attempt fenced) and the
shard trains again the next round; the same schedule gives the same digest; with fewer clean shards
than it asks, the run waits for the retry and ends on the clean digest. Without ``min_shards`` the
same crash ends on the clean digest as before: ``test_train_flow.py``'s
``test_crash_chaos_is_retried_and_reaches_the_clean_digest`` (the same schedule and sizes).
"""

from __future__ import annotations

import pytest

from ckptlib import Checkpointer
from tests.runs import run_rounds
from trainrun.spec import RunSpec

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

EXTRA = {"d_model": 32, "n_layers": 1, "ctx": 16, "corpus_bytes": 65536}
ROUNDS = 3
TINY = {"workload": "tinylm", "workload_extra": EXTRA, "shards": 2, "rounds": ROUNDS, "steps_per_round": 4, "seed": 0,
        "heartbeat_every_s": 0.2, "retry_delay_s": 0.2, "validation_runner": "threads"}
CRASH = ["crash:shard=1,round=2"]
SLOW_RETRY_S = 12.0


def run(store: str, run_id: str, **kw):
    from flows.params import TrainParams
    from flows.train import train_run

    return train_run(TrainParams(**{**TINY, "store": store, "run_id": run_id, **kw}))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> dict[int, str]:
    """The exact trajectory's digests by step (plain function calls: no failure, no Prefect)."""
    spec = RunSpec.model_validate({k: v for k, v in TINY.items() if k in RunSpec.model_fields})
    return run_rounds(str(tmp_path_factory.mktemp("quorum-clean")), spec, ROUNDS)


@pytest.fixture(scope="module")
def clean_digest(clean) -> str:
    return clean[ROUNDS]


def test_a_quorum_cut_leaves_the_crashed_shard_out_and_it_rejoins_the_next_round(prefect_harness, tmp_path, clean):
    s = run(str(tmp_path), "quorum", chaos=CRASH, min_shards=1)
    assert s["committed"] == [0, 1, 2, 3] == s["validated"] and s["failed_validation"] == []
    rows = {x["round"]: x for x in s["rounds_log"]}
    assert [(rows[r]["quorum"], rows[r]["left_out"]) for r in (1, 2, 3)] == [([0, 1], []), ([0], [1]), ([0, 1], [])]
    left = {x["shard"]: x for x in rows[2]["shards"]}[1]
    assert left["status"] == "fenced"
    back = {x["shard"]: x for x in rows[3]["shards"]}[1]  # trains again, as the generation the flow's fence made
    assert (back["status"], back["attempt"], back["generation"], back["start_source"]) == ("finished", 1, 1, "cut")
    with Checkpointer(s["run_url"]) as ck:
        # round 1 had no failure: the exact cut; from round 2 on the trajectory is the quorum's
        assert ck.manifest(1).digest == clean[1] and ck.manifest(2).digest != clean[2]
        assert s["final_digest"] != clean[ROUNDS]
        assert ck.manifest(2).meta["quorum"] == {"shards": [0], "left_out": [1]}
        assert "quorum" not in ck.manifest(3).meta
        carried = ck.restore(2, part="shard-1")  # its part of step 1, one round on: the round's batches skipped
        assert (carried["round"], carried["data_position"]) == (2, 8)
        assert ck.restore(3, part="shard-1")["data_position"] == ck.restore(3, part="shard-0")["data_position"] == 12
    # the same failures, other timing (a slow retry): the same digest, and the healthy shard never waited for it
    again = run(str(tmp_path), "quorum-again", chaos=CRASH, min_shards=1, retry_delay_s=SLOW_RETRY_S)
    assert again["final_digest"] == s["final_digest"]
    assert [x["left_out"] for x in again["rounds_log"]] == [[], [1], []]
    assert again["rounds_log"][1]["seconds"]["wall"] < SLOW_RETRY_S


def test_fewer_clean_shards_than_min_shards_falls_back_to_waiting(prefect_harness, tmp_path, clean_digest):
    s = run(str(tmp_path), "fallback", chaos=CRASH, min_shards=2)
    assert s["final_digest"] == clean_digest
    assert [(x["quorum"], x["left_out"]) for x in s["rounds_log"]] == [([0, 1], [])] * 3
    assert {x["shard"]: x["attempt"] for x in s["rounds_log"][1]["shards"]} == {0: 1, 1: 2}


def test_bad_min_shards_is_refused_naming_the_flag(tmp_path):
    from pydantic import ValidationError
    from typer.testing import CliRunner

    from ckpt.cli import app
    from flows.params import TrainParams

    for k in (0, -1, 3):
        with pytest.raises(ValidationError, match=r"min_shards \(--min-shards\)"):
            TrainParams(shards=2, min_shards=k)
    with pytest.raises(ValidationError, match="needs one process per shard"):
        TrainParams(shards=2, ranks_per_shard=2, min_shards=1)
    assert TrainParams(shards=3, min_shards=3).min_shards == 3 and TrainParams().min_shards is None
    r = CliRunner().invoke(app, ["train", "--store", str(tmp_path), "--shards", "2", "--min-shards", "3"])
    assert r.exit_code == 2 and r.output.startswith("error: ") and "min_shards (--min-shards)" in r.output
    assert "Traceback" not in r.output and r.output.count("\n") == 1


def test_an_attempt_runs_as_the_generation_it_was_given_so_a_fence_after_its_quorum_check_stops_it(tmp_path):
    """The race a quorum cut closes: a retry checks the left-out mark, then the flow marks and fences
    the shard. The attempt was given its generation before that check, so the fence stops it (it
    never trains, or writes, as the generation the cut writes the carried part as)."""
    from ckptlib import FencedError, commit
    from trainrun.documents import Cut
    from trainrun.layout import shard_part
    from trainrun.shard_round import train_shard_round
    from trainrun.step_zero import write_step_zero

    spec = RunSpec.model_validate({k: v for k, v in TINY.items() if k in RunSpec.model_fields})
    url = str(tmp_path / "run")
    with Checkpointer(url) as ck:
        write_step_zero(ck, spec)
        generation = ck.live_generation(shard_part(1))  # read before the quorum check, as the task does
        assert commit.fence(ck.store, shard_part(1), generation + 1, by="test", reason="left out")
        with pytest.raises(FencedError):
            train_shard_round(ck, spec, 1, 1, Cut.of_step(0), generation=generation, heartbeat_every_s=0.1)
        assert not [k for k in ck.store.list("fragments/1/") if shard_part(1) in k]
