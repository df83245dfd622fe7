"""FSDP2 inside a shard (``--ranks-per-shard 2 --parallelism fsdp``): real gloo groups of real rank
processes on CPU, real SIGKILLs. The group's fragment holds each rank's shards; whoever reads the
shard's state (the cut, the next round's ranks on any layout, one process) gets it whole and exact."""

from __future__ import annotations

import pytest
import torch

from ckptlib import Checkpointer, commit
from ckptlib.distributed import GroupFragment
from trainrun.cut import cut_round
from trainrun.documents import Cut
from trainrun.errors import RankGroupFailed
from trainrun.layout import COORDINATOR
from trainrun.rank_group import train_shard_group
from trainrun.spec import RunSpec
from trainrun.step_zero import write_step_zero

EXTRA = {"d_model": 32, "n_layers": 2, "ctx": 16, "corpus_bytes": 65536}


def spec(ranks: int = 2, parallelism: str = "fsdp", **kw) -> RunSpec:
    return RunSpec(**{"workload": "tinylm", "workload_extra": EXTRA, "shards": 2, "steps_per_round": 4,
                      "ranks_per_shard": ranks, "parallelism": parallelism, **kw})


def test_parallelism_ddp_keeps_the_config_and_its_hash_and_fsdp_is_a_trajectory_field():
    ddp = RunSpec(shards=2, ranks_per_shard=2)
    assert "parallelism" not in ddp.to_dict() and RunSpec.from_dict(ddp.to_dict()).parallelism == "ddp"
    assert RunSpec(shards=2, ranks_per_shard=2, parallelism="ddp").config_hash() == ddp.config_hash()
    fsdp = RunSpec(shards=2, ranks_per_shard=2, parallelism="fsdp")
    assert fsdp.to_dict()["parallelism"] == "fsdp" and fsdp.config_hash() != ddp.config_hash()
    assert RunSpec(shards=2, parallelism="fsdp").config_hash() == RunSpec(shards=2).config_hash()  # R = 1
    with pytest.raises(ValueError, match="parallelism"):
        RunSpec(parallelism="tp")


def whole(ck: Checkpointer, step: int, part: str, frag: GroupFragment, key: str) -> dict[str, torch.Tensor]:
    """``state[key]`` of a group's part put together by hand from every rank's own pieces (dim-0
    shards: each rank's rows in rank order), for comparison with what the library reads."""
    ranks = [ck.read_rank(step, part, r, fragment=frag) for r in range(frag.world)]
    out = {}
    for name in ranks[0].state[key]:
        parts = [rs.state[key][name] for rs in ranks]
        out[name] = torch.cat(parts) if f"/{key}/{name}" in ranks[0].shards else parts[0]
    return out


@pytest.fixture(scope="module")
def fsdp_round(tmp_path_factory):
    """Round 1 of both shards, each by a clean FSDP group of 2 ranks, then the cut (committed)."""
    s = spec()
    ck = Checkpointer(str(tmp_path_factory.mktemp("fsdp")))
    write_step_zero(ck, s)
    results = [train_shard_group(ck, None, s, i, 1, Cut.of_step(0), heartbeat_every_s=0.2) for i in range(2)]
    return ck, s, results, cut_round(ck, s, 1, Cut.of_step(0), publish=True)


@pytest.mark.slow
def test_an_fsdp_group_stores_each_ranks_shards_and_the_cut_averages_exact_full_tensors(fsdp_round):
    ck, s, results, cut = fsdp_round
    assert cut.committed and all(r.finished and r.data_position == 4 for r in results)
    frags = [ck.fragment(1, f"shard-{i}") for i in range(2)]
    assert all(isinstance(f, GroupFragment) and f.world == 2 for f in frags)
    r1 = ck.read_rank(1, "shard-0", 1, fragment=frags[0])
    w = r1.state["model"]["tok.weight"]  # rank 1 held rows 128..255 of the 256 x 32 embedding
    assert tuple(w.shape) == (128, 32) and r1.shards["/model/tok.weight"].offsets == (128, 0)
    assert tuple(r1.state["optimizer"]["state"][0]["exp_avg"].shape) == (128, 32)
    models = []
    for i, f in enumerate(frags):
        read = ck.read_fragment(1, f"shard-{i}", select=["model", "optimizer"])  # one process, no group
        by_hand = whole(ck, 1, f"shard-{i}", f, "model")
        assert read["model"].keys() == by_hand.keys()
        for name, t in read["model"].items():
            assert type(t) is torch.Tensor and t.dtype == by_hand[name].dtype and torch.equal(t, by_hand[name]), name
        assert tuple(read["optimizer"]["state"][0]["exp_avg"].shape) == (256, 32)
        models.append(read["model"])
    coord = ck.read_fragment(1, COORDINATOR, select=["model"])["model"]
    for name, t in coord.items():  # outer step 1/0: the plain mean of the two shards' full tensors
        assert torch.equal(t, (models[0][name] + models[1][name]) / 2), name
    assert ck.verify(1) == []  # `ckpt verify`'s check: every rank fragment, every chunk


