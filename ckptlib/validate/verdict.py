"""The verdict of a validation: ``validations/<step>.json`` (a ``Verdict``), and reading verdicts back.

A checkpoint is healthy when it is committed and its verdict says ``passed``. Format (``docs/validation.md``)::

    {"format": 1, "step": 4, "run": "file:///runs/r1", "passed": false, "failed": ["no_nan"],
     "failures": [{"expectation", "gx_type", "table", "column", "count", "where": [...], "what"}],
     "problems": [...], "integrity": [{step, part, tensor, chunk, key, reason}], "stored": true,
     "expectations": {"evaluated", "successful"}, "summary": {...}, "thresholds": {...},
     "report": {"html", "gx_tensors_html", "gx_parts_html", "summary", "plot", "url"},
     "validated_at": "...", "seconds": {...}}

``error_verdict`` is the one failed verdict built without measuring anything (the store stayed
unreachable, the validator crashed); it is never stored, so the checkpoint stays not healthy.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .. import commit
from ..documents import Document, DocumentError
from ..errors import ObjectNotFound
from ..store import Store
from .checks import VALIDATION_ERROR

log = logging.getLogger("ckptlib.validate")

VERDICT_FORMAT = 1
UNREADABLE = "unreadable_verdict"


@dataclass(frozen=True)
class Failure(Document):
    """One failed expectation: what it checks, how many rows failed, where (at most 50 entries)."""

    KIND = "failed expectation"

    expectation: str
    count: int | None
    where: tuple[str, ...] = ()
    what: str = ""
    gx_type: str | None = None
    table: str | None = None
    column: str | None = None


@dataclass(frozen=True)
class Verdict(Document):
    """The verdict of one checkpoint (format in the module docstring)."""

    KIND = "validation verdict"
    FORMAT = VERDICT_FORMAT
    MAX_BYTES = commit.VERDICT_MAX_BYTES

    step: int
    run: str
    passed: bool
    failed: tuple[str, ...] = ()
    failures: tuple[Failure, ...] = ()
    problems: tuple[str, ...] = ()
    integrity: tuple[dict[str, Any], ...] = ()
    stored: bool = True  # False: never written to the store (error_verdict)
    expectations: dict[str, int] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    validated_at: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    def failure(self, expectation: str) -> Failure | None:
        return next((f for f in self.failures if f.expectation == expectation), None)


def error_verdict(step: int, run: str, error: BaseException | str,
                  what: str = "the store could not be read or written") -> Verdict:
    """A failed verdict for a validation that could not run at all (not stored: not healthy)."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return Verdict(step=step, run=run, passed=False, failed=(VALIDATION_ERROR,), stored=False,
                   failures=(Failure(VALIDATION_ERROR, 1, (text,), what),),
                   validated_at=datetime.now(UTC).isoformat())


def read_verdict(store: Store, step: int) -> Verdict | None:
    """The verdict of ``step``; None when it was never validated. A verdict that does not parse
    reads as failed (``unreadable_verdict``): an unreadable verdict must not make a checkpoint healthy."""
    try:
        return Verdict.read(store, commit.validation_key(step))
    except ObjectNotFound:
        return None
    except DocumentError as e:
        log.warning("%s", e)
        return Verdict(step=step, run=store.url, passed=False, failed=(UNREADABLE,),
                       failures=(Failure(UNREADABLE, 1, (str(e),), "the verdict could not be read back"),))


def list_verdicts(store: Store) -> dict[int, Verdict]:
    """Every stored verdict of the run, by step."""
    out = {}
    for key in store.list("validations/"):
        m = re.match(r"^validations/(\d+)\.json$", key)
        if m:
            v = read_verdict(store, int(m.group(1)))
            if v is not None:
                out[int(m.group(1))] = v
    return out


def previous_healthy_step(store: Store, step: int) -> int | None:
    """The latest committed step below ``step`` whose validation passed."""
    for s in reversed([s for s in commit.committed_steps(store) if s < step]):
        v = read_verdict(store, s)
        if v is not None and v.passed:
            return s
    return None


def format_verdict(verdict: Verdict) -> str:
    """A few lines for a terminal or a log: the verdict and, when failed, what and where."""
    s = verdict.summary
    head = (f"step {verdict.step}: {'PASSED' if verdict.passed else 'FAILED'} "
            f"({verdict.expectations.get('successful', 0)}/{verdict.expectations.get('evaluated', 0)} expectations; "
            f"{s.get('tensors', 0)} tensors in {len(s.get('parts', []))} parts; "
            f"{verdict.seconds.get('total', 0):.2f} s)")
    lines = [head]
    for f in verdict.failures:
        lines.append(f"  FAILED {f.expectation}: {f.what} [{f.count}]")
        for w in f.where[:10]:
            lines.append(f"    - {w}")
        if len(f.where) > 10:
            lines.append(f"    ... and {len(f.where) - 10} more")
    if verdict.report.get("url"):
        lines.append(f"  report: {verdict.report['url']}")
    return "\n".join(lines)
