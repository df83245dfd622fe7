"""Prefect task: validate one committed checkpoint (``ckptlib.validate``) and show the result.

``validate_step(run_url, step, storage_options=None, thresholds=None) -> dict`` (stable signature;
the training flow calls it after every commit, beside the next round):

* runs ``ckptlib.validate.validate_checkpoint``: verdict ``validations/<step>.json`` and report
  ``reports/<step>/`` beside the checkpoint (docs/validation.md);
* creates two artifacts keyed per run, so the Artifacts page shows their history:
  ``ckpt-validation-<run>`` (table: verdict, failed expectations, bytes, ratio, loss, report) and
  ``ckpt-validation-<run>-report`` (markdown: the same plus where each failure is);
* emits the Prefect event ``ckpt.validation.passed`` or ``ckpt.validation.failed`` (resource
  ``ckpt.run.<run>``; payload step, failed, report_url, bytes_written, ratio).

A corrupt checkpoint is a failed verdict, never an exception. A store that cannot be reached is
retried (3 attempts); if it stays unreachable the task returns a verdict with
``"failed": ["validation_error"]`` and ``"stored": false`` instead of failing the pipeline: the
checkpoint stays unvalidated, hence not healthy, until it is validated again (the
``validate-checkpoint`` flow). Only an uncommitted step or bad thresholds raise (caller errors).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time

from prefect import task
from prefect.logging import get_run_logger

ATTEMPTS = 3


def run_key(run_url: str) -> str:
    """The per-run part of artifact keys and event resources: lowercase letters, digits, dashes.

    The run's last path components (readable) and a hash of the whole URL (unique)."""
    tail = "-".join(run_url.rstrip("/").split("/")[-2:])
    slug = re.sub(r"[^a-z0-9]+", "-", tail.lower()).strip("-")[:40].strip("-") or "run"
    return f"{slug}-{hashlib.blake2b(run_url.rstrip('/').encode(), digest_size=4).hexdigest()}"


def artifact_keys(run_url: str) -> dict[str, str]:
    k = run_key(run_url)
    return {"table": f"ckpt-validation-{k}", "markdown": f"ckpt-validation-{k}-report"}


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def _markdown(v: dict) -> str:
    s = v.get("summary", {})
    rep = v.get("report", {})
    ok = v.get("passed")
    lines = [f"## Checkpoint step {v['step']}: {'PASSED' if ok else '**FAILED**'}", "",
             f"Run `{v.get('run')}`. {v.get('expectations', {}).get('successful', 0)}/"
             f"{v.get('expectations', {}).get('evaluated', 0)} expectations met in "
             f"{v.get('seconds', {}).get('total', 0)} s.", ""]
    if v.get("failures"):
        lines += ["### Failed expectations", "", "| expectation | count | where |", "|---|---|---|"]
        for f in v["failures"]:
            where = "<br>".join(str(w).replace("|", "\\|") for w in f.get("where", [])[:8])
            if len(f.get("where", [])) > 8:
                where += f"<br>... and {len(f['where']) - 8} more"
            lines.append(f"| `{f['expectation']}` | {f.get('count')} | {where} |")
        lines.append("")
    lines += ["| | |", "|---|---|",
              f"| bytes written | {_mib(s.get('bytes_written'))} |",
              f"| full size | {_mib(s.get('logical_bytes'))} |",
              f"| ratio (full / written) | {s.get('ratio', '-')} |",
              f"| kind | {s.get('kind', '-')} |",
              f"| parts | {', '.join(s.get('parts', []))} |",
              f"| loss | {s.get('loss', '-')} |",
              f"| max relative change | {s.get('max_rel_change', '-')} |",
              f"| previous healthy step | {s.get('previous_healthy_step', '-')} |", "",
              f"HTML report: `{rep.get('url', '-')}`", ""]
    if rep.get("url", "").startswith("file://"):
        lines.append("(a local file: open it on the machine that holds the run; `ckpt report` lists all reports)")
    return "\n".join(lines)


def _table(v: dict) -> list[dict]:
    s = v.get("summary", {})
    return [{"step": v["step"], "verdict": "passed" if v.get("passed") else "FAILED",
             "failed_expectations": ", ".join(v.get("failed", [])) or "-",
             "bytes_written": s.get("bytes_written"), "logical_bytes": s.get("logical_bytes"),
             "ratio": s.get("ratio"), "loss": s.get("loss"), "max_rel_change": s.get("max_rel_change"),
             "seconds": v.get("seconds", {}).get("total"), "report": v.get("report", {}).get("url")}]


def publish(run_url: str, verdict: dict, logger=None) -> None:
    """Artifacts and the event of one verdict; failures to publish are logged, never raised."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.events import emit_event

    keys = artifact_keys(run_url)
    desc = f"Validation of checkpoint step {verdict['step']} of {run_url}"
    try:
        create_table_artifact(_table(verdict), key=keys["table"], description=desc)
        create_markdown_artifact(_markdown(verdict), key=keys["markdown"], description=desc)
    except Exception as e:  # the verdict is stored; the UI view is secondary
        if logger:
            logger.warning("could not create the validation artifacts: %s", e)
    try:
        s = verdict.get("summary", {})
        emit_event(event=f"ckpt.validation.{'passed' if verdict.get('passed') else 'failed'}",
                   resource={"prefect.resource.id": f"ckpt.run.{run_key(run_url)}",
                             "prefect.resource.name": run_url, "ckpt.run-url": run_url,
                             "ckpt.step": str(verdict["step"])},
                   payload={"step": verdict["step"], "passed": bool(verdict.get("passed")),
                            "failed": verdict.get("failed", []), "report_url": verdict.get("report", {}).get("url"),
                            "bytes_written": s.get("bytes_written"), "ratio": s.get("ratio")})
    except Exception as e:
        if logger:
            logger.warning("could not emit the validation event: %s", e)


@task(name="validate-checkpoint-step", task_run_name="validate-step-{step}")
def validate_step(run_url: str, step: int, storage_options: dict | None = None,
                  thresholds: dict | None = None) -> dict:
    """Validate checkpoint ``step`` of the run at ``run_url``; store and return the verdict."""
    from ckptlib.errors import NoCheckpoint, StoreError
    from ckptlib.validate import Thresholds, format_verdict, validate_checkpoint

    try:
        logger = get_run_logger()
    except Exception:  # called as validate_step.fn(...) outside a run
        logger = logging.getLogger("tasks.validate")
    th = Thresholds.from_dict(thresholds)  # bad thresholds: the caller's error, raised
    verdict = None
    for attempt in range(1, ATTEMPTS + 1):
        try:
            verdict = validate_checkpoint(run_url, step, storage_options=storage_options, thresholds=th)
            break
        except NoCheckpoint:
            raise
        except StoreError as e:
            logger.warning("validation of step %d: store error (attempt %d/%d): %s", step, attempt, ATTEMPTS, e)
            if attempt == ATTEMPTS:
                verdict = {"format": 1, "step": step, "run": run_url, "passed": False,
                           "failed": ["validation_error"], "stored": False,
                           "failures": [{"expectation": "validation_error", "count": 1,
                                         "where": [f"{type(e).__name__}: {e}"],
                                         "what": "the store could not be read or written"}],
                           "problems": [], "summary": {}, "report": {}, "seconds": {}}
            else:
                time.sleep(min(2.0 * attempt, 10.0))
    assert verdict is not None
    text = format_verdict(verdict)
    (logger.info if verdict["passed"] else logger.warning)("%s", text)
    publish(run_url, verdict, logger)
    return verdict