@pytest.mark.slow
def test_the_cut_reads_an_fsdp_groups_model_rank_by_rank_never_whole(fsdp_round):
    """What the cut above averaged: each shard's model as its ranks' pieces (rows 0..127 and 128..255
    of the embedding), never the 256 rows of one shard put together in the coordinator's process."""
    from trainrun.cut import _shard_pieces

    ck, s, _, _ = fsdp_round
    frags = [ck.fragment(1, f"shard-{i}") for i in range(2)]
    pieces = list(_shard_pieces(ck, 1, frags))
    assert [p.last for p in pieces] == [False, True, False, True]
    for p, offset in zip(pieces, (0, 128, 0, 128)):
        assert tuple(p.model["tok.weight"].shape) == (128, 32) and p.where["tok.weight"].offsets == (offset, 0)
        assert p.where.keys() == p.model.keys()  # every tensor of tinylm's model is sharded by FSDP
    assert len({p.loss for p in pieces[:2]}) == 1  # a group's loss is the same on every rank


@pytest.mark.slow
def test_an_fsdp_group_with_a_killed_rank_fails_and_its_retry_writes_the_clean_fragment(fsdp_round, tmp_path):
    _, s, results, _ = fsdp_round
    ck = Checkpointer(str(tmp_path / "k"))
    write_step_zero(ck, s)
    with pytest.raises(RankGroupFailed, match=r"shard-0: rank 1 of its group of 2 was killed by signal 9"):
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), chaos=["kill:shard=0,round=1,rank=1,step=2"],
                          heartbeat_every_s=0.2)
    retry = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=2,
                              chaos=["kill:shard=0,round=1,rank=1,step=2"])
    assert retry.digest == results[0].digest and retry.loss == results[0].loss


@pytest.mark.slow
def test_an_fsdp_groups_retry_continues_from_its_shard_checkpoint_of_sharded_state(fsdp_round, tmp_path):
    """The group checkpoints its FSDP shards at step 2 (each rank its half); rank 0 crashes at step 3,
    and the retry reads the checkpoint whole, shards it again and ends on the clean fragment."""
    _, s, results, _ = fsdp_round
    ck = Checkpointer(str(tmp_path / "c"))
    write_step_zero(ck, s)
    chaos = ["crash:shard=0,round=1,rank=0,step=3"]
    with pytest.raises(RankGroupFailed, match="rank 0 of its group of 2 exited with 1"):
        train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), chaos=chaos, heartbeat_every_s=0.2, checkpoint_every=2)
    [key] = commit.substep_keys(ck.store, 1, "shard-0", 0).values()
    r1 = ck.read_rank(1, "shard-0", 1, fragment=commit.read_fragment(ck.store, key)[0])
    assert tuple(r1.state["model"]["tok.weight"].shape) == (128, 32)  # rank 1's half, as FSDP held it
    retry = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), attempt=2, chaos=chaos, checkpoint_every=2)
    assert (retry.resumed_at_step, retry.start_source) == (2, "store")
    assert retry.digest == results[0].digest and retry.loss == results[0].loss


