"""Checkpoint validation (ckptlib.validate with the run's checks of trainrun.checks, tasks/validate.py,
flows/validate.py, `ckpt validate`).

Real checkpoints in the run layout (docs/run-layout.md): a small torch MLP trained with AdamW by 2
shards, averaged by a coordinator, committed as cuts ``coordinator`` + ``shard-0`` + ``shard-1``.
Real Great Expectations runs. Each bad input is made on a copy of one clean run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor as ThreadPool

import numpy as np
import pytest
import torch

from ckptlib import Checkpointer
from ckptlib import commit as ckcommit
from ckptlib.manifest import combined_digest, document_checksum, fragment_key, part_digest
from ckptlib.store import Store
from ckptlib.testing import document_json
from ckptlib.validate import CHECK_NAMES, Thresholds, Verdict, read_verdict, validate_checkpoint
from ckptlib.validate.report import PLOT_SIZE_PX
from trainrun.checks import RUN_CHECKS, validate_run_checkpoint

SHARDS, H, DIM, ROUNDS = 2, 3, 32, 3
CONFIG = {"shards": SHARDS, "steps_per_round": H, "dim": DIM, "workload": "mlp"}
CONFIG_HASH = hashlib.sha256(json.dumps(CONFIG, sort_keys=True).encode()).hexdigest()[:16]
PARTS = ["coordinator"] + [f"shard-{i}" for i in range(SHARDS)]


# --- building runs -------------------------------------------------------------------------------

def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.ReLU(), torch.nn.Linear(DIM, 4))


def _rng_states(shard: int, rnd: int) -> dict:
    return {"torch": torch.Generator().manual_seed(1000 * shard + rnd).get_state(),
            "numpy": np.random.RandomState(shard + rnd).get_state(),
            "python": random.Random(shard + rnd).getstate()}


def make_run(url: str, storage_options: dict | None = None, rounds: int = ROUNDS) -> None:
    """Commit steps 0..rounds of a 2-shard local-SGD run (step r = the cut after round r)."""
    torch.manual_seed(0)
    glob = _model()
    models = [_model() for _ in range(SHARDS)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    gens = [torch.Generator().manual_seed(100 + i) for i in range(SHARDS)]
    pos = [0] * SHARDS
    writers = [Checkpointer(url, storage_options) for _ in range(SHARDS)]
    coord = Checkpointer(url, storage_options)
    try:
        for r in range(rounds + 1):
            losses = []
            for i in range(SHARDS):
                models[i].load_state_dict(glob.state_dict())
                loss = torch.tensor(0.0)
                for _ in range(H if r else 0):
                    x = torch.randn(16, DIM, generator=gens[i])
                    y = torch.randint(0, 4, (16,), generator=gens[i])
                    loss = torch.nn.functional.cross_entropy(models[i](x), y)
                    opts[i].zero_grad()
                    loss.backward()
                    opts[i].step()
                    pos[i] += 1
                losses.append(float(loss.detach()))
                writers[i].write_fragment(r, f"shard-{i}", {
                    "model": models[i].state_dict(), "optimizer": opts[i].state_dict(), "scheduler": None,
                    "data_position": pos[i], "rng": _rng_states(i, r), "round": r, "loss": losses[-1],
                }, config_hash=CONFIG_HASH, meta={"loss": losses[-1]})
            if r:
                with torch.no_grad():
                    for k, v in glob.state_dict().items():
                        v.copy_(torch.stack([m.state_dict()[k] for m in models]).mean(0))
            coord.write_fragment(r, "coordinator", {
                "model": glob.state_dict(), "outer_optimizer": {}, "round": r, "global_step": r * H,
                "config": dict(CONFIG), "metrics": {"loss": sum(losses) / SHARDS, "eval_loss": None},
            }, config_hash=CONFIG_HASH)
            coord.commit(r, PARTS, timeout=30)
    finally:
        for ck in writers + [coord]:
            ck.close()


def commit_variant(url: str, new_step: int, modify=None, *, drop=(), storage_options=None, src: int | None = None):
    """Commit ``new_step`` from the state of ``src`` (default: the latest step) with rounds and data
    positions advanced, after ``modify(part, state)``; parts in ``drop`` are left out of the cut."""
    with Checkpointer(url, storage_options) as ck:
        src = ck.steps()[-1] if src is None else src
        m = ck.manifest(src)
        state = ck.restore(src)
        parts = [p for p in state if p not in drop]
        for part in parts:
            st = state[part]
            st["round"] = new_step
            if "data_position" in st:
                st["data_position"] += H
            if modify:
                modify(part, st)
            ck.write_fragment(new_step, part, st, config_hash=m.parts[part].config_hash)
        ck.commit(new_step, parts, timeout=30)


def _files(root) -> dict[str, bytes]:
    """Every checkpoint file (everything but validations/ and reports/), by relative path."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if not rel.startswith(("validations", "reports")):
                with open(os.path.join(dirpath, n), "rb") as f:
                    out[rel] = f.read()
    return out


