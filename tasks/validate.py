"""Prefect task ``validate-checkpoint-step``: validate one committed checkpoint and show the verdict.

``validate_step(run_url, step, access=None, thresholds=None) -> Verdict`` runs
``trainrun.checks.validate_run_checkpoint`` (``ckptlib.validate`` with the run's checks: verdict
``validations/<step>.json``, report ``reports/<step>/``), then publishes two artifacts keyed per run
(``ckpt-validation-<run>``: a table; ``ckpt-validation-<run>-report``: markdown with where each
failure is) and the event ``ckpt.validation.passed`` / ``failed`` (resource ``ckpt.run.<run>``).

A checkpoint that fails validation (a corrupt one included) ends the task run **Failed**: its state's
message names the step, the failed checks and the report, and its data is a ``ValidationFailed``
carrying the verdict (what ``future.result()`` raises, in this process or from the validation
worker process); the verdict is stored either way. A store that cannot be reached is retried by
Prefect (``transient_store_error``); if it stays unreachable the task fails, and the training flow
records ``ckptlib.validate.error_verdict`` for the step (not stored: not healthy until validated
again, e.g. by the ``validate-checkpoint`` flow). An uncommitted step or bad thresholds fail at once
(caller errors).

The event's payload is typed (``step`` an int) and carries the report's HTTP address where the
store has one (``report_http``, ``tasks/links.py``) beside its store URL (``report_url``).
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptlib.errors import CheckpointError
from ckptlib.validate import Thresholds, Verdict, format_verdict
from trainrun.checks import validate_run_checkpoint
from trainrun.credentials import StoreAccess

from .access import storage_options
from .links import http_url, md_link
from .retry import transient_store_error


class ValidationFailed(CheckpointError, RuntimeError):
    """A checkpoint failed its validation: ``verdict`` says which checks and where (not retried)."""

    def __init__(self, verdict: Verdict):
        self.verdict = verdict
        report = http_url(verdict.report.get("url")) or verdict.report.get("url") or "-"
        super().__init__(f"step {verdict.step} failed validation: {', '.join(verdict.failed) or 'no verdict'} "
                         f"(report: {report})")

    def __reduce__(self) -> tuple[Any, ...]:  # travels from the validation worker process as the state's data
        return (ValidationFailed, (self.verdict,))


def run_key(run_url: str) -> str:
    """The per-run part of artifact keys and event resources: lowercase letters, digits, dashes.

    The run's last path components (readable) and a hash of the whole URL (unique)."""
    tail = "-".join(run_url.rstrip("/").split("/")[-2:])
    slug = re.sub(r"[^a-z0-9]+", "-", tail.lower()).strip("-")[:40].strip("-") or "run"
    return f"{slug}-{hashlib.blake2b(run_url.rstrip('/').encode(), digest_size=4).hexdigest()}"


def artifact_keys(run_url: str) -> dict[str, str]:
    k = run_key(run_url)
    return {"table": f"ckpt-validation-{k}", "markdown": f"ckpt-validation-{k}-report",
            "link": f"ckpt-validation-{k}-link"}


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def _markdown(v: Verdict) -> str:
    s, rep = v.summary, v.report
    lines = [f"## Checkpoint step {v.step}: {'PASSED' if v.passed else '**FAILED**'}", "",
             f"Run `{v.run}`. {v.expectations.get('successful', 0)}/{v.expectations.get('evaluated', 0)} "
             f"expectations met in {v.seconds.get('total', 0)} s.", ""]
    if v.failures:
        lines += ["### Failed expectations", "", "| expectation | count | where |", "|---|---|---|"]
        for f in v.failures:
            where = "<br>".join(str(w).replace("|", "\\|") for w in f.where[:8])
            if len(f.where) > 8:
                where += f"<br>... and {len(f.where) - 8} more"
            lines.append(f"| `{f.expectation}` | {f.count} | {where} |")
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
              f"* {md_link('HTML report of this checkpoint', rep.get('url'))}",
              f"* {md_link('every checkpoint of the run', _index_url(rep.get('url')))}", ""]
    if not http_url(rep.get("url")):
        lines.append("(no HTTP address for this store: open the report where the store is, or run `ckpt report`; "
                     "the local stack serves its bucket over HTTP)")
    return "\n".join(lines)


