"""Operating runs, without the stack: start from a chosen checkpoint (resume from a step, branch
another run), a flow retry that resumes, what a refusal says, and reports whose pages work offline
and whose index plot agrees with its table. Real Prefect (the session's test server), real
training (a tiny tinylm), a local store. About 1.5 minutes on 2 cores.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

from ckptlib import Checkpointer
from ckptlib.commit import part_keys, read_manifest
from ckptlib.store import Store

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

EXTRA = {"d_model": 32, "n_layers": 1, "ctx": 16, "corpus_bytes": 65536}
TINY = {"workload": "tinylm", "workload_extra": EXTRA, "shards": 2, "rounds": 3, "steps_per_round": 4, "seed": 0,
        "heartbeat_every_s": 0.2, "retry_delay_s": 0.2, "validation_runner": "threads"}


def params(**kw):
    from flows.params import TrainParams

    return TrainParams(**{**TINY, **kw})


def digests(url: str) -> dict[int, str]:
    with Checkpointer(url) as ck:
        return {s: ck.manifest(s).digest for s in ck.steps()}


@pytest.fixture(scope="module")
def source(prefect_harness, tmp_path_factory):
    """A clean run of 3 rounds: the reference digests."""
    from flows.train import train_run

    store = str(tmp_path_factory.mktemp("operate"))
    summary = train_run(params(store=store, run_id="src"))
    return {"store": store, "url": summary["run_url"], "digests": digests(summary["run_url"])}


def test_a_branch_starts_from_a_step_of_another_run_and_reaches_the_same_digests(source):
    from typer.testing import CliRunner

    from ckpt.cli import app
    from flows.params import StartFrom
    from flows.train import train_run

    s = train_run(params(store=source["store"], run_id="br", start_from=StartFrom(run_id="src", step=1)))
    assert s["start_step"] == 1 and s["committed"] == [2, 3] and s["validated"] == [2, 3]
    got = digests(s["run_url"])
    src = Store.from_url(source["url"]).url  # as the store names itself (file:///...)
    assert sorted(got) == [1, 2, 3] and all(got[k] == source["digests"][k] for k in got)  # determinism, branched
    with Checkpointer(s["run_url"]) as ck:
        assert ck.manifest(1).lineage == {"run": src, "step": 1}  # the branch point
        assert all(ck.manifest(k).meta["lineage"] == {"run": src, "step": 1} for k in (2, 3))
        assert ck.healthy_steps() == [1, 2, 3]  # the verdict came with the state
    # the objects are the source's, linked (content addressing): the branch point cost no bytes
    # (the branch point's own objects: the branch's later rounds write objects of their own, shard
    # checkpoints among them, which the source may have collected already)
    branch_store, source_store = Store.from_url(s["run_url"]), Store.from_url(source["url"])
    first = read_manifest(branch_store, 1)
    needed = set().union(*(part_keys(branch_store, first, name) for name in first.parts))
    chunks = sorted(k for k in needed if k.startswith("chunks/"))
    assert chunks and all(source_store.exists(k) for k in chunks)
    for step in (1, 3):  # the branch point's own lineage, and a later step's (its meta): before, step 3 said "-"
        shown = CliRunner().invoke(app, ["show", s["run_url"], "--step", str(step)])
        assert shown.exit_code == 0 and f"lineage: branched from step 1 of {src}" in shown.output, shown.output
    listed = CliRunner().invoke(app, ["ls", s["run_url"]], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and "from" in listed.output and "src@1" in listed.output, listed.output
    assert s["lineage"] == {"run": src, "step": 1}  # the summary (and its artifact) say where it came from
    index = (Store.from_url(s["run_url"]).get("reports/index.html")).decode()
    assert "Branched from step 1 of run" in index and src in index
    # branching again into it (a retry of the same flow run) changes nothing; into a run with others, refused
    again = train_run(params(store=source["store"], run_id="br", start_from=StartFrom(run_id="src", step=1)))
    assert again["committed"] == [2, 3] and digests(s["run_url"]) == got


def test_resume_from_a_chosen_step_of_the_same_run(source):
    from flows.params import StartFrom
    from flows.train import train_run

    s = train_run(params(store=source["store"], run_id="src", start_from=StartFrom(run_id="src", step=1)))
    assert s["start_step"] == 1 and s["note"] == "starting from committed step 1"
    assert digests(source["url"]) == source["digests"]  # recomputed identically


def test_a_resume_validates_the_committed_steps_nobody_validated_before_it_decides(source, tmp_path):
    """A run killed after its commits but before their validations ended (here: trained without
    validation) resumes from its newest committed step, validated by the resume itself, not from
    scratch (before: "no validated checkpoint yet: starting from scratch", every round trained again)."""
    from flows.train import train_run

    store = str(tmp_path)
    first = train_run(params(store=store, run_id="nv", rounds=2, validate_checkpoints=False))
    assert first["validated"] == [] and first["committed"] == [0, 1, 2]
    again = train_run(params(store=store, run_id="nv", rounds=3, resume=True))
    assert again["start_step"] == 2 and again["committed"] == [3], again["note"]
    assert "validated now: step 2; step 2 passed" in again["note"], again["note"]
    assert digests(again["run_url"]) == source["digests"]
    with Checkpointer(again["run_url"]) as ck:
        assert ck.healthy_steps() == [2, 3]


def test_form_descriptions_render_in_the_ui():
    """The UI renders a description as HTML: ``<store>/<run_id>`` became "/." there. No field of a
    deployed flow's form may hold an angle bracket."""
    import json

    from flows.gc import gc_store
    from flows.train import train_run
    from flows.validate import validate_checkpoint_flow
    from flows.watchdog import watchdog

    for f in (train_run, watchdog, validate_checkpoint_flow, gc_store):
        schema = f.parameters.model_dump()
        texts = re.findall(r'"description": "((?:[^"\\]|\\.)*)"', json.dumps(schema))
        assert texts, f.name
        assert not [t for t in texts if "<" in t], (f.name, [t for t in texts if "<" in t])