def _validate_unchanged(root, step, **kw) -> Verdict:
    """Validate and assert that no checkpoint file changed (validation writes only its own keys)."""
    before = _files(root)
    verdict = validate_run_checkpoint(str(root), step, **kw)
    assert _files(root) == before
    assert read_verdict(Store.from_url(str(root)), step) == verdict
    return verdict


def _where(verdict: Verdict, name: str) -> list[str]:
    found = verdict.failure(name)
    assert found is not None, f"{name} not among the failures {verdict.failed}"
    return list(found.where)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A clean run, steps 0..3, all validated (module-wide template; tests copy it)."""
    root = tmp_path_factory.mktemp("template") / "run"
    make_run(str(root))
    verdicts = [validate_run_checkpoint(str(root), s) for s in range(ROUNDS + 1)]
    return root, verdicts


@pytest.fixture
def run(clean_run, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(clean_run[0], root)
    return root


# --- clean checkpoints ---------------------------------------------------------------------------

def test_clean_run_passes_every_expectation(clean_run):
    root, verdicts = clean_run
    for step, v in enumerate(verdicts):
        assert v.passed, (step, v.failures)
        assert v.failed == () and v.problems == ()
        assert v.expectations["evaluated"] == len(CHECK_NAMES) + len(RUN_CHECKS.checks) == v.expectations["successful"]
    last = verdicts[-1].summary
    assert last["parts"] == PARTS and last["shards_present"] == last["shards_expected"] == SHARDS
    assert last["previous_healthy_step"] == ROUNDS - 1 and last["round"] == ROUNDS
    assert last["nan_count"] == 0 and 0 < last["max_rel_change"] < Thresholds().max_rel_change
    assert last["data_positions"] == {"shard-0": ROUNDS * H, "shard-1": ROUNDS * H}
    assert last["logical_bytes"] > 0 and last["bytes_written"] > 0 and last["ratio"] > 0
    assert Checkpointer(str(root)).healthy_steps() == list(range(ROUNDS + 1))


def test_report_files_are_real(clean_run):
    root, verdicts = clean_run
    rep = root / "reports" / str(ROUNDS)
    for name in ("index.html", "tensors.html", "parts.html", "summary.json", "run.png", "tensors.csv", "parts.csv"):
        assert (rep / name).stat().st_size > 500, name
    from PIL import Image

    with Image.open(rep / "run.png") as img:
        assert img.format == "PNG" and img.size == PLOT_SIZE_PX
        assert len(np.unique(np.asarray(img.convert("RGB")).reshape(-1, 3), axis=0)) > 20  # a drawing, not a blank canvas
    gx_html = (rep / "tensors.html").read_text()
    assert "no_nan" in gx_html and "checkpoint_integrity" in gx_html  # GX Data Docs name the expectations
    summary = json.loads((rep / "summary.json").read_text())
    assert [h["step"] for h in summary["history"]] == list(range(ROUNDS + 1))
    index = (root / "reports" / "index.html").read_text()
    assert all(f"{s}/index.html" in index for s in range(ROUNDS + 1))


# --- bad input: each a FAILED verdict naming what and where; files untouched ------------------------

def _chunk_file(root, step: int, part: str, tensor: str) -> tuple[str, str, set[str]]:
    """(path, key) of the stored object holding ``tensor``'s first bytes, and every tensor it holds
    (small tensors are packed together)."""
    frag = Checkpointer(str(root)).fragment(step, part)
    leaf = next(leaf for leaf in frag.leaves if leaf.spec.path == "/" + tensor)
    digest = leaf.segments()[0][0]
    holds = {x.spec.path for x in frag.leaves if any(d == digest for d, *_ in x.segments())}
    key = frag.blobs[digest].key
    return str(root / key), key, holds


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_chunk_fails_integrity_naming_the_chunk(run, damage):
    path, key, holds = _chunk_file(run, ROUNDS, "shard-1", "optimizer/state/0/exp_avg_sq")
    if damage == "flip":
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x10
        open(path, "wb").write(bytes(data))
    elif damage == "truncate":
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    else:
        os.remove(path)
    v = _validate_unchanged(run, ROUNDS)
    assert not v.passed and "checkpoint_integrity" in v.failed
    where = _where(v, "checkpoint_integrity")
    assert any("shard-1" in w and "optimizer/state/0/exp_avg_sq" in w and "chunk 0" in w and key in w
               for w in where), where
    reason = {"flip": "decode", "truncate": "truncated", "delete": "missing"}[damage]
    assert any(reason in w for w in where), where
    # the intact parts were still judged: only the tensors stored in the damaged object are not intact
    bad = {p["tensor"] for p in v.integrity}
    assert {p["part"] for p in v.integrity} == {"shard-1"} and "/optimizer/state/0/exp_avg_sq" in bad and bad <= holds
    assert (run / "reports" / str(ROUNDS) / "index.html").read_text().count("checkpoint_integrity") >= 1


def test_nans_in_one_shard_fail_no_nan_naming_the_shard(run):
    def poison(part, st):
        if part == "shard-1":
            st["model"]["0.weight"][3, :5] = float("nan")

    commit_variant(str(run), ROUNDS + 1, poison)
    v = _validate_unchanged(run, ROUNDS + 1)
    assert not v.passed and "no_nan" in v.failed
    assert _where(v, "no_nan") == ["part 'shard-1', tensor 'model/0.weight' (nan_count=5)"]
    assert "checkpoint_integrity" not in v.failed  # the bytes are intact; the values are not
    assert v.summary["nan_count"] == 5
    html = (run / "reports" / str(ROUNDS + 1) / "index.html").read_text()
    assert "no_nan" in html and "shard-1" in html
    assert "no_nan" in (run / "reports" / str(ROUNDS + 1) / "tensors.html").read_text()


def _rewrite_part(root, step: int, part: str, edit, *, fix_digests: bool) -> None:
    """Write the fragment of ``part`` of committed ``step`` again after ``edit(dict)``, and its
    checksum into the manifest (a forged or damaged part; the manifest names each part's fragment)."""
    store = Store.from_url(str(root))
    m = document_json(store.get(ckcommit.manifest_key(step)))
    ref = m["parts"][part]
    frag = document_json(store.get(ref["key"]))
    edit(frag)
    if fix_digests:  # a consistent forgery: only the structure checks can catch it
        from ckptlib.manifest import Leaf

        frag["digest"] = part_digest(frag["skeleton"], [Leaf.from_json(x) for x in frag["leaves"]], frag["format"])
        ref["digest"] = frag["digest"]
        m["digest"] = combined_digest({n: p["digest"] for n, p in m["parts"].items()}, m["single"])
    data = json.dumps(frag, separators=(",", ":")).encode()
    ref.update(checksum=document_checksum(data), size=len(data))  # written back as plain JSON
    assert ref["key"] == fragment_key(step, part, ref["generation"])
    with open(root / ref["key"], "wb") as f:
        f.write(data)
    with open(root / ckcommit.manifest_key(step), "wb") as f:
        f.write(json.dumps(m).encode())


def _leaf(frag: dict, tensor: str) -> dict:
    return next(leaf for leaf in frag["leaves"] if leaf["path"] == "/" + tensor)


@pytest.mark.parametrize("fix_digests", [True, False], ids=["forged", "damaged"])
def test_wrong_shape_in_manifest_fails_naming_the_tensor(run, fix_digests):
    def transpose(frag):
        _leaf(frag, "model/0.weight")["shape"] = [DIM // 2, DIM * 2]  # same byte count

    _rewrite_part(run, ROUNDS, "coordinator", transpose, fix_digests=fix_digests)
    v = _validate_unchanged(run, ROUNDS)
    assert not v.passed
    if fix_digests:  # a consistent forgery: the coordinator's shape differs from before, and from the shards'
        assert "part 'coordinator', tensor 'model/0.weight' (shape_matches_reference=False)" in \
            _where(v, "shape_matches_reference")
        assert "checkpoint_integrity" not in v.failed
    else:  # the digest covers shapes: ckptlib refuses the part when it reads it
        assert any("coordinator" in w and "digest" in w for w in _where(v, "checkpoint_integrity"))


def test_inconsistent_shape_fails_integrity_naming_the_tensor(run):
    def grow(frag):
        _leaf(frag, "model/2.weight")["shape"] = [4, DIM + 1]  # more elements than bytes

    _rewrite_part(run, ROUNDS, "shard-0", grow, fix_digests=False)  # no digest can cover a spec refused on read
    v = _validate_unchanged(run, ROUNDS)
    assert "checkpoint_integrity" in v.failed  # ckptlib refuses a spec whose shape x itemsize != bytes on read
    assert any("shard-0" in w and "model/2.weight" in w for w in _where(v, "checkpoint_integrity"))


def test_unreadable_manifest_still_gets_a_verdict_and_report(run):
    with open(run / ckcommit.manifest_key(ROUNDS), "wb") as f:
        f.write(b'{"format": 1, "step": 3, "parts": {"coordinator": ')  # torn
    v = _validate_unchanged(run, ROUNDS)
    assert v.failed == ("checkpoint_integrity",) and not v.passed
    assert "manifests/3.json" in _where(v, "checkpoint_integrity")[0]
    assert (run / "reports" / str(ROUNDS) / "index.html").exists()
    assert (run / "reports" / str(ROUNDS) / "run.png").stat().st_size > 1000


def test_exploding_update_fails_relative_change(run):
    def explode(part, st):
        if part == "shard-0":
            st["model"]["2.weight"].mul_(500.0)

    commit_variant(str(run), ROUNDS + 1, explode)
    v = _validate_unchanged(run, ROUNDS + 1)
    assert "relative_change_within_bounds" in v.failed
    assert [w.split(" (")[0] for w in _where(v, "relative_change_within_bounds")] == [
        "part 'shard-0', tensor 'model/2.weight'"]
    strict = validate_run_checkpoint(str(run), ROUNDS + 1, thresholds={"max_rel_change": 1e6, "max_abs_value": 1e6})
    assert strict.passed, strict.failures  # thresholds are per run
    with pytest.raises(ValueError, match="unknown validation thresholds"):
        validate_run_checkpoint(str(run), ROUNDS + 1, thresholds={"max_rel_chnge": 1})


def test_missing_shard_and_stalled_progress_fail(run):
    commit_variant(str(run), ROUNDS + 1, drop=("shard-1",))
    v = validate_run_checkpoint(str(run), ROUNDS + 1)
    assert _where(v, "all_shards_present") == ["part 'shard-1' (present=False)"]

    def stall(part, st):
        if part == "shard-0":
            st["data_position"] -= H  # did not advance
            del st["rng"]["numpy"]
        if part == "shard-1":
            for s in st["optimizer"]["state"].values():
                s["exp_avg_sq"].view(-1)[0] = -1.0
            st["optimizer"]["state"][0]["step"] += 1

    commit_variant(str(run), ROUNDS + 2, stall, src=ROUNDS)
    v = validate_run_checkpoint(str(run), ROUNDS + 2)
    assert _where(v, "data_position_advanced") == ["part 'shard-0' (data_advance=0)"]
    assert _where(v, "rng_states_present") == ["part 'shard-0' (rng_present=False)"]
    assert _where(v, "optimizer_steps_consistent") == ["part 'shard-1' (opt_step_spread=1)"]
    assert all("shard-1" in w for w in _where(v, "adam_second_moments_nonnegative"))
    assert v.failure("adam_second_moments_nonnegative").count == 4


# --- health and recovery -------------------------------------------------------------------------

def test_recovery_skips_a_failed_checkpoint(run, caplog):
    def poison(part, st):
        if part == "shard-0":
            st["model"]["0.bias"][0] = float("inf")

    commit_variant(str(run), ROUNDS + 1, poison)
    v = validate_run_checkpoint(str(run), ROUNDS + 1)
    assert v.failed == ("no_inf",)  # one cause, named once: norms and changes skip non-finite values
    ck = Checkpointer(str(run))
    with caplog.at_level(logging.WARNING, logger="ckptlib"):
        state = ck.restore(healthy=True)
    assert ck.latest_step() == ROUNDS + 1 and ck.latest_step(healthy=True) == ROUNDS
    assert state["coordinator"]["round"] == ROUNDS
    assert any(f"skipping checkpoint step {ROUNDS + 1}" in r.getMessage() and "no_inf" in r.getMessage()
               for r in caplog.records)
    # the next checkpoint is judged against the last healthy one, not the failed one
    commit_variant(str(run), ROUNDS + 2, src=ROUNDS)
    v2 = validate_run_checkpoint(str(run), ROUNDS + 2)
    assert v2.passed, v2.failures
    assert v2.summary["previous_healthy_step"] == ROUNDS
    index = (run / "reports" / "index.html").read_text()
    assert "failed" in index and f"{ROUNDS + 2}/index.html" in index


def test_single_part_checkpoints_get_the_generic_checks(tmp_path):
    url = str(tmp_path / "single")
    torch.manual_seed(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(url) as ck:
        for step in range(3):
            loss = model(torch.randn(8, DIM)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ck.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                    meta={"loss": float(loss.detach())})
        for step in range(3):
            v = validate_checkpoint(url, step)
            assert v.passed, v.failures
        bad = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}
        bad["model"]["2.bias"] = torch.tensor([1.0, float("nan"), 0.0, 0.0])
        ck.save(3, bad)
    v = validate_checkpoint(url, 3)
    assert v.failed == ("no_nan",) and _where(v, "no_nan") == ["part 'state', tensor 'model/2.bias' (nan_count=1)"]
    assert v.summary["single"] is True and v.summary["loss"] is None
    assert validate_checkpoint(url, 2).summary["loss"] is not None
    # the run's checks add nothing to a single-part checkpoint (their columns are null: not judged)
    assert validate_run_checkpoint(url, 2).passed


def test_views_of_a_storage_are_measured_and_the_storage_is_not(tmp_path):
    """Tensors sharing a storage are stored as one storage leaf: its bytes (a NaN in a gap no view
    covers, here) are not a tensor of the model and fail no check; each view is measured as the
    tensor it is, and a NaN inside one is found naming the view."""
    from ckptlib.validate.measure import measure

    url = str(tmp_path / "views")
    buffer = torch.zeros(64)
    buffer[30] = float("nan")  # in no view
    w = torch.nn.Parameter(torch.randn(6, 4))
    z = torch.randn(5, dtype=torch.complex64)

    def state(step: int) -> dict:
        with torch.no_grad():
            w.add_(0.01)
        return {"model": {"w": w, "w_rows": w.detach()[1:3], "conj": z.conj()},
                "buffers": {"head": buffer[:20], "tail": buffer[40:]}, "step": step}

    with Checkpointer(url) as ck:
        for step in range(2):
            ck.save(step, state(step))
        for step in range(2):
            v = validate_checkpoint(url, step)
            assert v.passed, v.failures
        with ThreadPool() as pool:
            rows = {r["tensor"]: r for r in measure(ck.store, 1, Thresholds(), pool, []).tensor_rows}
        assert rows["model/w#storage"]["role"] == "storage" and rows["model/w#storage"].get("nan_count") is None
        assert rows["buffers/head#storage"]["intact"] and rows["buffers/head#storage"].get("nan_count") is None
        assert rows["model/w_rows"]["role"] == "param" and rows["model/w_rows"]["shape"] == "2x4"
        assert rows["model/w_rows"]["rel_change"] is not None and rows["model/conj"]["nan_count"] == 0
        assert rows["buffers/tail"]["nan_count"] == 0 and rows["model/w"]["spec_ok"]
        buffer[45] = float("nan")  # inside /buffers/tail
        ck.save(2, state(2))
    v = validate_checkpoint(url, 2)
    assert v.failed == ("no_nan",) and _where(v, "no_nan") == ["part 'state', tensor 'buffers/tail' (nan_count=1)"]


# --- Prefect, CLI, S3 ----------------------------------------------------------------------------

def test_flow_and_task_publish_artifacts(clean_run, tmp_path, prefect_harness):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from flows.validate import validate_checkpoint_flow
    from tasks.validate import artifact_keys

    root = tmp_path / "run"
    shutil.copytree(clean_run[0], root)
    commit_variant(str(root), ROUNDS + 1, lambda part, st: part == "shard-1" and st["model"]["0.bias"].fill_(float("nan")))
    assert validate_checkpoint_flow(str(root), ROUNDS)["passed"]
    from tasks.validate import ValidationFailed

    with pytest.raises(ValidationFailed, match=rf"step {ROUNDS + 1} failed validation: no_nan") as failed:
        validate_checkpoint_flow(str(root), ROUNDS + 1)  # a failed verdict fails the flow run (and its task run)
    assert failed.value.verdict.failed == ("no_nan",)
    keys = artifact_keys(str(root))
    assert all(re.fullmatch(r"[a-z0-9-]+", k) for k in keys.values())
    with get_client(sync_client=True) as client:
        tables = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[keys["table"]])))
        mds = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[keys["markdown"]])))
    assert {a.type for a in tables} == {"table"} and {a.type for a in mds} == {"markdown"}
    latest_md = max(mds, key=lambda a: a.created).data
    assert "FAILED" in latest_md and "no_nan" in latest_md and "shard-1" in latest_md and "index.html" in latest_md
    latest_table = max(tables, key=lambda a: a.created).data
    table = json.loads(latest_table) if isinstance(latest_table, str) else latest_table
    assert table[0]["verdict"] == "FAILED" and table[0]["failed_expectations"] == "no_nan"
    assert table[0]["bytes_written"] > 0 and table[0]["report"].endswith(f"reports/{ROUNDS + 1}/index.html")
    # the event an automation can react to (written by the events worker: poll briefly)
    from tasks.validate import run_key

    events = []
    with get_client(sync_client=True) as client:
        for _ in range(40):
            resp = client._client.post("/events/filter", json={
                "filter": {"event": {"prefix": ["ckpt.validation."]},
                           "resource": {"id": [f"ckpt.run.{run_key(str(root))}"]}}, "limit": 50})
            events = [(e["event"], e["payload"]["step"]) for e in resp.json().get("events", [])]
            if len(events) >= 2:
                break
            time.sleep(0.25)
    assert sorted(events) == [("ckpt.validation.failed", ROUNDS + 1), ("ckpt.validation.passed", ROUNDS)]
    # deployable, with described parameters (the UI shows them when re-validating)
    props = validate_checkpoint_flow.parameters.model_dump()["properties"]
    assert all(props[p].get("description") for p in ("run_url", "step", "credentials_block", "thresholds"))
    assert validate_checkpoint_flow.name == "validate-checkpoint"
    dep = validate_checkpoint_flow.to_deployment(name="validate-checkpoint")
    assert dep.entrypoint == "flows/validate.py:validate_checkpoint_flow"


