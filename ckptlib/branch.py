"""Branch a run: a new run whose first checkpoint is a committed step of another run.

``branch(source, step, target)`` makes ``target`` hold exactly the checkpoint ``step`` of
``source``: it copies every object that step needs (its fragments and chunks, delta chains
included) into ``target`` — a hard link between local stores on one filesystem, a server-side copy
between S3 prefixes on one endpoint, else a read and a write — then its verdict, and publishes the
same manifest there with its lineage: ``{"run": <source url>, "step": <step>}``. The digest is the
source's (it covers the parts, not where they came from), so the branch continues with deltas
against it, and ``ckpt ls/show`` and the reports name where it came from.

Copying instead of referencing keeps runs independent: garbage collection of either never has to
know of the other. Objects are content-addressed, so the copy is idempotent: a branch interrupted
half-way is finished by calling it again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .commit import committed_steps, ensure_marker, part_keys, publish, read_manifest, validation_key
from .errors import CommitConflict, ObjectNotFound
from .leases import Lease
from .manifest import Manifest
from .store import Store, redact_url


def branch(source: Store, step: int, target: Store, *, threads: int = 16) -> Manifest:
    """Copy committed ``step`` of ``source`` into ``target`` as its first checkpoint (see module doc).
    Idempotent: a target whose first checkpoint is already this branch (a retried run that went on
    from it) is returned as it is. Refuses a target with any other committed checkpoints."""
    m = read_manifest(source, step)
    existing = committed_steps(target)
    lineage = {"run": redact_url(source.url), "step": step}
    if existing and existing[0] == step:
        first = read_manifest(target, step)
        if first.lineage == lineage and first.digest == m.digest:
            return first
    if existing and existing != [step]:
        raise CommitConflict(
            f"{target.url} already holds checkpoints {existing[:5]}{'...' if len(existing) > 5 else ''}: branch "
            "into a new run (a new run id)"
        )
    keys: set[str] = set()
    for name in m.parts:
        keys |= part_keys(source, m, name)
    with Lease(target, "save", None):  # a GC of the target leaves the copies alone until the manifest is in
        ensure_marker(target)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-branch") as pool:
            list(pool.map(lambda key: target.copy_from(source, key), sorted(keys)))
        try:
            target.copy_from(source, validation_key(step))  # the verdict describes the same state
        except ObjectNotFound:
            pass
        branched = Manifest(step=m.step, parent=None, created=m.created, digest=m.digest, single=m.single,
                            parts=m.parts, meta={**m.meta, "branched_from": lineage},
                            lineage=lineage, stored_bytes=m.stored_bytes)
        publish(target, branched)
    return read_manifest(target, step)
