"""Links a person clicks in the Prefect UI: a flow run's page, a store object over plain HTTP.

Artifacts are markdown, and a browser on the UI's page opens only ``http(s)://`` links (not
``s3://``, nor ``file://`` from an ``http://`` page). Where the objects of a bucket are served over
HTTP is the deployment's business: ``CKPT_S3_HTTP_BASE`` (the local stack sets it for its worker
and every flow run: the SeaweedFS filer, ``http://127.0.0.1:8888/buckets``) maps ``s3://B/K`` to
``$CKPT_S3_HTTP_BASE/B/K``. Without it, or for a local store, there is no link and artifacts show
the URL as text.
"""

from __future__ import annotations

import os

S3_HTTP_BASE_ENV = "CKPT_S3_HTTP_BASE"


def http_url(url: str | None) -> str | None:
    """``url`` as a link a browser opens (an ``s3://`` object through ``CKPT_S3_HTTP_BASE``), or None."""
    if not url:
        return None
    if url.startswith(("http://", "https://")):
        return url
    base = os.environ.get(S3_HTTP_BASE_ENV, "").rstrip("/")
    if url.startswith("s3://") and base:
        return f"{base}/{url[len('s3://'):]}"
    return None


def ui_url() -> str | None:
    """The Prefect UI this process reports to (``PREFECT_UI_URL``, else derived from the API URL)."""
    try:
        from prefect.settings import PREFECT_UI_URL

        return (PREFECT_UI_URL.value() or "").rstrip("/") or None
    except Exception:  # noqa: BLE001 - no Prefect settings here: no link
        return None


def flow_run_url(flow_run_id: str | None) -> str | None:
    """The UI page of a flow run, or None."""
    ui = ui_url()
    return f"{ui}/runs/flow-run/{flow_run_id}" if ui and flow_run_id else None


def md_link(text: str, url: str | None) -> str:
    """``[text](link)`` when ``url`` has an HTTP form, else ``text`` with the URL as code."""
    link = http_url(url)
    if link:
        return f"[{text}]({link})"
    return f"{text}: `{url}`" if url else text