def test_cli_validate_and_report(run):
    from typer.testing import CliRunner

    from ckpt.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["validate", str(run), "--step", str(ROUNDS)])
    assert ok.exit_code == 0, ok.output
    assert "PASSED" in ok.output
    commit_variant(str(run), ROUNDS + 1, lambda part, st: part == "shard-0" and st["model"]["2.bias"].fill_(float("nan")))
    bad = runner.invoke(app, ["validate", str(run)])  # the latest step
    assert bad.exit_code == 1, bad.output
    assert "no_nan" in bad.output and "shard-0" in bad.output and "model/2.bias" in bad.output
    missing = runner.invoke(app, ["validate", str(run), "--step", "99"])
    assert missing.exit_code == 2 and "not committed" in missing.output
    rep = runner.invoke(app, ["report", str(run)])
    assert rep.exit_code == 0, rep.output
    assert "reports/index.html" in rep.output and "no_nan" in rep.output
    index = (run / "reports" / "index.html").read_text()
    assert f"{ROUNDS + 1}/index.html" in index


def test_report_lists_a_damaged_step_and_goes_on(run):
    """Two committed steps nobody validated, one whose manifest is not JSON, one whose fragment is
    garbage: `ckpt report` lists every step, the damaged ones as damaged with the reason (in its
    table and in reports/index.html), and the others as they are (before: one bad step broke it)."""
    from typer.testing import CliRunner

    from ckpt.cli import app

    commit_variant(str(run), ROUNDS + 1)
    commit_variant(str(run), ROUNDS + 2)
    (run / "manifests" / f"{ROUNDS + 1}.json").write_bytes(b"{truncated")
    (run / "fragments" / str(ROUNDS + 2) / "shard-1.g0.json").write_bytes(b"garbage")
    rep = CliRunner().invoke(app, ["report", str(run)])
    assert rep.exit_code == 0 and "Traceback" not in rep.output, rep.output
    rows = {}
    for line in rep.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 3 and cells[1].isdigit():
            rows[int(cells[1])] = cells
    assert sorted(rows) == list(range(ROUNDS + 3)), rep.stdout
    assert all(rows[s][2] == "passed" for s in range(ROUNDS + 1)), rep.stdout
    assert rows[ROUNDS + 1][2] == "damaged" and rows[ROUNDS + 2][2] == "damaged", rep.stdout
    assert f"damaged: step {ROUNDS + 1}: " in rep.stdout and "not a valid manifest" in rep.stdout
    assert f"damaged: step {ROUNDS + 2}: " in rep.stdout and "shard-1" in rep.stdout
    index = (run / "reports" / "index.html").read_text()
    assert "2 damaged" in index and "not a valid manifest" in index and "shard-1.g0.json" in index
    assert index.count("<td class='pass'>passed</td>") == ROUNDS + 1


