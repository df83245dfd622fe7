"""The Prefect UI in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright)
against a local stack (Prefect server + SeaweedFS + process worker, as ``make stack`` starts it).

What a user does, click by click: open the UI (3.9 serves the V2 UI at ``/v2``), log in (the stack's
API takes no call without its credentials, so the UI shows its login form: a wrong password is
refused, the stack's ``PREFECT_API_AUTH_STRING`` lets the user in), go to Deployments,
open ``train``, Run > Custom run, check the typed form (descriptions, the store defaulting to the
stack's bucket), set a small run, submit, follow "View run", wait until the run page says
Completed, open its Artifacts tab, find the validation artifact and open it (verdict "passed").
Every SPA path answers 200 with the same index.html, so every check is on rendered text.

Screenshots of each step go to ``test-output/ui/`` (``failure.png`` and the page text when a step
fails). Needs ``/usr/bin/chromium`` (``.ci/run`` installs it: ``apt-get install -y chromium``; when it
is missing and this runs as root with apt-get, the test installs it, unless ``CKPT_NO_APT=1``; it
skips, saying why, only when it cannot) and the ``playwright`` package (test extras); never
``playwright install`` (no downloads here).
About 1.5 minutes on 2 cores. Marks: slow, prefect, s3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from deployments.client import PrefectAPI
from deployments.stack import Stack, free_port

pytestmark = [pytest.mark.slow, pytest.mark.prefect, pytest.mark.s3]

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "test-output" / "ui"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]
RUN_TIMEOUT_MS = 300_000


_install_tried: list[str] = []


def _install_chromium() -> str:
    """Try Debian's package once (root + apt-get only; CKPT_NO_APT=1 forbids it); return why not."""
    if _install_tried:
        return _install_tried[0]
    why = ""
    if os.environ.get("CKPT_NO_APT"):
        why = "CKPT_NO_APT is set"
    elif not shutil.which("apt-get") or os.geteuid() != 0:
        why = "not root with apt-get here"
    else:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            try:
                res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                why = f"{' '.join(cmd)}: {e}"
                break
            if res.returncode != 0:
                why = f"{' '.join(cmd)} failed: {(res.stderr or res.stdout).strip()[-300:]}"
                break
    _install_tried.append(why)
    return why


def _need_browser():
    global CHROMIUM
    if not os.path.exists(CHROMIUM):
        why = _install_chromium()
        CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
        if not os.path.exists(CHROMIUM):
            pytest.skip(f"Chromium is not installed (/usr/bin/chromium) and could not be installed ({why}): "
                        "`apt-get update && apt-get install -y chromium` (.ci/run does this); Playwright's own "
                        "browser download is never used")
    return pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def ui_stack(tmp_path_factory):
    _need_browser()
    stack = Stack(tmp_path_factory.mktemp("ui-stack"))
    try:
        info = stack.up(api_port=free_port(), s3_port=0, filer_port=0, reports_port=0, poll_seconds=1.0, timeout=150)
        env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "CKPT_STORE", "CKPT_WORK_POOL")}
        res = subprocess.run([sys.executable, "-m", "deployments.deploy", "--stack-dir", str(stack.dir),
                              "--schedules-inactive", "--only", "train,watchdog", "--watchdog-timeout", "8",
                              "--watchdog-poll", "1"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        yield info
    finally:
        left = stack.down(grace=3.0, quiet=True)
        assert not left, f"processes of the UI test's stack still alive: {left}"


@pytest.fixture
def page(ui_stack, tmp_path):
    sync_api = _need_browser()
    OUT.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        # A fresh profile each time (launch_persistent_context's user_data_dir = --user-data-dir).
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000})
        ctx.set_default_timeout(30_000)
        sync_api.expect.set_options(timeout=30_000)  # a loaded 2-core machine renders slowly
        pg = ctx.pages[0] if ctx.pages else ctx.new_page()
        try:
            yield pg
        except BaseException:
            raise
        finally:
            ctx.close()


def shot(page, name: str, full_page: bool = True) -> Path:
    path = OUT / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


