"""The damage record: which steps and which stored objects were found damaged, so no save trusts them.

A content-addressed save references an object that "exists" instead of writing it again (a dedup
hit). Existing is not being intact: a byte flipped on disk leaves the key in place. So whoever finds
damage writes it down, one note per step, under the run's root::

    damage/<step>.json    a ``DamageNote``: what was found in that step, and the objects to distrust

* ``Checkpointer.verify`` writes the note of a step it finds damaged (its problems, the objects
  named), and deletes it when it finds the step intact (every object of the step then decodes to
  its checksum: nothing in the note is to be distrusted any longer).
* ``quarantine_step`` of a step with no note (moved aside without a verify) writes one naming every
  object the step names: unverified, all are suspects.
* A save reads the record once (``notes``: one listing, nothing more on a healthy run) and
  neither references nor deltas against a suspect object; one it produces again is checked against
  the stored bytes and written over when they differ (``Store.put``). A save does not edit notes
  (only ``verify`` does, so no two processes rewrite the same note and no finding is lost): a note
  stays until a verify of its step finds the step intact. What a writer confirmed intact or wrote
  again it trusts while the note stays the same (``confirm``, in its memory): one check per object
  per writer.
* A note is about one commit of its step: it holds the checksum of the manifest it was written
  for. ``flagged_steps``: the committed steps whose manifest is the one their note names (a step
  committed again after a quarantine is a new commit, not flagged, while the old objects stay
  suspects). ``ckpt ls`` marks them; ``restore()`` of the latest skips them; ``restore(step=N)`` of one
  reads it as any step (every object it reads is checked), with a warning.

Notes are bounded (``DamageNote.MAX_BYTES``; at most ``MAX_OBJECTS`` keys, else ``every``: trust
dedup hit until confirmed), read with their cap, and every key in them is checked to be an object key;
a note that is not one stops the save that reads it (``DocumentError`` naming it and the fix).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from .documents import Document, DocumentError
from .errors import ObjectNotFound, ObjectTooLarge

if TYPE_CHECKING:
    from .bases import Base
    from .store import Store

DAMAGE = "damage"
MAX_OBJECTS = 16384  # keys per note; a step with more distrusts every object (``every``)
MAX_PROBLEMS = 20  # problem lines kept per note
_OBJECT = re.compile(r"chunks/[0-9a-f]{2}/[0-9a-f]{32}|fragments/\d+/[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\.g\d+\.json")
_NOTE = re.compile(r"damage/(\d+)\.json")


@dataclass(frozen=True)
class DamageNote(Document):
    """``damage/<step>.json``: what was found damaged in ``step``."""

    KIND = "damage note"
    FORMAT = 1
    MAX_BYTES = 1 << 20

    step: int
    found_by: str  # "verify", or "quarantine" (moved aside unverified: every object it names)
    time: str  # ISO 8601, UTC
    problems: tuple[str, ...] = ()  # the first MAX_PROBLEMS, one line each
    count: int = 0  # problems in all
    objects: tuple[str, ...] = ()  # the objects to distrust
    every: bool = False  # more than MAX_OBJECTS: distrust every object
    manifest: str = ""  # blake2b-128 of the bytes of the step's manifest it was written for ("": unknown)

    def __post_init__(self) -> None:
        bad = next((k for k in self.objects if not _OBJECT.fullmatch(k)), None)
        if bad is not None:
            raise ValueError(f"{bad!r} is not an object key (chunks/<2 hex>/<32 hex> or a fragment's key)")
        if len(self.objects) > MAX_OBJECTS or len(self.problems) > MAX_PROBLEMS:
            raise ValueError(f"more than {MAX_OBJECTS} objects or {MAX_PROBLEMS} problems")

    @property
    def ident(self) -> tuple[int, str]:
        """Which note this is: its step and when it was written."""
        return self.step, self.time

    def summary(self) -> str:
        """One line: what was found (``ckpt ls``, the errors of a flagged step)."""
        if self.found_by == "quarantine":
            return "moved aside by quarantine without a verify: every object it names is suspect"
        first = f"first: {self.problems[0]}" if self.problems else "see `ckpt verify`"
        return f"verify found {self.count} problem(s) ({first})"


@dataclass(frozen=True)
class Suspects:
    """The objects no save may trust because they exist: ``objects``, and with ``every`` all but
    ``cleared`` (a note of more objects than it holds)."""

    objects: frozenset[str]
    every: bool = False
    cleared: frozenset[str] = frozenset()

    @classmethod
    def of(cls, found: dict[int, DamageNote], confirmed: Mapping[tuple[int, str], set[str]]) -> Suspects | None:
        """What ``found`` (``notes``) distrusts, less what this writer ``confirmed`` intact since each
        note was written (keyed by ``note.ident``: a note written again starts over). None: nothing."""
        objects: set[str] = set()
        cleared: set[str] | None = None
        for note in found.values():
            ok = confirmed.get(note.ident, set())
            objects |= set(note.objects) - ok
            if note.every:  # trusted only once confirmed since every such note
                cleared = set(ok) if cleared is None else cleared & ok
        if not objects and cleared is None:
            return None
        return cls(frozenset(objects), cleared is not None, frozenset(cleared or ()))

    def __contains__(self, key: object) -> bool:
        return key in self.objects or (self.every and key not in self.cleared)

    def clean(self, base: Base | None) -> Base | None:
        """``base`` without the blobs a save must not reference or take deltas against: the suspect
        ones and every delta built on one (its chain does not decode)."""
        if base is None:
            return None
        bad: dict[str, bool] = {}  # digest -> whether its chain reaches a suspect (or no blob)

        def tainted(digest: str) -> bool:
            chain: list[str] = []
            while digest not in bad:
                blob = base.blobs.get(digest)
                if blob is None or blob.key in self or len(chain) > len(base.blobs):  # (a cycle: not ckptlib's)
                    bad[digest] = True
                elif blob.base is None:
                    bad[digest] = False
                else:
                    chain.append(digest)
                    digest = blob.base
            for d in chain:
                bad[d] = bad[digest]
            return bad[digest]

        kept = {d: b for d, b in base.blobs.items() if not tainted(d)}
        return base if len(kept) == len(base.blobs) else replace(base, blobs=kept)


def note_key(step: int) -> str:
    return f"{DAMAGE}/{step}.json"


def notes(store: Store) -> dict[int, DamageNote]:
    """Every note, by step (one listing; {} on a healthy run). A note that is not one raises
    DocumentError naming it: delete it, and verify its step again."""
    out = {}
    for key in store.list(DAMAGE):
        m = _NOTE.fullmatch(key)
        if m is None:
            continue
        try:
            note = DamageNote.read(store, key)
        except ObjectNotFound:
            continue  # deleted (by a verify) since the listing
        except DocumentError as e:
            raise DocumentError(f"{e}; delete {store.url}/{key} and run `ckpt verify {store.url} --step "
                                f"{m.group(1)}` again") from None
        out[int(m.group(1))] = note
    return out


def suspects(store: Store, confirmed: Mapping[tuple[int, str], set[str]] | None = None) -> Suspects | None:
    """What a save must not trust (one listing; None when nothing is recorded), less what it
    ``confirmed`` intact (``Suspects.of``)."""
    return Suspects.of(notes(store), confirmed or {})


def confirm(confirmed: dict[tuple[int, str], set[str]], found: dict[int, DamageNote], keys: set[str]) -> None:
    """Note in ``confirmed`` (a writer's own, in memory) that ``keys``, suspects of ``found``, were
    found holding the bytes a save encoded, or written again; forget notes no longer stored."""
    for ident in [i for i in confirmed if i not in {n.ident for n in found.values()}]:
        del confirmed[ident]
    for note in found.values():
        mine = keys if note.every else keys & set(note.objects)
        if mine:
            confirmed.setdefault(note.ident, set()).update(mine)


def manifest_checksum(store: Store, step: int) -> str | None:
    """blake2b-128 of the bytes of committed ``step``'s manifest (which commit of it this is), or None
    when it is not committed."""
    from .commit import manifest_key
    from .manifest import MAX_MANIFEST_BYTES

    try:
        data = store.get(manifest_key(step), max_bytes=MAX_MANIFEST_BYTES)
    except (ObjectNotFound, ObjectTooLarge):
        return None
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def flagged_steps(store: Store) -> dict[int, DamageNote]:
    """The committed steps found damaged, with their notes: one listing, and one manifest read per
    note. A note written for another commit of its step (the step was committed again after a
    quarantine) does not flag the new one."""
    out = {}
    for step, note in notes(store).items():
        current = manifest_checksum(store, step)
        if current is not None and note.manifest in ("", current):
            out[step] = note
    return out


def record_verify(store: Store, step: int, problems: list) -> None:
    """Write what a verify of ``step`` found (``problems``: ``restore.Problem``s), or, when it found
    the step intact, delete its note. A note of another commit of the step is kept (its objects stay
    suspects), and merged into a new one."""
    current = manifest_checksum(store, step) or ""
    try:
        old = DamageNote.read(store, note_key(step))
    except (ObjectNotFound, DocumentError):
        old = None
    stale = old is not None and old.manifest not in ("", current)
    if not problems:
        if not stale:
            store.delete(note_key(step))
        return
    keys = {p.key for p in problems if p.key and _OBJECT.fullmatch(p.key)}
    lines = tuple(" ".join(str(p).split())[:1000] for p in problems[:MAX_PROBLEMS])
    _write(store, step, "verify", keys, lines, len(problems), current, old if stale else None)


def record_unverified(store: Store, step: int, objects: set[str] | None) -> None:
    """Committed ``step`` is moved aside without a verify: every object it names is suspect (unless a
    verify already noted what it found in this very commit of it); ``None``: what it names cannot be
    read (its manifest does not decode), so every object is, until confirmed."""
    current = manifest_checksum(store, step) or ""
    try:
        old = DamageNote.read(store, note_key(step))
    except (ObjectNotFound, DocumentError):
        old = None
    if old is not None and old.manifest in ("", current):
        return
    keys = {k for k in objects or () if _OBJECT.fullmatch(k)}
    _write(store, step, "quarantine", keys, (), 0, current, old, every=objects is None)


def _write(store: Store, step: int, by: str, keys: set[str], lines: tuple[str, ...], count: int,
           manifest: str, stale: DamageNote | None, *, every: bool = False) -> None:
    """Write ``step``'s note; the objects of a ``stale`` note (another commit of the step) stay in it."""
    every = every or (stale is not None and stale.every)
    if stale is not None:
        keys = keys | set(stale.objects)
    every = every or len(keys) > MAX_OBJECTS
    note = DamageNote(step, by, datetime.now(UTC).isoformat(), lines, count, () if every else tuple(sorted(keys)),
                      every, manifest)
    store.put(note_key(step), note.to_json())
