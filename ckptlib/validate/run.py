"""``validate_checkpoint``: measure a committed checkpoint, let GX judge it, write the report and the verdict.

Guarantees
----------
* Corruption never raises: a flipped bit, a truncated or missing object, an unreadable manifest,
  NaNs, a wrong shape all give a verdict with ``passed: false`` naming the expectation and where
  (part, tensor, chunk, object key). A bug in a check is reported as the failed expectation
  ``validation_error`` rather than raised. ``NoCheckpoint`` (the step is not committed) and
  ``StoreError`` other than a missing object (the store is unreachable: retry) do raise.
* Everything is written through the ``Store``, and only under ``validations/`` and ``reports/``:
  nothing under ``manifests/``, ``fragments/`` or ``chunks/``, no local file.
* The verdict is written last: it is what makes a checkpoint healthy (``Checkpointer.healthy_steps``).
* Re-validating a step overwrites its verdict and report (same inputs, same verdict).
* Several validations may run at once (threads or processes); ``gx`` serialises the GX calls of a
  process; ``reports/index.html`` is last-writer-wins.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from .. import commit
from ..errors import NoCheckpoint, StoreError
from ..store import Store
from .checks import VALIDATION_ERROR, Check, PartChecks, all_checks
from .gx import run_gx
from .measure import Measurement, measure
from .report import report_links, write_run_index, write_step_report
from .stats import clean, manifest_loss
from .thresholds import Thresholds
from .verdict import Failure, Verdict

log = logging.getLogger("ckptlib.validate")

MAX_WHERE = 50  # per failed expectation, in the verdict (the count is always complete)


def validate_checkpoint(url: str | Store, step: int | None = None, *, storage_options: dict | None = None,
                        thresholds: Mapping[str, Any] | Thresholds | None = None, report: bool = True,
                        threads: int | None = None, extensions: Sequence[PartChecks] = ()) -> Verdict:
    """Validate committed checkpoint ``step`` (None = the latest committed) of the run at ``url``.

    Writes ``validations/<step>.json`` (and with ``report`` the report under ``reports/<step>/``)
    and returns the verdict. ``extensions`` add checks of a layout ckptlib does not know
    (``checks.PartChecks``). Raises NoCheckpoint when the step is not committed, StoreError when
    the store cannot be reached; never raises for corruption.
    """
    t_start = time.perf_counter()
    store = url if isinstance(url, Store) else Store.from_url(url, storage_options)
    th = Thresholds.from_dict(thresholds)
    if step is None:
        steps = commit.committed_steps(store)
        if not steps:
            raise NoCheckpoint(f"no committed checkpoint in {store.url}")
        step = steps[-1]
    commit.check_step(step)
    if not store.exists(commit.manifest_key(step)):
        raise NoCheckpoint(f"step {step} is not committed in {store.url} (no {commit.manifest_key(step)})")
    checks = all_checks(extensions)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads or 8, thread_name_prefix="ckpt-validate") as pool:
        m = measure(store, step, th, pool, extensions)
    seconds["read_and_measure"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    tables = m.tables()
    ref = dict(m.ref_values)
    # a value no row holds, for a column that is all null (e.g. a single-part save): nothing to compare
    for k, v in ref.items():
        if v is None:
            ref[k] = "" if k == "config_hash" else -1
    try:
        gx_results = run_gx(tables, checks, th, ref, f"step-{step}")
    except Exception as e:
        log.exception("Great Expectations failed on step %d of %s", step, store.url)
        m.errors.append(f"Great Expectations: {type(e).__name__}: {e}")
        gx_results = {}
    seconds["gx"] = round(time.perf_counter() - t0, 3)
    verdict = _verdict(store, m, tables, gx_results, checks, th, seconds)
    if report:
        t0 = time.perf_counter()
        history = None
        try:
            history = write_step_report(store, verdict, tables, gx_results)
        except StoreError:
            raise
        except Exception as e:  # a broken report must not hide the verdict
            log.exception("writing the report of step %d of %s failed", step, store.url)
            verdict = dataclasses.replace(verdict, report={"error": f"{type(e).__name__}: {e}"})
        seconds["report"] = round(time.perf_counter() - t0, 3)
    seconds["total"] = round(time.perf_counter() - t_start, 3)
    verdict = dataclasses.replace(verdict, seconds=dict(seconds))
    store.put(commit.validation_key(step), verdict.to_json())
    if report and "error" not in verdict.report:
        try:
            write_run_index(store, history)
        except StoreError:
            raise
        except Exception:
            log.exception("refreshing reports/index.html of %s failed", store.url)
    log.log(logging.INFO if verdict.passed else logging.WARNING, "validation of step %d of %s: %s%s (%.2f s)",
            step, store.url, "PASSED" if verdict.passed else "FAILED",
            "" if verdict.passed else " (" + ", ".join(verdict.failed) + ")", seconds["total"])
    return verdict


def _failures(m: Measurement, gx_results: Mapping[str, Any], checks: Sequence[Check]) -> list[Failure]:
    out = []
    problem_text = [str(p) for p in m.problems]
    what = {c.name: c.what for c in checks}
    for table, res in gx_results.items():
        for r in res.results:
            if r.success:
                continue
            cfg = r.expectation_config
            name = (cfg.meta or {}).get("name", cfg.type)
            res_d = r.result or {}
            col = cfg.kwargs.get("column")
            where = []
            for row in res_d.get("unexpected_index_list") or []:
                if not isinstance(row, dict):
                    continue
                label = f"part '{row.get('part')}'"
                if "tensor" in row:
                    label += f", tensor '{row.get('tensor')}'"
                if col in row:
                    val = clean(row[col])
                    if isinstance(val, float) and val.is_integer():
                        val = int(val)  # an int column with nulls became float in pandas
                    label += f" ({col}={val})"
                where.append(label)
            if name == "checkpoint_integrity" and problem_text:
                where = problem_text
            if r.exception_info and r.exception_info.get("raised_exception"):
                where.append(f"expectation raised: {r.exception_info.get('exception_message')}")
            count = res_d.get("unexpected_count", len(where))
            out.append(Failure(expectation=name, count=int(count) if count is not None else None,
                               where=tuple(where[:MAX_WHERE]), what=what.get(name, ""), gx_type=cfg.type,
                               table=table, column=col))
    if m.errors:
        out.append(Failure(VALIDATION_ERROR, len(m.errors), tuple(m.errors), "a check could not run"))
    order = {c.name: i for i, c in enumerate(checks)}
    order[VALIDATION_ERROR] = len(order)
    out.sort(key=lambda f: order.get(f.expectation, len(order) + 1))
    return out


def _summary(store: Store, m: Measurement, tables: Mapping[str, Any]) -> dict[str, Any]:
    man = m.manifest
    t = tables["tensors"]

    def agg(col: str, fn: Any) -> Any:
        s = t[col].dropna() if col in t else []
        return clean(fn(s)) if len(s) else None

    loss, eval_loss = manifest_loss(store, man) if man is not None else (None, None)
    out = {
        "single": man.single if man else None,
        "kind": man.kind if man else None,
        "parent": man.parent if man else None,
        "created": man.created if man else None,
        "digest": man.digest if man else None,
        "parts": sorted(man.parts) if man else [],
        "tensors": int(len(t)),
        "logical_bytes": man.logical_bytes if man else None,
        "bytes_written": man.bytes_written if man else None,
        "stored_bytes": man.stored_bytes if man else None,
        "ratio": round(man.logical_bytes / max(man.bytes_written, 1), 2) if man else None,
        "loss": clean(loss) if loss is not None else None,
        "eval_loss": clean(eval_loss) if eval_loss is not None else None,
        "previous_healthy_step": m.reference.step if m.reference else None,
        "nan_count": agg("nan_count", lambda s: int(s.sum())),
        "inf_count": agg("inf_count", lambda s: int(s.sum())),
        "max_abs_value": agg("param_abs_max", max),
        "max_norm": agg("param_norm", max),
        "max_rel_change": agg("rel_change", max),
        "min_second_moment": agg("second_moment_min", min),
        "integrity_problems": len(m.problems),
    }
    return {**out, **{k: clean(v) for k, v in m.summary.items()}}


def _verdict(store: Store, m: Measurement, tables: Mapping[str, Any], gx_results: Mapping[str, Any],
             checks: Sequence[Check], th: Thresholds, seconds: dict[str, float]) -> Verdict:
    failures = _failures(m, gx_results, checks)
    stats = {"evaluated": 0, "successful": 0}
    for res in gx_results.values():
        stats["evaluated"] += int(res.statistics["evaluated_expectations"])
        stats["successful"] += int(res.statistics["successful_expectations"])
    failed = [f.expectation for f in failures]
    passed = bool(gx_results) and not failures and not m.problems
    if not passed and not failed and m.problems:  # integrity problems never slip through
        failed = ["checkpoint_integrity"]
    return Verdict(step=m.step, run=store.url, passed=passed, failed=tuple(failed), failures=tuple(failures),
                   problems=tuple(str(p) for p in m.problems),
                   integrity=tuple(dataclasses.asdict(p) for p in m.problems), expectations=stats,
                   summary=_summary(store, m, tables), thresholds=th.to_dict(), report=report_links(store, m.step),
                   validated_at=datetime.now(UTC).isoformat(), seconds=dict(seconds))
