"""Prefect tasks of the ``gc-store`` flow: find the runs under a store root, collect one run's garbage.

``find_runs`` is ``trainrun.layout.find_runs`` (a run is a prefix holding ``manifests/`` or
``heartbeats/``); ``gc_run`` is ``Checkpointer.gc`` with one retention policy, keeping the latest
healthy step too (where a resume starts). The safety argument (newest step always kept, grace
period for saves in flight, order of deletes) is ckptlib.gc's.
"""

from __future__ import annotations

from prefect import task

from ckptlib import Checkpointer, RetentionPolicy
from ckptlib.store import Store
from trainrun.credentials import StoreAccess
from trainrun.layout import child_url
from trainrun.layout import find_runs as runs_under

from .access import storage_options
from .retry import transient_store_error


@task(name="find-runs", retries=2, retry_delay_seconds=2, retry_condition_fn=transient_store_error)
def find_runs(root: str, access: StoreAccess | None = None) -> list[str]:
    """URLs of the runs at or under ``root``."""
    return [child_url(root, p) for p in runs_under(Store.from_url(root, storage_options(access)))]


@task(name="gc-run", task_run_name="gc-{run_url}", retries=1, retry_delay_seconds=5,
      retry_condition_fn=transient_store_error)
def gc_run(run_url: str, keep_last: int, keep_every: int | None, grace_s: float, dry_run: bool,
           keep_latest_healthy: bool = True, access: StoreAccess | None = None) -> dict:
    """Apply the retention policy to one run; return what was (or would be) deleted, and why the
    sweeps stopped early if they did (``deferred``: a save in flight). A run with no committed
    checkpoint yet (it only beats) is left alone."""
    with Checkpointer(run_url, storage_options(access)) as ck:
        if not ck.steps():
            return {"run": run_url, "kept_steps": [], "dropped_steps": [], "deleted_objects": 0, "deleted_chunks": 0,
                    "freed_bytes": 0, "latest_healthy": None, "dry_run": dry_run, "deferred": None}
        healthy = ck.latest_step(healthy=True) if keep_latest_healthy else None
        policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every,
                                 keep_named=frozenset(() if healthy is None else (healthy,)))
        report = ck.gc(policy, grace_s=grace_s, dry_run=dry_run)
    chunks = sum(1 for k in report.deleted_objects if k.startswith("chunks/"))
    return {"run": run_url, "kept_steps": report.kept_steps, "dropped_steps": report.dropped_steps,
            "deleted_objects": len(report.deleted_objects), "deleted_chunks": chunks,
            "freed_bytes": report.freed_bytes, "latest_healthy": healthy, "dry_run": report.dry_run,
            "deferred": report.deferred}
