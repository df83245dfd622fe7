"""The training round logic without Prefect: chaos specs, heartbeats and fencing, the outer step,
resume rules, cuts between published checkpoints, and the checkpoint layout (docs/run-layout.md)."""

from __future__ import annotations

import json

import pytest
import torch

from ckptlib import Checkpointer, FencedError
from ckptlib.heartbeat import Heartbeat, read_heartbeats
from ckptlib.testing import document_json
from tests.runs import TINY, run_rounds
from trainrun.chaos import ChaosCrash, for_attempt, parse_chaos
from trainrun.documents import Cut
from trainrun.errors import RunRefused
from trainrun.layout import COORDINATOR
from trainrun.outer import outer_optimizer, outer_step
from trainrun.resume import where_to_start
from trainrun.shard_round import train_shard_round
from trainrun.spec import RunSpec, describe_changes
from trainrun.step_zero import write_step_zero

# --- chaos ------------------------------------------------------------------------------------------

def test_chaos_specs_parse_and_reject_nonsense():
    c = parse_chaos("crash:shard=1,round=2")
    assert (c.kind, c.shard, c.round, c.attempt, c.step) == ("crash", 1, 2, 1, None)
    assert str(parse_chaos(" crash:round=3,shard=0,step=5 ")) == "crash:shard=0,round=3,step=5"
    assert for_attempt(["crash:shard=1,round=2"], 1, 2, 1) and not for_attempt(["crash:shard=1,round=2"], 1, 2, 2)
    for bad, why in [("crash", "KIND:key=value"), ("boom:shard=1,round=2", "unknown chaos kind"),
                     ("crash:shard=1", "lacks"), ("crash:shard=x,round=1", "not an integer"),
                     ("crash:shard=1,round=2,color=3", "bad item"), ("crash:shard=1,round=0", "round >= 1")]:
        with pytest.raises(ValueError, match=why):
            parse_chaos(bad)


# --- heartbeats -------------------------------------------------------------------------------------

def test_heartbeat_writes_progress_at_most_every_interval_and_stops_when_fenced(tmp_path):
    ck = Checkpointer(str(tmp_path))
    now = [100.0]
    hb = Heartbeat(ck.store, "shard-1", generation=0, round=2, steps_per_round=10, every_s=5.0, attempt=1,
                   clock=lambda: now[0] + 1_700_000_000, monotonic=lambda: now[0])
    first = hb.start()
    assert first.step is None and first.status == "running"
    assert hb.beat(step=10, loss=2.0) is None  # within 5 s of the first beat: not written
    now[0] += 6
    doc = hb.beat(step=12, loss=1.0)
    assert doc is not None and (doc.step, doc.round_step, doc.round, doc.generation) == (12, 2, 2, 0)
    assert doc.loss == pytest.approx(1.5) and doc.pid > 0 and doc.host
    stored = read_heartbeats(ck.store)["shard-1"]
    assert stored == doc and stored.time == pytest.approx(1_700_000_106)
    assert ck.fence("shard-1", 1, reason="silent", by="test")
    now[0] += 6
    with pytest.raises(FencedError, match="generation 1 is live"):
        hb.beat(step=13)
    hb.finish("fenced")
    assert json.loads(ck.store.get("heartbeats/shard-1.json"))["status"] == "fenced"
    ck.close()


def test_a_fenced_shard_attempt_stops_and_its_fragment_is_never_written(tmp_path):
    url = str(tmp_path)
    spec = RunSpec(**TINY)
    with Checkpointer(url) as ck:
        write_step_zero(ck, spec)
        ck.fence("shard-0", 1, reason="declared dead", by="test")
        # this attempt believes it is generation 0: its first beat finds generation 1 live
        with pytest.raises(FencedError):
            from ckptlib.heartbeat import Heartbeat as H

            H(ck.store, "shard-0", generation=0, round=1).start()
        # a new attempt takes the live generation and writes fragments/1/shard-0.g1.json
        out = train_shard_round(ck, spec, 0, 1, Cut.of_step(0))
    assert out.generation == 1
    assert ck.store.exists("fragments/1/shard-0.g1.json") and not ck.store.exists("fragments/1/shard-0.g0.json")


