"""The typed documents that cross boundaries (heartbeats, fences, decisions, rerun requests, cuts,
verdicts, ...) and the watchdog's judge on documents written by hand: fast, no Prefect, no training.

Every document round-trips through JSON unchanged, and a malformed one (not JSON, a field missing,
a value of the wrong type, another format) is a ``DocumentError`` naming the document, where it was
read and the field; a reader that meets one in the store treats it as unknown, never a KeyError.
"""

from __future__ import annotations

import json
import time

import pytest

from ckptlib import commit
from ckptlib.documents import DocumentError
from ckptlib.heartbeat import Beat, read_heartbeat, read_heartbeats
from ckptlib.store import Store
from ckptlib.validate import Failure, Verdict, error_verdict, read_verdict
from trainrun.chaos import Strike
from trainrun.documents import CoordinatorInfo, Cut, ShardInfo
from trainrun.errors import RerunRefused
from trainrun.spec import RunSettings, RunSpec
from trainrun.watchdog import Decision, Fence, RerunRequest, assess_run
from trainrun.watchdog.decisions import RerunInfo, Resumed
from trainrun.watchdog.rerun import plan_rerun

BEAT = Beat(part="shard-0", generation=1, round=3, status="running", time=100.5, started=90.0, step=17, round_step=2,
            steps_per_round=40, beats=4, host="h", pid=7, attempt=2, loss=1.25, meta={"cut": {"step": 2}})
CUT = Cut(2, False, {"shard-0": 1, "coordinator": 0})
DECISION = Decision(kind="fenced", run="r", run_url="/x/r", part="shard-0", state="silent", detected=105.0,
                    failure_time=100.5, detection_latency_s=4.5, by="wd", shard=0, reason="no heartbeat", round=3,
                    generation=2, rerun=RerunInfo(0, 3, 2), resumed=Resumed("id", "name", "why"))
DOCUMENTS = [
    BEAT, CUT, DECISION,
    ShardInfo(cut=CUT, config_hash="abc"),
    CoordinatorInfo(run_id="r", spec=RunSpec(shards=3), settings=RunSettings(chaos=["hang:shard=0,round=2"]),
                    phase="shards", phase_time=99.0, cut=CUT, flow_run_id="f"),
    Fence(part="shard-0", generation=2, reason="silent", by="wd", time=105.0, state="silent", rerun=True),
    RerunRequest(run_url="/x/r", shard=0, round=3, cut=CUT, spec=RunSpec(), settings=RunSettings(), generation=2,
                 attempt_offset=2),
    Strike(kind="hang", spec="hang:shard=0,round=3", part="shard-0", round=3, attempt=1, round_step=20, time=1.0, pid=3),
    Verdict(step=4, run="/x/r", passed=False, failed=("no_nan",),
            failures=(Failure("no_nan", 1, ("part 'shard-1'",), "no NaN", "expect", "tensors", "nan_count"),),
            integrity=({"step": 4, "part": "p"},), expectations={"evaluated": 19, "successful": 18},
            summary={"loss": 1.5, "parts": ["coordinator"]}),
    error_verdict(4, "/x/r", OSError("unreachable")),
]


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda d: type(d).__name__)
def test_documents_round_trip_through_json_and_have_a_schema(doc):
    again = type(doc).from_json(doc.to_json())
    assert again == doc and type(again) is type(doc)
    schema = type(doc).json_schema()
    assert schema["type"] == "object" and set(schema["required"]) <= set(schema["properties"])
    assert set(json.loads(doc.to_json())) == set(schema["properties"])