def test_refusals_name_the_cause_and_both_fixes(source, tmp_path):
    from flows.params import StartFrom
    from flows.train import train_run
    from trainrun.errors import RunRefused

    with pytest.raises(RunRefused, match=r"Continue it with resume \(`ckpt train --resume`, or resume: true in the "
                                         r"form\)"):
        train_run(params(store=source["store"], run_id="src"))
    with pytest.raises(RunRefused, match="these settings differ.*seed: 0 -> 1"):
        train_run(params(store=source["store"], run_id="src", seed=1, resume=True))
    with pytest.raises(RunRefused, match="no committed step 7 to start from"):
        train_run(params(store=source["store"], run_id="src", start_from=StartFrom(run_id="src", step=7)))
    with pytest.raises(ValueError, match="no committed step 9.*choose one of its committed steps"):
        train_run(params(store=source["store"], run_id="b2", start_from=StartFrom(run_id="src", step=9)))


def test_a_flow_retry_resumes_instead_of_refusing(source, tmp_path):
    """What Retry in the UI does to a failed run: the same flow run runs again (run_count 2). Here a
    Prefect flow retry after a shard crash with no task retries left: it resumes and completes with
    the clean digests (the drill strikes once per run)."""
    from flows.train import train_run

    flow = train_run.with_options(retries=1, retry_delay_seconds=0)
    s = flow(params(store=str(tmp_path), run_id="rt", shard_retries=0, chaos=["crash:shard=0,round=2"]))
    assert s["resumed"] and s["start_step"] >= 0
    assert digests(s["run_url"]) == source["digests"]


def test_reports_work_offline_and_the_index_plot_agrees_with_its_table(source):
    """Every page of the reports: no CDN, every relative link to an object that exists. After step 2
    is validated again and fails, the index's table and its plot (drawn with it) both say so."""
    from ckptlib.validate import validate_checkpoint

    store = Store.from_url(source["url"])
    for key in [k for k in store.list("reports") if k.endswith(".html")]:
        page = store.get(key).decode()
        assert not re.findall(r"""(?:src|href)=["']https?://""", page), f"{key} fetches from elsewhere"
        base = key.rsplit("/", 1)[0]
        for target in re.findall(r"""(?:src|href)=["']([^"'#]+)["']""", page):
            parts = []
            for p in f"{base}/{target}".split("/"):
                if p == "..":
                    parts.pop()
                elif p and p != ".":
                    parts.append(p)
            assert store.exists("/".join(parts)), f"{key} links {target}, which does not exist"
    assert _red(store.get("reports/run.png")) == 0
    v = validate_checkpoint(source["url"], 2, thresholds={"max_norm": 1e-9})
    assert not v.passed
    index = store.get("reports/index.html").decode()
    assert "<td>2</td><td class='fail'>failed</td>" in index and "<td>3</td><td class='pass'>passed</td>" in index
    assert _red(store.get("reports/run.png")) > 0
    validate_checkpoint(source["url"], 2)  # healthy again, for the tests after this one
    assert _red(store.get("reports/run.png")) == 0


