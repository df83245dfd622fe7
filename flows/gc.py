"""The ``gc-store`` flow: garbage-collect one run, or every run under a store root.

Composition only (the work is ``tasks/gc.py`` around ``ckptlib.gc``): find the runs (a run is a
prefix holding ``manifests/``), apply one retention policy to each, one ``gc-run`` task per run,
one after the other, and publish a table artifact ``gc-<store>`` of what was kept and freed.
Deployed as ``gc-store/gc`` (``make deploy``) with a daily schedule that starts inactive; run it
locally with ``python -m flows.gc s3://checkpoints/runs --dry-run``.

Credentials for ``s3://`` come from the environment of the process that runs the flow
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``: the stack's worker has them)
or from a Prefect Secret block named by ``credentials_block``; never from a parameter that holds them.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from prefect import flow, get_run_logger
from pydantic import Field

from ckptlib.gc import DEFAULT_GRACE_S
from tasks.gc import find_runs, gc_run
from trainrun.credentials import StoreAccess


@flow(name="gc-store", description="Drop checkpoints a retention policy does not keep and delete the objects "
      "no kept checkpoint needs, for one run or every run under a store root.",
      validate_parameters=True, persist_result=False)
def gc_store(
    store: str = "./runs",
    keep_last: Annotated[int, Field(ge=1)] = 3,
    keep_every: Annotated[int | None, Field(ge=1)] = None,
    grace_seconds: Annotated[float, Field(ge=0)] = DEFAULT_GRACE_S,
    dry_run: bool = False,
    keep_latest_healthy: bool = True,
    credentials_block: str | None = None,
) -> list[dict[str, Any]]:
    """Garbage-collect the checkpoints of one run or of every run under a store root.

    Args:
        store: A run's URL (s3://bucket/prefix/run-id, a local path) or a store root holding many
            runs (s3://checkpoints/runs): every run under it (a folder with manifests/) is collected.
        keep_last: Keep the newest N committed checkpoints of each run (N >= 1).
        keep_every: Also keep every checkpoint whose step is divisible by K (milestones); empty = none.
        grace_seconds: Delete unreferenced chunks and fragments only when older than this: protects
            saves in flight. Keep it well above the longest checkpoint save.
        dry_run: Only report what would be deleted; delete nothing.
        keep_latest_healthy: Also keep each run's latest validated checkpoint (where a resume starts),
            even when newer ones fill keep_last.
        credentials_block: Name of a Prefect Secret block holding the s3fs options of an s3:// store as
            JSON. Empty: the environment of the process that runs the flow.
    """
    logger = get_run_logger()
    access = StoreAccess(block=credentials_block)
    runs = find_runs(store, access)
    if not runs:
        logger.warning("no run under %s (a run is a folder with manifests/ or heartbeats/): nothing to collect", store)
    results = []
    for url in runs:
        r = gc_run(url, keep_last, keep_every, grace_seconds, dry_run, keep_latest_healthy, access)
        logger.info("%s: kept %s, %sdropped %s, %d objects, %d bytes", url, r["kept_steps"],
                    "would have " if dry_run else "", r["dropped_steps"], r["deleted_objects"], r["freed_bytes"])
        if r.get("deferred"):
            logger.warning("%s: stopped early: %s", url, r["deferred"])
        results.append(r)
    _publish(store, results, dry_run)
    return results


def _publish(store: str, results: list[dict[str, Any]], dry_run: bool) -> None:
    from prefect.artifacts import create_table_artifact

    key = "gc-" + (re.sub(r"[^a-z0-9]+", "-", store.lower()).strip("-")[:80] or "store")
    rows = [{"run": r["run"], "kept": ", ".join(map(str, r["kept_steps"])) or "-",
             "dropped": ", ".join(map(str, r["dropped_steps"])) or "-",
             "objects": r["deleted_objects"], "freed_bytes": r["freed_bytes"], "dry_run": r["dry_run"],
             "stopped_early": r.get("deferred") or "-"}
            for r in results]
    try:
        create_table_artifact(rows or [{"run": "-", "kept": "-", "dropped": "-", "objects": 0, "freed_bytes": 0,
                                        "dry_run": dry_run, "stopped_early": "-"}],
                              key=key, description=f"{'Dry run: ' if dry_run else ''}garbage collection of {store}")
    except Exception as e:  # noqa: BLE001 - the deletes are done; the UI view is secondary
        get_run_logger().warning("could not create the gc artifact: %s", e)


if __name__ == "__main__":  # python -m flows.gc URL [--keep-last N] [--dry-run]
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m flows.gc")
    ap.add_argument("store")
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--keep-every", type=int, default=None)
    ap.add_argument("--grace-seconds", type=float, default=DEFAULT_GRACE_S)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    print(json.dumps(gc_store(a.store, a.keep_last, a.keep_every, a.grace_seconds, a.dry_run), indent=2))