@pytest.mark.parametrize("data, why", [
    (b"{not json", "is not JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({**BEAT.to_dict(), "format": 2}).encode(), "has format 2; this version reads format 1"),
    (json.dumps({k: v for k, v in BEAT.to_dict().items() if k != "time"}).encode(), "lacks the field 'time'"),
    (json.dumps({**BEAT.to_dict(), "time": "yesterday"}).encode(), "field 'time' must be a number, got 'yesterday'"),
    (json.dumps({**BEAT.to_dict(), "status": "sleeping"}).encode(), "field 'status' must be one of 'running'"),
    (json.dumps({**BEAT.to_dict(), "generation": True}).encode(), "field 'generation' must be an integer"),
    (json.dumps({**BEAT.to_dict(), "meta": [1]}).encode(), "field 'meta' must be an object"),
])
def test_a_malformed_document_is_an_error_naming_where_and_what(data, why):
    with pytest.raises(DocumentError, match="heartbeat document at s3://b/r/heartbeats/shard-0.json") as e:
        Beat.from_json(data, "s3://b/r/heartbeats/shard-0.json")
    assert why in str(e.value)


def test_nested_documents_and_models_are_checked_too():
    bad_cut = {**DECISION.to_dict(), "rerun": {"shard": 0, "round": "three", "attempt_offset": 1}}
    with pytest.raises(DocumentError, match=r"field 'rerun' must be a valid rerun .*field 'round' must be an integer"):
        Decision.from_dict(bad_cut)
    info = CoordinatorInfo(spec=RunSpec()).to_dict()
    info["spec"]["shards"] = 0
    with pytest.raises(DocumentError, match="field 'spec' must be a valid RunSpec"):
        CoordinatorInfo.from_dict(info)
    assert Beat.from_dict({**BEAT.to_dict(), "extra": 1}) == BEAT  # a newer writer's extra field is ignored


def test_unreadable_documents_in_the_store_read_as_unknown_not_as_errors(tmp_path):
    store = Store.from_url(str(tmp_path))
    store.put("heartbeats/shard-0.json", b'{"format": 1, "part": "shard-0"}')  # torn / foreign
    store.put("heartbeats/shard-1.json", BEAT.to_json().replace(b'"shard-0"', b'"shard-1"'))
    store.put("validations/3.json", b'{"passed": "yes"}')
    assert read_heartbeat(store, "shard-0") is None and set(read_heartbeats(store)) == {"shard-1"}
    v = read_verdict(store, 3)
    assert v is not None and not v.passed and v.failed == ("unreadable_verdict",)


# --- the judge, on beats written by hand (a fake clock) -------------------------------------------

def _coordinator(store: Store, now: float, **info) -> None:
    meta = CoordinatorInfo(run_id="r", spec=RunSpec(shards=2), phase="shards", phase_time=now - 1, cut=Cut.of_step(0),
                           **info)
    beat = Beat(part="coordinator", generation=0, round=1, status="running", time=now, started=now - 100, step=1,
                meta=meta.to_dict())
    store.put("heartbeats/coordinator.json", beat.to_json())


def _shard(store: Store, part: str, t: float, **kw) -> None:
    beat = Beat(part=part, generation=0, round=1, status="running", time=t, started=t - 5, step=5, round_step=5,
                steps_per_round=40, attempt=1, meta=ShardInfo(Cut.of_step(0), RunSpec(shards=2).config_hash()).to_dict())
    store.put(f"heartbeats/{part}.json", Beat.from_dict({**beat.to_dict(), **kw}).to_json())


def test_the_judge_reads_typed_beats_and_survives_malformed_ones(tmp_path):
    store = Store.from_url(str(tmp_path))
    now = 1_000_000.0
    _coordinator(store, now)
    _shard(store, "shard-0", now - 10)  # silent
    store.put("heartbeats/shard-1.json", b"garbage")  # unreadable: no beat, so waiting (not a crash)
    view = assess_run(store, "u", timeout_s=4, now=now)
    assert view.info is not None and view.info.phase == "shards"
    assert [(p.part, p.state) for p in view.shards] == [("shard-0", "silent"), ("shard-1", "waiting")]
    assert view.shards[0].beat is not None and view.shards[0].failure_time == now - 10
    # before its first step an attempt is starting: the start timeout applies, not the timeout
    _shard(store, "shard-0", now - 10, round_step=None, step=None)
    assert assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=now).shards[0].state == "running"
    _coordinator(store, now + 31)
    pv = assess_run(store, "u", timeout_s=4, start_timeout_s=40, now=now + 31).shards[0]
    assert pv.state == "silent" and "start timeout 40 s" in pv.reason and "loading the cut" in pv.reason
    # a coordinator beat whose meta does not parse: the run is judged without its info (parts from beats)
    store.put("heartbeats/coordinator.json", Beat(part="coordinator", generation=0, round=1, status="running",
                                                   time=now, started=now - 100, meta={"spec": "nonsense"}).to_json())
    view = assess_run(store, "u", timeout_s=4, now=now)
    assert view.info is None and [p.part for p in view.shards] == ["shard-0"]


def test_a_rerun_takes_a_spec_only_from_this_process_or_the_allow_list(tmp_path):
    store = Store.from_url(str(tmp_path))
    now = time.time()
    _coordinator(store, now)
    _shard(store, "shard-0", now - 60)
    view = assess_run(store, "u", timeout_s=4, now=now)
    pv = view.shards[0]
    assert pv.state == "silent"
    no_config = lambda: None  # noqa: E731
    req = plan_rerun(view, pv, known=None, allowed=(), committed_config=no_config)  # tinylm: a built-in
    assert (req.shard, req.round, req.cut, req.spec.shards) == (0, 1, Cut.of_step(0), 2)
    assert plan_rerun(view, pv, known=RunSpec(shards=2), allowed=(), committed_config=no_config).spec == RunSpec(shards=2)
    with pytest.raises(RerunRefused, match="differs from the one this watchdog was given"):
        plan_rerun(view, pv, known=RunSpec(shards=2, seed=1), allowed=(), committed_config=no_config)
    _coordinator(store, now)  # the store names code now
    info = CoordinatorInfo.from_dict(json.loads(store.get("heartbeats/coordinator.json"))["meta"])
    evil = CoordinatorInfo(**{**info.__dict__, "spec": RunSpec(workload="os:system", shards=2)})
    beat = Beat.from_json(store.get("heartbeats/coordinator.json"))
    store.put("heartbeats/coordinator.json", Beat(**{**beat.__dict__, "meta": evil.to_dict()}).to_json())
    view = assess_run(store, "u", timeout_s=4, now=now)
    with pytest.raises(RerunRefused, match="'os:system'.*not imported, not run"):
        plan_rerun(view, view.shards[0], known=None, allowed=(), committed_config=no_config)
    with pytest.raises(RerunRefused, match="config hash differs"):  # allowed, but the dead attempt ran another spec
        plan_rerun(view, view.shards[0], known=None, allowed=("os:system",), committed_config=no_config)
    assert commit.live_generation(store, "shard-0") == 0  # planning changes nothing