def _red(png: bytes) -> int:
    from matplotlib.image import imread

    img = (imread(io.BytesIO(png), format="png")[..., :3] * 255).round().astype(int)
    return int((np.abs(img - np.array([0xC6, 0x28, 0x28])).sum(axis=-1) < 30).sum())


def test_the_thresholds_form_has_ckptlib_defaults():
    from ckptlib.validate import Thresholds
    from flows.params import ValidationThresholds

    assert ValidationThresholds().to_dict() == Thresholds().to_dict()


class _Flaky:
    """A loopback proxy in front of the real Prefect server that answers the first ``fail`` requests to
    ``path`` with what Prefect itself sends for a retryable error (a busy database: 503), or ``status``;
    ``seen`` counts those requests (Prefect's client also asks others, e.g. for a CSRF token)."""

    def __init__(self, upstream: str, fail: int, status: int = 503, retry_after: str | None = None,
                 path: str = "/deployments/filter"):
        import threading
        import urllib.parse
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        import httpx

        origin = urllib.parse.urlsplit(upstream)
        self.seen = 0
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                flaky.seen += self.path.endswith(path)
                if self.path.endswith(path) and flaky.seen <= fail:
                    status_, data, headers = status, b'{"exception_message":"Service Unavailable"}', {}
                    if retry_after is not None:
                        headers["Retry-After"] = retry_after
                else:
                    r = httpx.request(self.command, f"{origin.scheme}://{origin.netloc}{self.path}", content=body,
                                      headers={"Content-Type": "application/json"})
                    status_, data, headers = r.status_code, r.content, {}
                self.send_response(status_)
                for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_DELETE = _any

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}{origin.path}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_the_api_client_retries_what_prefect_says_to_retry(prefect_harness):
    """Prefect's server answers 503 for errors a client may retry (a busy database; in CI it failed
    `deployments.deploy` once) and 429 when it sheds load. PrefectAPI (Prefect's own client) retries
    both, PREFECT_CLIENT_MAX_RETRIES times, as long as the server's Retry-After says, and reports a
    server that keeps answering so after its retries, naming the status. The real server, behind a
    proxy that injects the first answers."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from deployments.client import PrefectAPI

    upstream = PREFECT_API_URL.value()
    with PrefectAPI(upstream) as api:
        expected = sorted(d["id"] for d in api.deployments())
    for status in (503, 429):
        proxy = _Flaky(upstream, fail=2, status=status, retry_after="0")
        try:
            with PrefectAPI(proxy.url) as api:
                assert sorted(d["id"] for d in api.deployments()) == expected
            assert proxy.seen == 3
        finally:
            proxy.close()
    proxy = _Flaky(upstream, fail=100, retry_after="0")
    try:
        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 2}), PrefectAPI(proxy.url) as api, \
                pytest.raises(RuntimeError, match=r"/deployments/filter -> 503 \(after 2 retries\)"):
            api.deployments()
        assert proxy.seen == 3
    finally:
        proxy.close()


def test_the_api_clients_credentials_are_in_no_error_or_repr(prefect_harness):
    """A refusal (401) is one RuntimeError naming what to set, and neither it, its traceback nor the
    client's repr holds the credentials, in clear or as the basic-auth token: Prefect's own error
    carries its request, whose headers hold them, so the refusal keeps no reference to it."""
    import base64
    import traceback

    from prefect.settings import PREFECT_API_URL

    from deployments.client import PrefectAPI

    auth = "ckpt:do-not-show-this-password"
    secrets = ("do-not-show-this-password", base64.b64encode(auth.encode()).decode())
    proxy = _Flaky(PREFECT_API_URL.value(), fail=100, status=401, path="/deployments/name/gc-store/gc")
    try:
        with PrefectAPI(proxy.url, auth=auth) as api:
            with pytest.raises(RuntimeError) as refused:
                api.run_deployment("gc-store/gc")
            shown = "".join(traceback.format_exception(refused.value)) + repr(api) + repr(refused.value)
    finally:
        proxy.close()
    assert "-> 401" in shown and "set PREFECT_API_AUTH_STRING" in shown, shown
    assert not any(s in shown for s in secrets), shown
    assert refused.value.__context__ is None and refused.value.__cause__ is None  # nothing that holds the request
