"""A real browser for the tests of the Prefect UI (tests/test_stack.py): headless Chromium (Debian's
``chromium``, driven by Playwright; never ``playwright install``, no downloads), with the steps every
UI test takes: log in with the stack's credentials, submit a form, a screenshot of each step.

Screenshots go to ``test-output/ui/``. Needs ``/usr/bin/chromium`` (``.ci/run`` installs it:
``apt-get install -y chromium``; when it is missing and the tests run as root with apt-get, it is
installed once, unless ``CKPT_NO_APT=1``; a test skips, saying why, only when it cannot) and the
``playwright`` package (test extras)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

OUT = Path(__file__).resolve().parent.parent / "test-output" / "ui"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"]
TIMEOUT_MS = 30_000  # a loaded 2-core machine renders slowly

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


def need_browser():
    global CHROMIUM
    if not os.path.exists(CHROMIUM):
        why = _install_chromium()
        CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
        if not os.path.exists(CHROMIUM):
            pytest.skip(f"Chromium is not installed (/usr/bin/chromium) and could not be installed ({why}): "
                        "`apt-get update && apt-get install -y chromium` (.ci/run does this); Playwright's own "
                        "browser download is never used")
    return pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[test]'")


@contextmanager
def open_page(profile: Path) -> Iterator:
    """A page of a fresh Chromium with its own profile folder (``--user-data-dir``); closed after."""
    sync_api = need_browser()
    OUT.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                    args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1000})
        ctx.set_default_timeout(TIMEOUT_MS)
        sync_api.expect.set_options(timeout=TIMEOUT_MS)
        try:
            yield ctx.pages[0] if ctx.pages else ctx.new_page()
        finally:
            ctx.close()


def shot(page, name: str, full_page: bool = True) -> Path:
    path = OUT / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


def record_failure(page) -> None:
    """A screenshot and the page's text, for a UI test that failed (nothing when the page is too broken)."""
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        shot(page, "failure")
        (OUT / "failure.txt").write_text(page.url + "\n\n" + page.inner_text("body"))
    except Exception:  # noqa: BLE001 - a page too broken to shoot: the test's own error matters
        pass


def log_in(page, stack: dict, expect, wrong_first: bool = False) -> None:
    """Log in through the UI's login form (Prefect's, shown because the server has an auth string):
    ``wrong_first`` tries a wrong password first, which the form refuses."""
    password = page.get_by_placeholder("admin:pass")
    expect(password).to_be_visible()
    shot(page, "00-login")
    if wrong_first:
        password.fill("ckpt:wrong")
        page.get_by_role("button", name="Login", exact=True).click()
        expect(page.get_by_text("Invalid credentials")).to_be_visible()
    password.fill(stack["env"]["PREFECT_API_AUTH_STRING"])
    page.get_by_role("button", name="Login", exact=True).click()
    expect(password).to_have_count(0)


def submit(page, sync_api) -> None:
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