@pytest.mark.slow
@pytest.mark.parametrize("shard,ranks,parallelism", [(0, 2, "ddp"), (1, 1, "ddp")])
def test_the_round_after_an_fsdp_cut_trains_on_another_layout(fsdp_round, shard, ranks, parallelism):
    """Round 2 from the FSDP-written step 1 by a DDP group (shard 0), or by one process (shard 1):
    the shard's state is read whole (its optimizer's moments included) and training continues."""
    from trainrun.shard_round import train_shard_round

    ck, _, results, _ = fsdp_round
    s = spec(ranks, parallelism)
    if ranks > 1:
        r = train_shard_group(ck, None, s, shard, 2, Cut.of_step(1), heartbeat_every_s=0.2)
    else:
        r = train_shard_round(ck, s, shard, 2, Cut.of_step(1), checkpoint_every=0)
    assert r.finished and r.data_position == 8
    state = ck.read_fragment(2, f"shard-{shard}", generation=r.generation, select=["optimizer"])
    assert int(state["optimizer"]["state"][0]["step"]) == 8  # AdamW went on counting from the FSDP round's 4


@pytest.mark.slow
def test_every_builtin_but_recsys_trains_as_an_fsdp_group(tmp_path):
    for workload in ("finetune", "finetune-bf16", "dense-lm"):
        s = RunSpec(workload=workload, shards=1, steps_per_round=2, ranks_per_shard=2, parallelism="fsdp")
        ck = Checkpointer(str(tmp_path / workload))
        write_step_zero(ck, s)
        r = train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), heartbeat_every_s=0.2)
        state = ck.read_fragment(1, "shard-0")
        assert r.finished and r.data_position == 2 and isinstance(ck.gather(1, ["shard-0"], timeout=5)["shard-0"][0], GroupFragment)
        assert all(type(t) is torch.Tensor for t in state["model"].values())


@pytest.mark.slow
def test_a_step_of_fsdp_groups_passes_validation_its_shards_compared_by_global_shape(fsdp_round):
    """Validation measures a group's part rank by rank (docs/validation.md): an FSDP rank's tensors
    are shards, compared with the model the part started from by their global shape (it failed
    shape_matches_reference: 128x32 against 256x32)."""
    from trainrun.checks import validate_run_checkpoint

    ck, *_ = fsdp_round
    report = validate_run_checkpoint(ck.url, 1)
    assert report.passed, report


@pytest.mark.slow
def test_a_resume_may_change_the_parallelism_from_the_last_healthy_step_only(tmp_path):
    from trainrun.checks import validate_run_checkpoint
    from trainrun.errors import RunRefused
    from trainrun.resume import where_to_start

    url = str(tmp_path / "run")
    write_step_zero(Checkpointer(url), spec(2, "ddp"))
    with Checkpointer(url) as ck:
        with pytest.raises(RunRefused, match=r"from 2 \(ddp\) to 2 ranks per shard \(fsdp\) yet: .* resume once with "
                                             r"--ranks-per-shard 2 --parallelism ddp"):
            where_to_start(ck, spec(2, "fsdp"), resume=True)
        with pytest.raises(RunRefused, match=r"parallelism: 'ddp' -> 'fsdp'"):  # not from a chosen step
            where_to_start(ck, spec(2, "fsdp"), resume=True, from_step=0)
        assert validate_run_checkpoint(url, 0).passed
        plan = where_to_start(ck, spec(2, "fsdp"), resume=True)
        assert plan.start_step == 0 and "2 ranks per shard (fsdp) instead of 2 (ddp)" in plan.note
        assert plan.config["parallelism"] == "fsdp"
        plan = where_to_start(ck, spec(1, "fsdp"), resume=True)
        assert "ranks_per_shard" not in plan.config and "parallelism" not in plan.config  # one process shards nothing


@pytest.mark.slow
def test_ckpt_show_and_export_of_a_step_of_fsdp_groups(fsdp_round, tmp_path):
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from ckpt.cli import app

    ck, *_ = fsdp_round
    out = CliRunner().invoke(app, ["show", ck.url, "--step", "1"])
    assert out.exit_code == 0 and "shard-0: generation 0, 2 ranks" in out.output, out.output
    path = str(tmp_path / "shard-0.safetensors")
    out = CliRunner().invoke(app, ["export", ck.url, "--step", "1", "--select", "shard-0/model", "--out", path])
    assert out.exit_code == 0, out.output
    exported = load_file(path)
    model = ck.read_fragment(1, "shard-0", select=["model"])["model"]
    assert exported.keys() == model.keys() and all(torch.equal(exported[k], model[k]) for k in model)
    assert tuple(exported["tok.weight"].shape) == (256, 32)  # whole, from both ranks' halves
