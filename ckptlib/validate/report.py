"""Validation reports people review, written through the Store (local or S3) beside the checkpoint.

    reports/<step>/index.html     overview: verdict, failed expectations and where, numbers, plot, links
    reports/<step>/tensors.html   Great Expectations Data Docs page of the tensor suite (made to work
                                  offline: no CDN, its Home link is this step's index.html)
    reports/<step>/parts.html     Great Expectations Data Docs page of the parts (shards) suite
    reports/<step>/summary.json   the verdict plus the history the plot shows
    reports/<step>/tensors.csv    the per-tensor statistics GX judged
    reports/<step>/parts.csv      the per-part statistics GX judged
    reports/<step>/run.png        the run so far: bytes written per checkpoint against full size,
                                  loss, validation verdicts (1200 x 800 px)
    reports/index.html            every checkpoint with its verdict, linking each report
    reports/run.png               the same plot, drawn with the index from the same rows: what the
                                  index's table says of a step, its plot says too (a step validated
                                  again after a later one is redrawn in both)

Every page works without the network (no CDN: styles inline, no remote script) and every link
points at an object written here (relative links: the pages work wherever the bucket is served,
e.g. the local stack's SeaweedFS filer over HTTP). A branch's pages name its lineage (the run and
step it started from).
Called by ``validate_checkpoint`` (step reports and the index after each validation) and by
``ckpt report`` (the index). Only ``reports/`` keys are written, all through the ``Store`` (never a
local file: the PNG is drawn into memory). matplotlib is driven through its object API (Figure +
Agg canvas, no pyplot state), so reports may be drawn from several threads.
"""

from __future__ import annotations

import html
import io
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from .. import commit
from ..errors import CheckpointError
from ..store import Store
from .gx import render_gx_html
from .stats import manifest_loss
from .verdict import Verdict, list_verdicts

log = logging.getLogger("ckptlib.report")

PLOT_SIZE_PX = (1200, 800)
_DPI = 100