def test_validation_on_s3(s3_url):
    url, opts = s3_url
    make_run(url, opts, rounds=1)
    store = Store.from_url(url, opts)
    for step in (0, 1):
        v = validate_run_checkpoint(url, step, storage_options=opts)
        assert v.passed, v.failures
    for name in ("index.html", "tensors.html", "run.png", "summary.json"):
        assert len(store.get(f"reports/1/{name}")) > 500
    assert store.exists("reports/index.html")
    assert Checkpointer(url, opts).healthy_steps() == [0, 1]
    frag = Checkpointer(url, opts).fragment(1, "shard-0")
    store.delete(frag.blobs[frag.leaves[0].segments()[0][0]].key)
    v = validate_run_checkpoint(url, 1, storage_options=opts)
    assert v.failed == ("checkpoint_integrity",)
    assert "missing" in _where(v, "checkpoint_integrity")[0]





def test_concurrent_validations_in_threads(run):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as ex:
        verdicts = list(ex.map(lambda s: validate_run_checkpoint(str(run), s), [1, 2, 3]))
    assert [v.passed for v in verdicts] == [True, True, True], [v.failures for v in verdicts]
    assert all((run / "reports" / str(s) / "tensors.html").stat().st_size > 1000 for s in (1, 2, 3))


def test_validation_writes_only_through_the_store(run, tmp_path, monkeypatch):
    """Issue #11 (4): every byte a validation writes goes through the Store API, under validations/
    and reports/ only: on a memory store, no file appears anywhere on disk (cwd, the run's copy)."""
    from ckptlib.store import WrapperStore

    class Recording(WrapperStore):
        writes: list[str] = []

        def _forward(self, op, key, *args):
            if op in ("put", "put_if_absent", "delete"):
                Recording.writes.append(key)
            return super()._forward(op, key, *args)

    source = Store.from_url(str(run))
    memory = Store.from_url(f"memory://validate-{os.getpid()}-{random.randrange(10**9)}")
    for key in source.list():
        memory.put(key, source.get(key))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    try:
        v = validate_run_checkpoint(Recording(memory), ROUNDS)
        assert v.passed, v.failures
        assert Recording.writes and all(k.startswith(("validations/", "reports/")) for k in Recording.writes)
        assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before and not any(cwd.iterdir())
    finally:
        for key in memory.list():
            memory.delete(key)