@pytest.mark.slow  # about 60 s on CI: a browser drives the UI through a whole run on the stack's worker
def test_start_a_training_run_from_the_ui_and_find_its_validation(ui_stack, page):
    sync_api = _need_browser()
    expect = sync_api.expect
    run_id = f"ui-{uuid.uuid4().hex[:8]}"
    run_name = f"ui-test-{run_id}"
    try:
        # 1. The UI's front door redirects to the V2 app, which asks for a login; once in, Deployments
        # lists the training deployment.
        page.goto(ui_stack["ui_url"] + "/")
        page.wait_for_url(re.compile(r".*/v2/.*"))
        _log_in(page, ui_stack, expect, wrong_first=True)
        page.get_by_role("link", name="Deployments", exact=True).first.click()
        train_link = page.get_by_role("link", name="train", exact=True)
        expect(train_link).to_be_visible()
        expect(page.get_by_text("train-run", exact=True).first).to_be_visible()
        shot(page, "01-deployments")

        # 2. The deployment page: flow, pool; Run > Custom run opens the typed form.
        train_link.click()
        expect(page.get_by_text("local-pool").first).to_be_visible()
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Custom run").click()
        store = page.get_by_label("Store (Optional)", exact=True)
        expect(store).to_have_value(ui_stack["store"])  # the stack's bucket is the default
        expect(page.get_by_text("Where runs live:").first).to_be_visible()  # field descriptions render
        # ... whole: a placeholder in angle brackets was taken for an HTML tag ("checkpoints are at /.")
        expect(page.get_by_text("checkpoints are at store/run_id, e.g.").first).to_be_visible()
        expect(page.get_by_text("(heartbeats/shard-N.json for shard N)").first).to_be_visible()
        expect(page.get_by_label("Rounds (Optional)", exact=True)).to_have_value("8")
        # typed sub-forms, filled in: the validation thresholds (no free dict), start from a checkpoint
        expect(page.get_by_label("Max Rel Change (Optional)", exact=True)).to_have_value("10")
        expect(page.get_by_text("Start from a chosen committed checkpoint").first).to_be_visible()
        expect(page.get_by_text("Storage Options", exact=True)).to_have_count(0)  # secrets go in a Secret block
        page.get_by_label("Run Name", exact=True).fill(run_name)
        page.get_by_label("Shards (Optional)", exact=True).fill("1")
        page.get_by_label("Steps Per Round (Optional)", exact=True).fill("2")
        page.get_by_label("Rounds (Optional)", exact=True).fill("1")
        run_id_field = page.locator("xpath=//label[normalize-space()='Run Id (Optional)']"
                                    "/ancestor::div[contains(concat(' ', @class, ' '), ' group ')][1]")
        run_id_field.get_by_role("tab", name="str", exact=True).click()  # the str | None field: choose str
        run_id_field.locator("fieldset input, fieldset textarea").first.fill(run_id)
        shot(page, "02-run-form")
        page.get_by_label("Max Rel Change (Optional)", exact=True).scroll_into_view_if_needed()
        shot(page, "02-run-form-thresholds", full_page=False)
        _submit(page, sync_api)

        # 3. The toast links to the new run; its page shows the run until it is Completed.
        expect(page.get_by_text(f"{run_name} scheduled to start now")).to_be_visible()
        page.get_by_role("link", name="View run").first.click()
        page.wait_for_url(re.compile(r".*/runs/flow-run/[0-9a-f-]{36}.*"))
        flow_run_id = re.search(r"/flow-run/([0-9a-f-]{36})", page.url).group(1)
        # train-run names its runs train-<run id> once it starts; before that the name given in the form
        shown_name = re.compile(rf"^({re.escape(run_name)}|train-{re.escape(run_id)})$")
        expect(page.get_by_text(shown_name).first).to_be_visible()
        # Wait for the run through the API on a blank page: a running run's page redraws its graph (a
        # WebGL canvas, drawn in software here) all the time, which cost 12 CPU-seconds of a loaded
        # 2-core machine per run; then its page again, as a user comes back to it.
        run_url = page.url
        page.goto("about:blank")
        with _api(ui_stack) as api:
            fr = api.wait(flow_run_id, timeout=RUN_TIMEOUT_MS / 1000)
        if fr["state_type"] != "COMPLETED":
            log = (Path(ui_stack["logs"]) / "worker.log").read_text(errors="replace")[-4000:]
            pytest.fail(f"the run ended {fr['state_type']}: {fr['state']['message']}\n{log}")
        page.goto(run_url)
        expect(page.get_by_text("Completed", exact=True).first).to_be_visible()
        page.wait_for_load_state("networkidle")
        shot(page, "03-run-completed")
        # Its task runs (the graph is a canvas: read the Task Runs tab): shards, cut, validations.
        page.get_by_role("tab", name="Task Runs").click()
        for name in ("shard-0-round-1", "validate-step-0", "validate-step-1"):
            expect(page.get_by_text(name, exact=True).first).to_be_visible(timeout=30_000)

        # 4. Artifacts tab: the validation verdict of each checkpoint, keyed per run.
        page.get_by_role("tab", name="Artifacts").click()
        cards = page.get_by_role("link").filter(has_text="ckpt-validation-").filter(has_text="TABLE")
        expect(cards.first).to_be_visible()
        expect(page.get_by_text(re.compile(r"Validation of checkpoint step 1 of s3://checkpoints/runs/" + run_id))
               .first).to_be_visible()
        shot(page, "04-run-artifacts")

        # The report is one click away: the "-link" artifact (a markdown artifact holding one link:
        # Prefect's create_link_artifact) opens the HTML report over the stack's report server.
        link = page.get_by_role("link").filter(has_text="-link").filter(has_text="LINK").first
        expect(link).to_be_visible()

        # 5. The validation artifact itself: a table whose verdict is "passed".
        cards.filter(has_text="step 1").first.click()
        page.wait_for_url(re.compile(r".*/artifacts/artifact/.*"))
        expect(page.get_by_text("verdict", exact=True).first).to_be_visible()
        expect(page.get_by_role("cell", name="passed", exact=True).first).to_be_visible()
        expect(page.get_by_text(shown_name).first).to_be_visible()  # linked to our flow run
        expect(page.get_by_text("validate-step-1", exact=True).first).to_be_visible()  # ... and its task run
        shot(page, "05-validation-artifact")

        # 6. Its HTML report, as a browser gets it from the stack (no network: nothing from a CDN).
        report = f"{ui_stack['s3_http_base']}/checkpoints/runs/{run_id}/reports/1/index.html"
        outside: list[str] = []
        page.on("request", lambda r: outside.append(r.url) if not r.url.startswith(
            ("http://127.0.0.1", "data:", "about:")) else None)
        page.goto(report)
        expect(page.get_by_text("Checkpoint step 1: PASSED")).to_be_visible()
        shot(page, "06-report")
        page.get_by_role("link", name="Great Expectations Data Docs: tensors suite").click()
        expect(page.get_by_text("Expectation Validation Result").first).to_be_visible()
        shot(page, "07-data-docs", full_page=False)
        page.get_by_role("link", name="Home").first.click()  # back to the step's report, not a 404
        expect(page.get_by_text("Checkpoint step 1: PASSED")).to_be_visible()
        page.goto(report.replace("1/index.html", "index.html"))
        expect(page.get_by_text("Checkpoints of").first).to_be_visible()
        shot(page, "08-report-index")
        assert not outside, f"the reports fetched from elsewhere: {outside}"
    except BaseException:
        OUT.mkdir(parents=True, exist_ok=True)
        try:
            shot(page, "failure")
            (OUT / "failure.txt").write_text(page.url + "\n\n" + page.inner_text("body"))
        except Exception:  # noqa: BLE001 - a page too broken to shoot: the original error matters
            pass
        raise

    # The same run through the API: the UI did start it, on the stack's pool, and it wrote to S3.
    with _api(ui_stack) as api:
        fr = api.flow_run(flow_run_id)
        assert shown_name.match(fr["name"]) and fr["state_type"] == "COMPLETED"
        assert fr["parameters"]["params"]["run_id"] == run_id and fr["parameters"]["params"]["rounds"] == 1
        keys = {a["key"] for a in api.artifacts(flow_run_id)}
        assert any(k and k.startswith("ckpt-validation-") for k in keys), keys
    (OUT / "run.json").write_text(json.dumps({"flow_run_id": flow_run_id, "run_id": run_id}, indent=2))


