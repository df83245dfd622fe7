"""Quarantine: move a committed step aside (a damaged one, typically), and back. Nothing is deleted.

Keys under a run's root::

    quarantine/<step>/manifests/<step>.json     the step's manifest, as it was committed
    quarantine/<step>/validations/<step>.json   its verdict, when it had one
    quarantine/<step>/record.json               when, why and by whom (a ``QuarantineRecord``)

A quarantined step is not committed (readers trust only ``manifests/``): listings, restores, resumes
and garbage collection no longer see it, so one damaged step stops blocking them. Garbage collection
keeps every object a quarantined manifest names (the chunks and fragments it names, and the chunks
those fragments name, found in their bytes, whatever the damage), until the quarantine is undone
(``release_step``: the step is committed again, exactly as it was) or its folder is deleted by hand.

Order (each step safe to crash after, and ``quarantine_step`` may be run again): the verdict and
the manifest are copied (a hard link locally, a server-side copy on S3), then ``record.json`` is
written (the commit point of the quarantine), then the verdict and the manifest are removed from
their places, the manifest last. ``release_step`` copies them back, then removes ``record.json``,
then the copies. Whether a step is damaged is the caller's judgement (``ckpt quarantine`` refuses
an intact step unless told otherwise).

Before anything moves, a step with no damage note (``ckptlib.damage``: none when no verify found
it damaged) gets one naming every object it names: a save then trusts none of them because they
exist. A note stays after ``release_step``: a verify of the step put back clears it.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from datetime import UTC, datetime

from . import commit, damage
from .docfields import unpack
from .documents import Document, DocumentError
from .errors import CheckpointError, CorruptCheckpoint, NoCheckpoint, ObjectNotFound, ObjectTooLarge
from .manifest import MAX_FRAGMENT_BYTES, MAX_MANIFEST_BYTES
from .store import Store

log = logging.getLogger("ckptlib")

QUARANTINE = "quarantine"
RECORD = "record.json"
# What a manifest or a fragment names, found in its JSON (a damaged one may not parse).
_NAMED = re.compile(rb"chunks/[0-9a-f]{2}/[0-9a-f]{32}|fragments/\d+/[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\.g\d+\.json")


@dataclass(frozen=True)
class QuarantineRecord(Document):
    """``quarantine/<step>/record.json``."""

    KIND = "quarantine record"
    FORMAT = 1
    MAX_BYTES = 64 << 10

    step: int
    reason: str
    time: str  # ISO 8601, UTC
    host: str = ""
    pid: int | None = None
    verdict: bool = False  # whether the step's verdict was moved with it


def quarantine_folder(step: int) -> str:
    return f"{QUARANTINE}/{commit.check_step(step)}"


def quarantine_step(store: Store, step: int, reason: str) -> QuarantineRecord:
    """Move committed ``step`` aside (``reason``: why, one line). NoCheckpoint when it is not
    committed; CheckpointError when ``quarantine/<step>/`` holds another quarantine of that step."""
    key, verdict_key = commit.manifest_key(step), commit.validation_key(step)
    aside = store.child(quarantine_folder(step))
    existing = read_record(store, step)
    if not store.exists(key):
        if existing is not None:
            raise NoCheckpoint(f"step {step} of {store.url} is in quarantine already (since {existing.time}: "
                               f"{existing.reason}); `ckpt quarantine {store.url} --step {step} --undo` puts it back")
        raise NoCheckpoint(f"step {step} is not committed in {store.url}: nothing to quarantine")
    # before it leaves: what it names stays distrusted by saves (unless a verify said which objects)
    try:
        named: set[str] | None = _objects_named(store, key)
    except CorruptCheckpoint:  # its frame does not decode: which objects it names is unknown
        named = None
    damage.record_unverified(store, step, named)
    _copy_aside(store, aside, key, step)
    moved_verdict = store.exists(verdict_key)
    if moved_verdict:
        _copy_aside(store, aside, verdict_key, step)
    record = existing or QuarantineRecord(step=step, reason=" ".join(str(reason).split())[:2000],
                                          time=datetime.now(UTC).isoformat(), host=socket.gethostname(),
                                          pid=os.getpid(), verdict=moved_verdict)
    if existing is None and not aside.put_if_absent(RECORD, record.to_json()):
        raise CheckpointError(f"another quarantine of step {step} of {store.url} ran at the same time: look at "
                              f"{store.url}/{quarantine_folder(step)}/ and run this again")
    if moved_verdict:
        store.delete(verdict_key)
    store.delete(key)  # last: until now the step was committed, and intact copies were aside
    log.warning("step %d of %s moved to %s/ (%s)", step, store.url, quarantine_folder(step), record.reason)
    return record


def release_step(store: Store, step: int) -> QuarantineRecord:
    """Put quarantined ``step`` back (committed again, with its verdict). NoCheckpoint when it is not
    in quarantine; CheckpointError when another state was committed under that step meanwhile."""
    record = read_record(store, step)
    if record is None:
        raise NoCheckpoint(f"step {step} of {store.url} is not in quarantine (no {quarantine_folder(step)}/{RECORD})")
    aside = store.child(quarantine_folder(step))
    key, verdict_key = commit.manifest_key(step), commit.validation_key(step)
    try:
        data = aside.get(key, max_bytes=MAX_MANIFEST_BYTES)
    except ObjectTooLarge as e:
        raise CheckpointError(f"{e}: no reader would read it as step {step}; its folder stays as it is") from None
    # put_if_absent: the commit point, atomic (a step committed meanwhile is never replaced)
    if not store.put_if_absent(key, data) and not _same(store, aside, key):
        raise CheckpointError(f"step {step} of {store.url} was committed again since it was quarantined: its "
                              f"quarantined manifest stays in {store.url}/{quarantine_folder(step)}/")
    if aside.exists(verdict_key):
        store.copy_from(aside, verdict_key)  # (a verdict of the step written since wins)
    aside.delete(RECORD)
    for k in (verdict_key, key):
        aside.delete(k)
    return record


def read_record(store: Store, step: int) -> QuarantineRecord | None:
    """The record of quarantined ``step`` (None when it is not in quarantine). A record that does
    not parse still means the step is in quarantine: its reason says so."""
    try:
        return QuarantineRecord.read(store, f"{quarantine_folder(step)}/{RECORD}")
    except ObjectNotFound:
        return None
    except DocumentError as e:
        return QuarantineRecord(step=step, reason=f"(unreadable record: {e})", time="?")


def quarantined(store: Store) -> dict[int, QuarantineRecord]:
    """Every quarantined step with its record, by step."""
    out = {}
    for name in store.list_dirs(QUARANTINE):
        if name.isdigit() and (record := read_record(store, int(name))) is not None:
            out[int(name)] = record
    return out


def quarantined_objects(store: Store) -> set[str]:
    """The objects (chunks and fragments) quarantined steps name: garbage collection keeps them.
    Found in the bytes of each quarantined manifest and of the fragments it names (read with their
    caps; one larger than any ckptlib writes names nothing, logged)."""
    keys: set[str] = set()
    for name in store.list_dirs(QUARANTINE):
        if name.isdigit():
            folder = quarantine_folder(int(name))
            try:
                keys |= _objects_named(store, f"{folder}/{commit.manifest_key(int(name))}")
            except CorruptCheckpoint as e:  # collecting without its objects could delete what it holds
                raise CheckpointError(f"garbage collection stops: {e}. It cannot tell which objects that quarantined "
                                      f"step holds: remove {store.url}/{folder}/ if the step is no longer wanted, "
                                      "then collect again") from None
    return keys


def _objects_named(store: Store, key: str) -> set[str]:
    """The objects the manifest under ``key`` names, and those its fragments name;
    CorruptCheckpoint when one is a frame that does not decode (damaged plain JSON still names them)."""
    named = _named(store, key, MAX_MANIFEST_BYTES)
    keys = set(named)
    for fragment in sorted(k for k in named if k.startswith("fragments/")):
        keys |= _named(store, fragment, MAX_FRAGMENT_BYTES)
    return keys


def _named(store: Store, key: str, cap: int) -> set[str]:
    try:
        data = store.get(key, max_bytes=cap)
        return {m.decode() for m in _NAMED.findall(unpack(data, f"{store.url}/{key}", cap))}
    except ObjectNotFound:
        return set()
    except ObjectTooLarge as e:
        log.warning("garbage collection keeps nothing %s names: %s", key, e)
        return set()


def _copy_aside(store: Store, aside: Store, key: str, step: int) -> None:
    if not aside.copy_from(store, key) and not _same(store, aside, key):
        raise CheckpointError(f"{store.url}/{quarantine_folder(step)}/ holds another quarantine of step {step} "
                              f"({key} differs): put it back first (`ckpt quarantine {store.url} --step {step} "
                              "--undo`) or remove that folder")


def _same(a: Store, b: Store, key: str) -> bool:
    """Whether ``key`` holds the same bytes in both stores (no: when either is past the manifest cap)."""
    try:
        return a.get(key, max_bytes=MAX_MANIFEST_BYTES) == b.get(key, max_bytes=MAX_MANIFEST_BYTES)
    except (ObjectNotFound, ObjectTooLarge):
        return False
