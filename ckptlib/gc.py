"""Mark-and-sweep garbage collection of a run's store.

Order, so that a crash at any point leaves only garbage and never a dangling reference:
1. uncommit the steps the policy drops (delete their manifests, then their validations/reports);
2. mark every object a kept manifest needs (its blob tables include whole delta chains);
3. sweep ``chunks/`` and old ``fragments/``: delete what is unmarked and older than ``grace_s``.

A save in flight has written chunks that no manifest names yet, and its deltas build on chunks of
the newest committed checkpoint. The newest is always kept, and the grace period protects fresh
unreferenced chunks, so GC never touches a save in flight. Fragments of steps after the newest
committed one are never deleted. Not safe against a writer whose base is an *older* checkpoint than
the newest (two independent writers on one run); the training flow has a single committer per run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .commit import committed_steps, manifest_key, read_manifest, validation_key
from .retention import RetentionPolicy
from .store import Store


@dataclass
class GcReport:
    kept_steps: list[int]
    dropped_steps: list[int]
    deleted_objects: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    dry_run: bool = False


def collect_garbage(store: Store, policy: RetentionPolicy, *, grace_s: float = 600.0, dry_run: bool = False) -> GcReport:
    steps = committed_steps(store)
    kept = policy.select(steps)
    dropped = [s for s in steps if s not in kept]
    report = GcReport(sorted(kept), dropped, dry_run=dry_run)

    def delete(key: str, size: int = 0) -> None:
        report.deleted_objects.append(key)
        report.freed_bytes += size
        if not dry_run:
            store.delete(key)

    sizes: dict[str, int] = {}  # object sizes, known from the manifests about to be dropped
    for step in dropped:
        for frag in read_manifest(store, step).parts.values():
            sizes.update({b.key: b.size for b in frag.blobs.values()})
    for step in dropped:
        delete(manifest_key(step))
        for key in [validation_key(step), *store.list(f"reports/{step}/")]:
            if store.exists(key):
                delete(key)

    marked = set().union(*(read_manifest(store, step).blob_keys() for step in kept))

    cutoff = time.time() - grace_s
    for key in store.list("chunks/"):
        if key not in marked and store.modified(key) < cutoff:
            delete(key, sizes.get(key, 0))

    newest = steps[-1] if steps else -1
    for key in store.list("fragments/"):
        step_dir = key.split("/")[1]
        if step_dir.isdigit() and int(step_dir) <= newest and store.modified(key) < cutoff:
            delete(key)
    return report