def test_a_fenced_shard_shows_on_the_training_run(ui_stack, page):
    """A run whose shard hangs (started through the API): on its page, the hung shard's task run is
    Fenced (not a green Completed), says by whom and which rerun took over, and its artifact links
    the watchdog's flow run."""
    sync_api = _need_browser()
    expect = sync_api.expect
    run_id = f"ui-hang-{uuid.uuid4().hex[:8]}"
    with _api(ui_stack) as api:
        fr = api.run_deployment("train-run/train", {"params": {"shards": 1, "rounds": 1, "steps_per_round": 2,
                                                               "run_id": run_id, "chaos": ["hang:shard=0,round=1"],
                                                               "validation_runner": "threads"}})
        fr = api.wait(fr["id"], timeout=RUN_TIMEOUT_MS / 1000)
        assert fr["state_type"] == "COMPLETED", fr["state"]
    try:
        page.goto(f"{ui_stack['ui_url']}/v2/runs/flow-run/{fr['id']}")
        _log_in(page, ui_stack, expect)  # then the UI goes on to the page asked for
        page.wait_for_url(re.compile(rf".*/runs/flow-run/{fr['id']}.*"))
        expect(page.get_by_text("Completed", exact=True).first).to_be_visible()
        page.wait_for_load_state("networkidle")
        shot(page, "09-fenced-run-graph")
        page.get_by_role("tab", name="Task Runs").click()
        expect(page.get_by_text("Fenced", exact=True).first).to_be_visible()
        shot(page, "10-fenced-task-runs")
        page.get_by_role("link", name="shard-0-round-1", exact=True).first.click()
        page.wait_for_url(re.compile(r".*/runs/task-run/.*"))
        expect(page.get_by_text(re.compile("fenced by watchdog@")).first).to_be_visible()
        page.get_by_role("tab", name="Artifacts").click()
        # the tab shows each artifact as a card with its description; the card opens the markdown
        page.get_by_text(re.compile(r"round 1 fenced and rerun")).first.click()
        expect(page.get_by_text("Fenced by the watchdog").first).to_be_visible()
        shot(page, "11-fenced-task-run")
    except BaseException:
        shot(page, "failure")
        (OUT / "failure.txt").write_text(page.url + "\n\n" + page.inner_text("body"))
        raise