# --- the outer step -----------------------------------------------------------------------------------

def test_outer_step_averages_exactly_and_keeps_nesterov_momentum():
    g = {"w": torch.zeros(4), "n": torch.tensor(3)}
    shards = [{"w": torch.tensor([1.0, 2.0, 3.0, 4.0]), "n": torch.tensor(3)},
              {"w": torch.tensor([3.0, 2.0, 1.0, 0.0]), "n": torch.tensor(3)}]
    plain = RunSpec(**TINY)
    state0 = outer_optimizer(plain, g)[0].state_dict()
    new, st = outer_step(plain, g, state0, shards)
    assert torch.equal(new["w"], torch.full((4,), 2.0)) and new["n"].item() == 3 and st["state"] == {}
    one, _ = outer_step(plain, g, state0, shards[:1])
    assert torch.equal(one["w"], shards[0]["w"])  # one shard: plain training, bit for bit
    nesterov = RunSpec(**{**TINY, "outer_lr": 0.7, "outer_momentum": 0.9})
    s0 = outer_optimizer(nesterov, g)[0].state_dict()
    new, st = outer_step(nesterov, g, s0, shards)
    # outer gradient g - mean = -2; buf = -2; Nesterov update = -(0.7) * (-2 + 0.9 * -2) = 2.66
    assert torch.allclose(new["w"], torch.full((4,), 2.66))
    assert torch.allclose(st["state"][0]["momentum_buffer"], torch.full((4,), -2.0))


# --- resume rules -------------------------------------------------------------------------------------

def test_the_mean_of_pieces_is_the_mean_of_whole_models_bit_for_bit_and_bad_pieces_are_refused():
    """A group's model added piece by piece (FSDP's dim-0 blocks of uneven and empty size, a piece
    replicated over ranks, a whole tensor beside the pieces) gives the same mean as whole models."""
    from ckptlib.distributed import ShardInfo
    from trainrun.outer import ShardMean

    torch.manual_seed(0)
    g = {"w": torch.randn(7, 3), "b": torch.randn(5), "steps": torch.tensor([3, 4])}
    shards = [{k: (v + torch.randn_like(v) if v.is_floating_point() else v + i) for k, v in g.items()} for i in range(3)]
    whole = ShardMean(g)
    for m in shards:
        whole.add(m)
    pieces = ShardMean(g)
    for m in shards:
        for rows in ((0, 4), (4, 7), (7, 7)):  # three ranks: 4 rows, 3 rows, none
            where = {"w": ShardInfo((7, 3), (rows[0], 0)), "b": ShardInfo((5,), (0,))}  # b replicated
            pieces.add_piece({"w": m["w"][rows[0]:rows[1]], "b": m["b"], "steps": m["steps"]}, where)
        pieces.end_shard()
    expected, got = whole.result(), pieces.result()
    assert expected.keys() == got.keys() == g.keys()
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

    def refused(add, match):
        mean = ShardMean(g)
        with pytest.raises(ValueError, match=match):
            add(mean)
            mean.end_shard()

    m = shards[0]
    refused(lambda mean: mean.add_piece({**m, "w": m["w"][:4]}, {"w": ShardInfo((7, 3), (0, 0))}),
            r"covers 12 of the 21 elements of 'w': a piece is missing")
    refused(lambda mean: [mean.add_piece({**m, "w": m["w"][r:r + 4]}, {"w": ShardInfo((7, 3), (r, 0))}) for r in (0, 3)],
            r"pieces of 'w' overlap")
    refused(lambda mean: mean.add_piece({**m, "w": m["w"][:4]}, {"w": ShardInfo((7, 3), (5, 0))}),
            r"does not fit its \[7, 3\] tensor")
    refused(lambda mean: mean.add_piece({**m, "w": m["w"][:4]}, {"w": ShardInfo((8, 3), (0, 0))}),
            r"of a \[8, 3\] tensor, the global model's is \[7, 3\]")
    refused(lambda mean: mean.add({"w": m["w"], "b": m["b"]}), r"covers 0 of the 2 elements of 'steps'")
    refused(lambda mean: mean.add({**m, "w": m["w"][:1]}), r"covers 3 of the 21 elements of 'w'")  # never broadcast
    refused(lambda mean: mean.add({**m, "b": m["b"].reshape(5, 1)}), r"piece of 'b' \(\[5, 1\] at \[0\]\) does not fit")