def _esc(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def _mib(n: Any) -> str:
    return "" if n is None else f"{n / 2**20:.2f} MiB"


def report_prefix(step: int) -> str:
    return f"reports/{step}/"


def report_links(store: Store, step: int) -> dict[str, str]:
    """Where the report of ``step`` is (the verdict's ``report``)."""
    key = report_prefix(step)
    return {"html": key + "index.html", "gx_tensors_html": key + "tensors.html", "gx_parts_html": key + "parts.html",
            "summary": key + "summary.json", "plot": key + "run.png", "url": f"{store.url}/{key}index.html"}


# --- history of a run ------------------------------------------------------------------------------

def run_lineage(store: Store) -> dict | None:
    """``{"run", "step"}`` when the run is a branch of another (its first checkpoint's lineage)."""
    steps = commit.committed_steps(store)
    if not steps:
        return None
    try:
        return commit.read_manifest(store, steps[0]).lineage
    except CheckpointError:
        return None


def _lineage_html(lineage: dict | None) -> str:
    if not lineage:
        return ""
    return (f"<p class='lineage'>Branched from step {_esc(lineage.get('step'))} of run "
            f"<code>{_esc(lineage.get('run'))}</code>: its first checkpoint is that step's state.</p>")


def run_history(store: Store, *, override: Verdict | None = None) -> list[dict]:
    """One row per committed step: bytes, loss and verdict. Verdicts carry the numbers; a step
    without one costs one manifest read, and one whose manifest cannot be read has ``damaged``:
    the reason (one line), and the other rows go on. ``override`` is a fresh verdict not yet stored."""
    verdicts = list_verdicts(store)
    if override is not None:
        verdicts[override.step] = override
    rows = []
    for step in commit.committed_steps(store):
        v = verdicts.get(step)
        s = v.summary if v is not None else {}
        row = {"step": step, "passed": None if v is None else v.passed,
               "failed": list(v.failed) if v is not None else [],
               "bytes_written": s.get("bytes_written"), "logical_bytes": s.get("logical_bytes"),
               "loss": s.get("loss"), "eval_loss": s.get("eval_loss"), "kind": s.get("kind"),
               "report": v.report.get("html") if v is not None else None, "damaged": None}
        if row["logical_bytes"] is None:
            try:
                m = commit.read_manifest(store, step)
                loss, ev = manifest_loss(store, m, strict=True)  # (its skeletons are checked too)
                row.update(bytes_written=m.bytes_written, logical_bytes=m.logical_bytes, loss=loss,
                           eval_loss=ev, kind=m.kind)
            except CheckpointError as e:
                log.warning("step %d of %s: manifest unreadable for the report (%s)", step, store.url, e)
                row["damaged"] = " ".join(str(getattr(e, "reason", e)).split())[:500]
        rows.append(row)
    return rows


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


def plot_run(history: list[dict], *, title: str = "", highlight: int | None = None) -> bytes:
    """PNG (``PLOT_SIZE_PX``) of a run: bytes written per checkpoint against its full size (top),
    loss (middle), each checkpoint's validation verdict (bottom strip: green passed, red failed,
    grey not validated). ``highlight`` marks the step the report is about."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(PLOT_SIZE_PX[0] / _DPI, PLOT_SIZE_PX[1] / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 0.7]})
    steps = [r["step"] for r in history]
    peak = max([_num(r.get("logical_bytes")) or 0 for r in history] + [_num(r.get("bytes_written")) or 0 for r in history] + [1])
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20) if peak >= 2**20 else ("KiB", 2**10)
    nan = float("nan")
    written = [(_num(r.get("bytes_written")) or 0) / scale for r in history]
    full = [(_num(r.get("logical_bytes")) or nan) / scale for r in history]
    colors = ["#2e7d32" if r["passed"] else "#c62828" if r["passed"] is False else "#9e9e9e" for r in history]
    width = 0.8 * (min((b - a for a, b in zip(steps, steps[1:], strict=False)), default=1) or 1)
    ax1.bar(steps, written, width=width, color="#42a5f5", label="bytes written")
    ax1.plot(steps, full, "k--", marker=".", label="full size (logical bytes)")
    ax1.set_ylabel(unit)
    ax1.set_ylim(bottom=0)
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title(title or "checkpoints of the run", fontsize=10)
    ax1.grid(alpha=0.3)
    loss = [_num(r.get("loss")) for r in history]
    ev = [_num(r.get("eval_loss")) for r in history]
    if any(v is not None for v in loss):
        ax2.plot(steps, [nan if v is None else v for v in loss], "-o", color="#1565c0", ms=3, label="loss")
    if any(v is not None for v in ev):
        ax2.plot(steps, [nan if v is None else v for v in ev], "-s", color="#ef6c00", ms=3, label="eval loss")
    ax2.set_ylabel("loss")
    ax2.grid(alpha=0.3)
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(loc="upper right", fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no loss recorded", transform=ax2.transAxes, ha="center", color="#757575")
    ax3.scatter(steps, [0] * len(steps), c=colors, s=60, marker="s")
    for s_, r in zip(steps, history, strict=True):
        if r["passed"] is False and len(history) <= 40:
            ax3.annotate("failed", (s_, 0), textcoords="offset points", xytext=(0, -14), ha="center",
                         color="#c62828", fontsize=7)
    ax3.set_yticks([])
    ax3.set_ylim(-1, 1)
    ax3.set_ylabel("verdict", rotation=0, ha="right", va="center")
    ax3.set_xlabel("checkpoint step (green: passed, red: failed, grey: not validated)")
    ax3.xaxis.set_major_locator(MaxNLocator(integer=True))
    if highlight is not None and highlight in steps:
        for ax in (ax1, ax2, ax3):
            ax.axvline(highlight, color="#6a1b9a", alpha=0.4, lw=1)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


# --- per-step report -----------------------------------------------------------------------------

# --- Great Expectations' Data Docs pages, made to work offline ------------------------------------------

# What GX's pages take from CDNs (Bootstrap, jQuery, Font Awesome, Vega) replaced by the little they use.
_GX_CSS = """body{font-family:system-ui,sans-serif;margin:0;color:#222;font-size:14px}
.container-fluid{padding:1.5em 2em}.row{display:flex;flex-wrap:wrap}.col-12{flex:0 0 100%}
[class*=col-md-2]{flex:0 0 16%;max-width:16%}[class*=col-md-10]{flex:0 0 82%;max-width:82%;padding-left:1em}
.sticky,.sticky-top{position:sticky;top:0}.navbar{display:flex;align-items:center;padding:.5em 2em;
border-bottom:1px solid #ddd;background:#fafafa}.breadcrumb{display:flex;list-style:none;margin:0 0 0 1em;padding:0}
.breadcrumb-item+.breadcrumb-item:before{content:"/";padding:0 .5em;color:#888}.d-none{display:initial}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;
vertical-align:top}.card{border:1px solid #ddd;border-radius:4px;margin:.8em 0}.card-header{background:#f5f5f5;
padding:.5em 1em;border-bottom:1px solid #ddd}.card-body{padding:.5em 1em}.alert{padding:.4em .8em;
border-radius:4px;margin:.3em 0}.alert-secondary{background:#f1f1f1}.text-success{color:#2e7d32}
.text-danger{color:#c62828}.nav{list-style:none;padding:0}.nav-link{display:block;padding:2px 0}
.btn{display:inline-block;border:1px solid #1565c0;color:#1565c0;background:#fff;border-radius:4px;
padding:2px 8px;margin:2px 0;cursor:pointer}.ge-logo{font-weight:bold;color:#ff6310;text-decoration:none}
.fas:before{font-style:normal}.fa-check-circle:before{content:"\\2714"}.fa-times:before,
.fa-times-circle:before{content:"\\2716"}.fa-exclamation-triangle:before{content:"\\26A0"}
.fa-info-circle:before{content:"\\2139"}"""

# Stand-ins for the page's own jQuery handlers (show all / hide succeeded validations).
_GX_JS = """function _geShow(show){document.querySelectorAll('.hide-succeeded-validation-target-child,'
+'.hide-succeeded-validations-column-section-target-child').forEach(function(e){var p=e.closest('.ge-section')||
e.parentElement;if(e.closest('.table')){p=e.closest('tr')||p}p.style.display=show?'':'none'})}
function showAllValidations(){_geShow(true)}function hideSucceededValidations(){_geShow(false)}"""


def offline_gx_page(page: str, table: str) -> str:
    """GX's Data Docs page ``page`` (of ``table``) with nothing fetched from elsewhere and no dead link:
    remote stylesheets and scripts go (a small inline stylesheet and two plain-JS handlers replace
    them), the remote logo becomes text, Home points at this step's ``index.html``, the suite page
    (which GX's ephemeral context never writes) at this page, and outside links lose their target."""
    page = re.sub(r"<link\b[^>]*>", "", page)  # remote stylesheets, the favicon of a site that does not exist
    page = re.sub(r"<script\b[^>]*>.*?</script>", "", page, flags=re.S)  # jQuery, Bootstrap, Vega, their calls
    page = re.sub(r"<img\b[^>]*src=\"https?://[^\"]*\"[^>]*/?>", "<span class='ge-logo'>Great Expectations</span>",
                  page, flags=re.S)
    page = re.sub(r'href="(?:\.\./)+index\.html"', 'href="index.html"', page)
    page = re.sub(r'href="(?:\.\./)+expectations/[^"]*"', f'href="{table}.html"', page)
    page = re.sub(r'\shref="https?://[^"]*"', "", page)
    return page.replace("</head>", f"<style>{_GX_CSS}</style><script>{_GX_JS}</script></head>", 1)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;
font-size:14px}th{background:#f5f5f5}.pass{color:#2e7d32;font-weight:bold}.fail{color:#c62828;font-weight:bold}
code{background:#f5f5f5;padding:1px 3px}img{max-width:100%}"""


# summary entries shown first in a step's report (the rest, e.g. an extension's, follow)
_NUMBERS = ("kind", "parent", "parts", "tensors", "logical_bytes", "bytes_written", "stored_bytes", "ratio", "loss",
            "eval_loss", "previous_healthy_step", "nan_count", "inf_count", "max_abs_value", "max_norm",
            "max_rel_change", "min_second_moment")
_NOT_SHOWN = ("single", "created", "digest", "integrity_problems")


def _verdict_html(v: Verdict, links: Mapping[str, str], lineage: dict | None = None) -> str:
    s = v.summary
    ok = v.passed
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>Checkpoint {v.step}: "
           f"{'PASSED' if ok else 'FAILED'}</title><style>{_CSS}</style></head><body>",
           f"<h1>Checkpoint step {v.step}: <span class='{'pass' if ok else 'fail'}'>"
           f"{'PASSED' if ok else 'FAILED'}</span></h1>",
           f"<p>Run <code>{_esc(v.run)}</code>, validated {_esc(v.validated_at)}; the checks took "
           f"{sum(x for k, x in v.seconds.items() if k not in ('report', 'total')):.2f} s. "
           f"{_esc(v.expectations.get('successful'))}/{_esc(v.expectations.get('evaluated'))} "
           "expectations met.</p>", _lineage_html(lineage)]
    if v.failures:
        out.append("<h2>Failed expectations</h2><table><tr><th>expectation</th><th>what it checks</th>"
                   "<th>count</th><th>where</th></tr>")
        for f in v.failures:
            where = "<br>".join(_esc(w) for w in f.where[:30])
            if len(f.where) > 30:
                where += f"<br>... and {len(f.where) - 30} more"
            out.append(f"<tr><td class='fail'>{_esc(f.expectation)}</td><td>{_esc(f.what)}</td>"
                       f"<td>{_esc(f.count)}</td><td>{where}</td></tr>")
        out.append("</table>")
    out.append("<h2>Numbers</h2><table>")
    keys = list(_NUMBERS) + [k for k in s if k not in _NUMBERS and k not in _NOT_SHOWN] + ["digest"]
    for k in keys:
        val = s.get(k)
        if k.endswith("_bytes") and val is not None:
            val = f"{val} ({_mib(val)})"
        out.append(f"<tr><th>{_esc(k)}</th><td>{_esc(val)}</td></tr>")
    out.append("</table><h2>Run so far, as of this validation</h2><img src='run.png' alt='run plot'>"
               "<p>Verdicts of later validations: <a href='../index.html'>all checkpoints of the run</a>.</p>")
    out.append("<h2>Details</h2><ul>" + "".join(f"<li><a href='{_esc(href)}'>{_esc(text)}</a></li>"
                                                 for text, href in links.items()) + "</ul>")
    out.append(f"<h2>Thresholds</h2><pre>{_esc(json.dumps(v.thresholds, indent=1))}</pre>")
    out.append("</body></html>")
    return "\n".join(out)


def write_step_report(store: Store, verdict: Verdict, tables: Mapping[str, Any],
                      gx_results: Mapping[str, Any]) -> list[dict]:
    """Write ``reports/<step>/...`` for a verdict (not yet stored: it is the history's newest word on
    its step); returns the run history it drew. Raises StoreError when the store cannot be written."""
    step = verdict.step
    pre = report_prefix(step)
    links: dict[str, str] = {}
    for table, res in gx_results.items():
        key = f"{pre}{table}.html"
        store.put(key, offline_gx_page(render_gx_html(res), table).encode())
        links[f"Great Expectations Data Docs: {table} suite"] = f"{table}.html"
    for table, df in tables.items():
        key = f"{pre}{table}.csv"
        store.put(key, df.to_csv(index=False).encode())
        links[f"{table} statistics (CSV)"] = f"{table}.csv"
    history = run_history(store, override=verdict)
    store.put(f"{pre}run.png", plot_run(history, title=f"{store.url} (step {step})", highlight=step))
    links["summary (JSON)"] = "summary.json"
    links["all checkpoints of the run"] = "../index.html"
    summary = verdict.to_dict()
    summary["history"] = history
    store.put(f"{pre}summary.json", json.dumps(summary, indent=1, default=str).encode())
    store.put(f"{pre}index.html", _verdict_html(verdict, links, run_lineage(store)).encode())
    return history


# --- the run's index -----------------------------------------------------------------------------

def index_rows(store: Store, history: list[dict] | None = None) -> list[dict]:
    """Every committed checkpoint with its verdict and report location (for ``ckpt report``)."""
    rows = [dict(r) for r in (run_history(store) if history is None else history)]
    for r in rows:
        r["verdict"] = ("damaged" if r.get("damaged") else "passed" if r["passed"] else
                        "failed" if r["passed"] is False else "not validated")
        r["ratio"] = (round(r["logical_bytes"] / max(r["bytes_written"], 1), 2)
                      if r.get("logical_bytes") is not None and r.get("bytes_written") is not None else None)
        r["report_url"] = f"{store.url}/{r['report']}" if r.get("report") else None
    return rows


def damaged_note(rows: list[dict]) -> str:
    """", 1 damaged (step 3: ckpt quarantine moves it aside)" when some row is damaged, else ""."""
    bad = [r["step"] for r in rows if r.get("damaged")]
    if not bad:
        return ""
    return f", {len(bad)} damaged (step {', '.join(map(str, bad))}: `ckpt quarantine` moves a step aside)"


def write_run_index(store: Store, history: list[dict] | None = None) -> str:
    """Write (refresh) ``reports/index.html``: one row per checkpoint linking its report, and
    ``reports/run.png``, the plot of the very same rows (the table and the plot always agree).
    ``history``: from ``run_history`` when the caller has it. Returns the key."""
    rows = index_rows(store, history)
    store.put("reports/run.png", plot_run(rows, title=f"{store.url}: every checkpoint"))
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>Checkpoints of {_esc(store.url)}</title>"
           f"<style>{_CSS}</style></head><body><h1>Checkpoints of <code>{_esc(store.url)}</code></h1>",
           _lineage_html(run_lineage(store)),
           f"<p>{len(rows)} committed, {sum(1 for r in rows if r['passed'])} healthy (committed and passed), "
           f"{sum(1 for r in rows if r['passed'] is False)} failed, "
           f"{sum(1 for r in rows if r['passed'] is None)} not validated"
           f"{damaged_note(rows)}.</p>",
           "<table><tr><th>step</th><th>verdict</th><th>failed expectations</th><th>kind</th>"
           "<th>bytes written</th><th>full size</th><th>ratio</th><th>loss</th><th>report</th></tr>"]
    for r in rows:
        cls = "pass" if r["passed"] and not r.get("damaged") else "fail" if r["passed"] is False or r.get("damaged") else ""
        link = f"<a href='{r['step']}/index.html'>report</a>" if r.get("report") else ""
        loss = _num(r.get("loss"))
        failed = ", ".join(r["failed"]) if not r.get("damaged") else r["damaged"]
        out.append(f"<tr><td>{r['step']}</td><td class='{cls}'>{_esc(r['verdict'])}</td>"
                   f"<td>{_esc(failed)}</td><td>{_esc(r.get('kind'))}</td>"
                   f"<td>{_esc(_mib(r.get('bytes_written')))}</td><td>{_esc(_mib(r.get('logical_bytes')))}</td>"
                   f"<td>{_esc(r.get('ratio'))}</td><td>{'' if loss is None else f'{loss:.4f}'}</td>"
                   f"<td>{link}</td></tr>")
    out.append("</table><h2>The run</h2><img src='run.png' alt='run plot'>")
    out.append("</body></html>")
    store.put("reports/index.html", "\n".join(out).encode())
    return "reports/index.html"