def _index_url(report_url: str | None) -> str | None:
    """``.../reports/<step>/index.html`` -> ``.../reports/index.html``."""
    if not report_url or "/reports/" not in report_url:
        return None
    return report_url.rsplit("/reports/", 1)[0] + "/reports/index.html"


def _table(v: Verdict) -> list[dict]:
    s = v.summary
    return [{"step": v.step, "verdict": "passed" if v.passed else "FAILED",
             "failed_expectations": ", ".join(v.failed) or "-",
             "bytes_written": s.get("bytes_written"), "logical_bytes": s.get("logical_bytes"),
             "ratio": s.get("ratio"), "loss": s.get("loss"), "max_rel_change": s.get("max_rel_change"),
             "seconds": v.seconds.get("total"), "report": http_url(v.report.get("url")) or v.report.get("url")}]


def publish(run_url: str, verdict: Verdict, logger: Any) -> None:
    """Artifacts and the event of one verdict; failures to publish are logged, never raised."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
    from prefect.events import emit_event

    keys = artifact_keys(run_url)
    desc = f"Validation of checkpoint step {verdict.step} of {run_url}"
    try:
        create_table_artifact(_table(verdict), key=keys["table"], description=desc)
        create_markdown_artifact(_markdown(verdict), key=keys["markdown"], description=desc)
        link = http_url(verdict.report.get("url"))
        if link:  # a link artifact: the Artifacts page opens the report in one click
            create_link_artifact(link, link_text=f"Report of step {verdict.step}: "
                                 f"{'passed' if verdict.passed else 'FAILED'}", key=keys["link"], description=desc)
    except Exception as e:  # noqa: BLE001 - the verdict is stored; the UI view is secondary
        logger.warning("could not create the validation artifacts: %s", e)
    try:
        s = verdict.summary
        emit_event(event=f"ckpt.validation.{'passed' if verdict.passed else 'failed'}",
                   resource={"prefect.resource.id": f"ckpt.run.{run_key(run_url)}",
                             "prefect.resource.name": run_url, "ckpt.run-url": run_url,
                             "ckpt.step": str(verdict.step)},
                   payload={"step": int(verdict.step), "passed": verdict.passed, "failed": list(verdict.failed),
                            "report_url": verdict.report.get("url"),
                            "report_http": http_url(verdict.report.get("url")),
                            "bytes_written": s.get("bytes_written"), "ratio": s.get("ratio")})
    except Exception as e:  # noqa: BLE001 - publishing is secondary: the verdict is stored
        logger.warning("could not emit the validation event: %s", e)


@task(name="validate-checkpoint-step", task_run_name="validate-step-{step}", retries=2, retry_delay_seconds=2,
      retry_condition_fn=transient_store_error, cache_policy=NO_CACHE)
def validate_step(run_url: str, step: int, access: StoreAccess | None = None,
                  thresholds: dict[str, Any] | None = None) -> Any:
    """Validate checkpoint ``step`` of the run at ``run_url``; store and publish the verdict. Returns
    it when it passed, else a Failed state whose data is ``ValidationFailed(verdict)`` (see the
    module docstring); outside a flow (``validate_step.fn``) it raises that instead."""
    from prefect import get_run_logger
    from prefect.states import Failed

    try:
        logger: Any = get_run_logger()
        in_run = True
    except Exception:  # noqa: BLE001 - called as validate_step.fn(...) outside a run
        logger, in_run = logging.getLogger("tasks.validate"), False
    verdict = validate_run_checkpoint(run_url, step, storage_options=storage_options(access),
                                      thresholds=Thresholds.from_dict(thresholds))
    (logger.info if verdict.passed else logger.warning)("%s", format_verdict(verdict))
    publish(run_url, verdict, logger)
    if verdict.passed:
        return verdict
    failure = ValidationFailed(verdict)
    if not in_run:
        raise failure
    return Failed(message=str(failure), data=failure)