def test_plan_refuses_an_existing_run_without_resume_and_names_changed_fields(tmp_path):
    url = str(tmp_path / "run")
    spec = RunSpec(**TINY)
    with Checkpointer(url) as ck:
        assert where_to_start(ck, spec, resume=False).start_step is None
        write_step_zero(ck, spec)
        with pytest.raises(RunRefused, match="already has committed checkpoints.*--resume"):
            where_to_start(ck, spec, resume=False, run_id="r1")
        changed = RunSpec(**{**TINY, "seed": 1, "steps_per_round": 5})
        with pytest.raises(RunRefused, match=r"seed: 0 -> 1; steps_per_round: 3 -> 5"):
            where_to_start(ck, changed, resume=True)
        # no validated checkpoint yet: resume recomputes from scratch (identically)
        assert where_to_start(ck, spec, resume=True).start_step is None
    assert describe_changes({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == ["b: 2 -> 3", "c: '<absent>' -> 4"]


# --- cuts, determinism, layout ------------------------------------------------------------------------

def test_checkpoint_every_two_commits_the_same_states_and_continues_from_fragments(tmp_path):
    # recsys: its sparse updates are stored as deltas, which show the delta base (a dense state such
    # as tinylm's is written as keyframes whatever its base: docs/decisions.md 42)
    spec = RunSpec(**{**TINY, "workload": "recsys", "workload_extra": {"n_users": 2000, "n_items": 2000, "dim": 16}})
    every1 = run_rounds(str(tmp_path / "a"), spec, 4, every=1)
    every2 = run_rounds(str(tmp_path / "b"), spec, 4, every=2)
    assert sorted(every2) == [0, 2, 4]
    assert all(every2[s] == every1[s] for s in every2)
    # rounds 1 and 3 exist only as fragments; rounds 2 and 4 continue from them, as their delta base
    # (round 3 itself may be a keyframe again: its chain from step 0 reached ckptlib's delta budget)
    with Checkpointer(str(tmp_path / "b")) as ck:
        assert ck.steps() == [0, 2, 4]
        for step in (2, 4):
            assert document_json(ck.store.get(f"fragments/{step}/shard-0.g0.json"))["stats"]["delta"] > 0


def test_checkpoint_holds_the_run_layout(tmp_path):
    url = str(tmp_path)
    spec = RunSpec(**TINY)
    run_rounds(url, spec, 2)
    with Checkpointer(url) as ck:
        m = ck.manifest(2)
        assert not m.single and sorted(m.parts) == [COORDINATOR, "shard-0", "shard-1"]
        assert len({f.config_hash for f in m.parts.values()}) == 1
        state = ck.restore(2)
    c = state[COORDINATOR]
    assert set(c) == {"model", "outer_optimizer", "round", "global_step", "config", "metrics"}
    assert (c["round"], c["global_step"], c["config"]) == (2, 2 * spec.steps_per_round, spec.to_dict())
    assert set(c["metrics"]) == {"loss", "eval_loss"}
    for i in range(spec.shards):
        s = state[f"shard-{i}"]
        assert {"model", "optimizer", "scheduler", "data_position", "rng", "round", "loss"} <= set(s)
        assert s["data_position"] == 2 * spec.steps_per_round and s["round"] == 2
        assert isinstance(s["rng"]["torch"], torch.Tensor) and s["rng"]["torch"].dtype == torch.uint8
        assert s["rng"]["numpy"][0] == "MT19937" and s["rng"]["python"][0] == 3
        assert s["optimizer"]["state"]  # Adam moments after training


def test_a_retried_shard_round_writes_the_same_fragment(tmp_path):
    url = str(tmp_path)
    spec = RunSpec(**TINY)
    with Checkpointer(url) as ck:
        write_step_zero(ck, spec)
    chaos = for_attempt(["crash:shard=1,round=1"], 1, 1, 1)
    with Checkpointer(url) as ck, pytest.raises(ChaosCrash, match="on purpose"):
        train_shard_round(ck, spec, 1, 1, Cut.of_step(0), chaos=chaos)
    assert json.loads(Checkpointer(url).store.get("heartbeats/shard-1.json"))["status"] == "failed"
    with Checkpointer(url) as ck:
        a = train_shard_round(ck, spec, 1, 1, Cut.of_step(0), attempt=2)
    with Checkpointer(url) as ck:  # a third run of the same round: identical, accepted as is
        b = train_shard_round(ck, spec, 1, 1, Cut.of_step(0), attempt=3)
    assert a.digest == b.digest and b.bytes_written == 0


def test_read_fragment_adopt_makes_the_fragment_the_delta_base(tmp_path):
    url = str(tmp_path)
    x = torch.arange(1 << 16, dtype=torch.float32)
    Checkpointer(url).write_fragment(1, "p", {"x": x})
    with Checkpointer(url) as ck:
        ck.read_fragment(1, "p")
        keyframe = ck.write_fragment(2, "p", {"x": x + 1e-3})
    with Checkpointer(url) as ck:
        ck.read_fragment(1, "p", adopt=True)
        delta = ck.write_fragment(3, "p", {"x": x + 1e-3})
    assert keyframe.stats["delta"] == 0 and delta.stats["delta"] > 0


# --- the CLI's options ----------------------------------------------------------------------------------

def test_cli_options_are_the_schema_and_bad_options_are_one_line_errors(tmp_path):
    """Every RunSpec field (the trajectory) is a ``ckpt train`` option, and every option that is a
    TrainParams field has the field's default: one schema behind the CLI, the form and the runtime."""
    import inspect

    from typer.testing import CliRunner

    from ckpt.cli import app
    from ckpt.cmd_train import train
    from ckpt.train_options import CLI_FIELDS
    from flows.params import TrainParams

    fields = TrainParams.model_fields
    sig = inspect.signature(train).parameters
    assert set(RunSpec.model_fields) <= set(CLI_FIELDS.values())
    for cli_name, field in CLI_FIELDS.items():
        default = fields[field].get_default(call_default_factory=True)
        cli_default = sig[cli_name].default
        if cli_name in ("workload_extra", "chaos"):  # JSON text / repeatable: absent = the field's empty default
            assert cli_default is None and not default, cli_name
        else:
            assert cli_default == default, (cli_name, cli_default, default)
    store = str(tmp_path)
    for args, why in [(["--chaos", "boom:shard=1,round=2"], "unknown chaos kind"),
                      (["--task-runner", "ray"], "task runner 'ray'"),
                      (["--validation-runner", "proc"], "validation_runner: Input should be 'process' or 'threads'"),
                      (["--run-id", "a/b"], "run id"),
                      (["--shards", "0"], "shards: Input should be greater than or equal to 1"),
                      (["--resume"], "--resume needs --run-id"),
                      (["--storage-options", "{nope"], "JSON object"),
                      (["--storage-options", "@/nonexistent/opts.json"], "cannot read")]:
        r = CliRunner().invoke(app, ["train", "--store", store, *args])
        assert r.exit_code == 2 and why in r.output, (args, r.output)
        assert r.output.startswith("error: ") and "Traceback" not in r.output


def test_one_shard_is_plain_training(tmp_path):
    url = str(tmp_path)
    spec = RunSpec(**{**TINY, "shards": 1})
    run_rounds(url, spec, 2)
    with Checkpointer(url) as ck:
        state = ck.restore(2)
    coord, shard = state[COORDINATOR]["model"], state["shard-0"]["model"]
    assert all(torch.equal(coord[k], shard[k]) for k in coord)
