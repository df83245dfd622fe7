"""Prefect tasks of the ``gc-store`` flow: find the runs under a store root, collect one run's garbage.

* ``find_runs(root, storage_options=None) -> list[str]``: the URLs of every run at or under ``root``.
  A run is a prefix that holds ``manifests/<step>.json`` (docs/run-layout.md); ``root`` itself
  counts when it is a run. One listing of ``root`` (on S3 a paged LIST of every key under it).
* ``gc_run(run_url, keep_last, keep_every, grace_s, dry_run, storage_options=None) -> dict``:
  ``Checkpointer(run_url).gc(RetentionPolicy(...))`` and a small JSON summary of the report
  (kept and dropped steps, objects deleted, bytes freed). With ``keep_latest_healthy`` (default)
  the latest committed-and-validated step is kept too, whatever the policy says: it is where a
  resume starts. The safety argument (newest step always
  kept, grace period for saves in flight, order of deletes) is ckptlib.gc's.

Storage options default to the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), as
everywhere else in the project.
"""

from __future__ import annotations

import re

from prefect import task

_MANIFEST = re.compile(r"^manifests/\d+\.json$")


def runs_in_keys(keys: list[str]) -> list[str]:
    """Run prefixes ('' = the root itself) among store ``keys``: those with a committed manifest."""
    runs = set()
    for key in keys:
        parts = key.split("/")
        if len(parts) >= 2 and _MANIFEST.match("/".join(parts[-2:])):
            runs.add("/".join(parts[:-2]))
    return sorted(runs)


def join_url(root: str, prefix: str) -> str:
    return root if not prefix else f"{root.rstrip('/')}/{prefix}"


@task(name="find-runs", retries=2, retry_delay_seconds=2)
def find_runs(root: str, storage_options: dict | None = None) -> list[str]:
    """URLs of the runs at or under ``root`` (a run has ``manifests/``)."""
    from ckptlib.store import Store

    store = Store.from_url(root, storage_options)
    return [join_url(root, p) for p in runs_in_keys(store.list())]


@task(name="gc-run", task_run_name="gc-{run_url}", retries=1, retry_delay_seconds=5)
def gc_run(run_url: str, keep_last: int, keep_every: int | None, grace_s: float, dry_run: bool,
           keep_latest_healthy: bool = True, storage_options: dict | None = None) -> dict:
    """Apply the retention policy to one run; return what was (or would be) deleted."""
    from ckptlib import Checkpointer, RetentionPolicy

    with Checkpointer(run_url, storage_options) as ck:
        # Resume starts from the latest *healthy* (committed + validated) step: never drop it, even
        # when newer checkpoints (unvalidated or failed) fill keep_last.
        healthy = ck.latest_step(healthy=True) if keep_latest_healthy else None
        policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every,
                                 keep_named=frozenset(() if healthy is None else (healthy,)))
        report = ck.gc(policy, grace_s=grace_s, dry_run=dry_run)
    chunks = sum(1 for k in report.deleted_objects if k.startswith("chunks/"))
    return {"run": run_url, "kept_steps": report.kept_steps, "dropped_steps": report.dropped_steps,
            "deleted_objects": len(report.deleted_objects), "deleted_chunks": chunks,
            "freed_bytes": report.freed_bytes, "latest_healthy": healthy, "dry_run": report.dry_run}