def _api(ui_stack: dict) -> PrefectAPI:
    return PrefectAPI(ui_stack["api_url"], auth=ui_stack["env"]["PREFECT_API_AUTH_STRING"])


def _log_in(page, ui_stack, expect, wrong_first: bool = False) -> None:
    """Log in through the UI's login form (Prefect's, shown because the server has an auth string):
    ``wrong_first`` tries a wrong password first, which the form refuses."""
    password = page.get_by_placeholder("admin:pass")
    expect(password).to_be_visible()
    shot(page, "00-login")
    if wrong_first:
        password.fill("ckpt:wrong")
        page.get_by_role("button", name="Login", exact=True).click()
        expect(page.get_by_text("Invalid credentials")).to_be_visible()
    password.fill(ui_stack["env"]["PREFECT_API_AUTH_STRING"])
    page.get_by_role("button", name="Login", exact=True).click()
    expect(password).to_have_count(0)


def _submit(page, sync_api) -> None:
    """Click the run form's Submit until the UI leaves the form. On a loaded machine the first click
    sometimes lands while the form re-renders after the last field's blur and does nothing (the page
    stays on the form, no toast, no error); a click that did submit navigates away, so it is never
    repeated."""
    form_url = page.url
    for attempt in range(3):
        page.wait_for_load_state("networkidle")
        page.get_by_role("button", name="Submit", exact=True).click()
        try:
            sync_api.expect(page).not_to_have_url(form_url, timeout=20_000)
            return
        except AssertionError:
            if attempt == 2:
                raise
