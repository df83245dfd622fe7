"""Resharding (``trainrun.reshard``): a run resumed with another shard count continues from its last
healthy checkpoint, merged or split, with the change in its lineage; real training of a tiny
tinylm on a local store, the runtime without Prefect (the flow's path is in test_train_flow.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

from ckptlib import Checkpointer
from trainrun.cut import cut_round
from trainrun.documents import Cut
from trainrun.errors import RunRefused
from trainrun.layout import COORDINATOR, shard_part
from trainrun.reshard import TreeMean, sources
from trainrun.resume import where_to_start
from trainrun.shard_round import train_shard_round
from trainrun.spec import RunSpec
from trainrun.step_zero import write_step_zero

EXTRA = {"d_model": 16, "n_layers": 1, "ctx": 8, "corpus_bytes": 32768}


def spec(shards: int) -> RunSpec:
    return RunSpec(workload="tinylm", workload_extra=EXTRA, shards=shards, steps_per_round=3, seed=0)


def train(url: str, s: RunSpec, start: int | None, rounds: int) -> dict[int, str]:
    """Rounds ``start+1..rounds`` as the flow runs them (step 0 first when ``start`` is None), every
    step validated (healthy); returns every committed step's digest."""
    from trainrun.checks import validate_run_checkpoint

    with Checkpointer(url) as ck:
        if start is None:
            write_step_zero(ck, s)
            validate_run_checkpoint(url, 0, report=False)
            start = 0
    cut = Cut.of_step(start)
    for r in range(start + 1, rounds + 1):
        for i in range(s.shards):
            with Checkpointer(url) as ck:
                train_shard_round(ck, s, i, r, cut)
        with Checkpointer(url) as ck:
            cut = cut_round(ck, s, r, cut, publish=True).next_cut()
        assert validate_run_checkpoint(url, r, report=False).passed
    with Checkpointer(url) as ck:
        return {step: ck.manifest(step).digest for step in ck.steps()}


def test_sources_merge_and_split():
    assert [sources(4, 2, j) for j in range(2)] == [[0, 2], [1, 3]]
    assert [sources(5, 2, j) for j in range(2)] == [[0, 2, 4], [1, 3]]
    assert [sources(2, 5, j) for j in range(5)] == [[0], [1], [0], [1], [0]]
    assert sources(3, 3, 2) == [2]
    with pytest.raises(ValueError, match="0 <= shard < new"):
        sources(2, 3, 3)


def test_tree_mean_averages_floating_values_and_keeps_the_first_of_the_rest():
    a = {"opt": {"state": {0: {"step": torch.tensor(5.0), "m": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}}},
         "data_position": 7, "ids": torch.tensor([1, 2]), "t": (1.0, [torch.tensor([0.5])])}
    b = {"opt": {"state": {0: {"step": torch.tensor(5.0), "m": torch.tensor([3.0, 4.0], dtype=torch.bfloat16)}}},
         "data_position": 9, "ids": torch.tensor([3, 4]), "t": (2.0, [torch.tensor([1.5])])}
    m = TreeMean()
    m.add(a)
    m.add(b)
    out = m.result()
    assert out["opt"]["state"][0]["m"].dtype == torch.bfloat16 and out["opt"]["state"][0]["m"].tolist() == [2.0, 3.0]
    assert out["opt"]["state"][0]["step"].item() == 5.0
    assert out["data_position"] == 7 and out["ids"].tolist() == [1, 2] and out["t"][0] == 1.0
    assert out["t"][1][0].tolist() == [1.0]
    with pytest.raises(ValueError, match="/opt/state/0/m differs"):
        bad = TreeMean()
        bad.add(a)
        bad.add({**b, "opt": {"state": {0: {"step": torch.tensor(5.0), "m": torch.zeros(3)}}}})


@pytest.mark.parametrize("old,new", [(4, 2), (2, 3)])
def test_resume_with_another_shard_count_reshards_deterministically_and_records_it(tmp_path, old, new):
    url = str(tmp_path / "run")
    before = train(url, spec(old), None, 2)
    copy = str(tmp_path / "copy")
    shutil.copytree(url, copy)

    with Checkpointer(url) as ck:
        plan = where_to_start(ck, spec(new), resume=True, run_id="r")
        parts_2 = sorted(ck.manifest(2).parts)
    assert plan.start_step == 2 and plan.reshard is not None and plan.reshard.to_dict() == {"step": 2, "shards": [old, new]}
    assert f"with {new} shards instead of {old}" in plan.note
    after = train(url, spec(new), 2, 4)
    assert {s: after[s] for s in before} == before  # the old trajectory is untouched
    with Checkpointer(url) as ck:
        assert sorted(ck.manifest(4).parts) == sorted([COORDINATOR] + [shard_part(i) for i in range(new)])
        assert parts_2 == sorted([COORDINATOR] + [shard_part(i) for i in range(old)])
        lineage = [{"step": 2, "shards": [old, new]}]
        for step in (3, 4):
            assert ck.restore(step, part=COORDINATOR)["reshards"] == lineage  # inside the digest
            assert ck.manifest(step).meta["reshards"] == lineage
        assert "reshards" not in ck.restore(2, part=COORDINATOR)
        # the merged or split shard state: shard 1's optimizer moments are the mean of its sources'
        first = ck.restore(3, part=shard_part(1))
        assert first["data_position"] == ck.restore(2, part=shard_part(sources(old, new, 1)[0]))["data_position"] + 3
        assert ck.restore(3, part=COORDINATOR)["config"]["shards"] == new
        # a resume with the new count goes on as usual (no second reshard)
        assert where_to_start(ck, spec(new), resume=True).reshard is None
    again = train(copy, spec(new), 2, 4)
    assert again == after  # the same resume reproduces the new trajectory exactly


def test_resharding_waits_for_the_latest_committed_step_to_be_healthy(tmp_path):
    url = str(tmp_path / "run")
    train(url, spec(2), None, 1)
    s = spec(2)
    for i in range(2):  # round 2 committed but not validated (e.g. killed before its validation)
        with Checkpointer(url) as ck:
            train_shard_round(ck, s, i, 2, Cut.of_step(1))
    with Checkpointer(url) as ck:
        cut_round(ck, s, 2, Cut.of_step(1), publish=True)
        with pytest.raises(RunRefused, match=r"cannot reshard .* from 2 to 3 shards yet: its latest committed step 2 "
                                             r"is not validated \(step 1 is healthy\).*ckpt validate"):
            where_to_start(ck, spec(3), resume=True, run_id="r")
        with pytest.raises(RunRefused, match="seed: 0 -> 1"):  # any other trajectory change is still refused
            where_to_start(ck, spec(3).model_copy(update={"seed": 1}), resume=True)
        assert where_to_start(ck, spec(2), resume=True).start_step == 1  # the old count resumes as before
