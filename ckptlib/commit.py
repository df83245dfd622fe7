"""The commit protocol (docs/format.md, "Commit protocol"): fragments -> consistent cut -> atomic publish.

Keys under a run's root::

    manifests/<step>.json                 exists <=> step is committed (the only thing readers trust)
    fragments/<step>/<part>.g<gen>.json   one part of a cut, written by that part's live generation
    fragments/<step>/<part>.g<gen>.k<k>.json  a sub-step fragment: the part's progress k sub-steps into
                                          the cut at <step> (a shard checkpoint within a round); part of no
                                          cut, never named by a manifest; GC sweeps it once <step> is committed
    fences/<part>/<gen>                   generation tokens; the highest existing one is live
    validations/<step>.json               {"passed": bool, ...}; healthy = committed and passed

Guarantees and where they stop:

* ``publish`` is the commit point: ``put_if_absent`` of the manifest. Exactly one of several
  concurrent publishers of a step wins. A publisher that finds the manifest already there with the
  same digest succeeds (this is also how a conditional PUT whose success reply was lost is
  recognised on retry); with a different digest it raises ``CommitConflict``.
* ``fence`` creates a generation token with ``put_if_absent``: of two watchdogs fencing the same
  generation, exactly one wins.
* ``write_fragment`` refuses when its generation is no longer live, but check-then-write is not
  atomic: a fence created in between does not stop the write. That is why the coordinator only
  takes the fragment of the generation that is live when it builds the cut (``gather``).
"""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any

from .distributed.documents import AnyFragment, GroupFragment, loads_any_fragment
from .errors import (
    CheckpointError,
    CommitConflict,
    CorruptCheckpoint,
    DamagedStep,
    FencedError,
    FormatVersionError,
    NoCheckpoint,
    ObjectNotFound,
    ObjectTooLarge,
    StoreError,
)
from .manifest import (
    MAX_FRAGMENT_BYTES,
    MAX_MANIFEST_BYTES,
    Fragment,
    Manifest,
    PartRef,
    combined_digest,
    document_checksum,
    dumps,
    fragment_key,
    loads_manifest,
)
from .store import Store

_PART_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SUBSTEP_KEY = re.compile(r"^fragments/(\d+)/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})\.g(\d+)\.k(\d+)\.json$")
_MANIFEST_KEY = re.compile(r"^manifests/(\d+)\.json$")


STORE_MARKER = "ckptlib.json"  # written by the first save: what tells a store from any other folder

# Caps of the small documents of a run (docs/format.md, "Caps"); manifests and fragments have theirs
# in ckptlib.manifest. A verdict lists every integrity problem of its step (one line each).
VERDICT_MAX_BYTES = 16 << 20
FENCE_MAX_BYTES = 1 << 20


def ensure_marker(store: Store) -> None:
    """Mark ``store`` as a ckptlib store (idempotent)."""
    from .manifest import FORMAT_VERSION

    doc = {"ckptlib": True, "format": FORMAT_VERSION, "created": datetime.now(UTC).isoformat()}
    store.put_if_absent(STORE_MARKER, json.dumps(doc).encode())


def is_store(store: Store) -> bool:
    """Whether ``store`` holds ckptlib checkpoints: its marker, or (written before markers) a
    manifest. Garbage collection refuses anything else, so it never deletes in a wrong folder."""
    return store.exists(STORE_MARKER) or any(_MANIFEST_KEY.match(k) for k in store.list("manifests"))


def manifest_key(step: int) -> str:
    return f"manifests/{step}.json"


def validation_key(step: int) -> str:
    return f"validations/{step}.json"


def check_part_name(part: str) -> str:
    if not isinstance(part, str) or not _PART_NAME.match(part):
        raise ValueError(f"part name {part!r} is invalid: use 1-64 letters, digits, '_', '.' or '-'")
    return part


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return step


def committed_steps(store: Store) -> list[int]:
    steps = []
    for key in store.list("manifests/"):
        m = _MANIFEST_KEY.match(key)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def damaged_step(store: Store, step: int, error: BaseException | str) -> DamagedStep:
    """The one error of a committed step that cannot be read: what is wrong and what to do."""
    reason = error.reason if isinstance(error, DamagedStep) else " ".join(str(error).split())
    return DamagedStep(
        f"step {step} of {store.url} is damaged: {reason}. Restore another step (`ckpt ls {store.url}` marks the "
        f"damaged ones; a resume takes the newest healthy one), or move this one aside: "
        f"`ckpt quarantine {store.url} --step {step}`", step, reason)


def read_manifest(store: Store, step: int) -> Manifest:
    """The committed manifest of ``step``: NoCheckpoint when it is not committed, CorruptCheckpoint
    (``damaged_step``) when its manifest cannot be read."""
    key = manifest_key(step)
    try:
        data = store.get(key, max_bytes=MAX_MANIFEST_BYTES)
        m = loads_manifest(data, f"{store.url}/{key}")
    except ObjectNotFound:
        raise NoCheckpoint(f"step {step} is not committed in {store.url} (no {key}); `ckpt ls {store.url}` lists the committed steps") from None
    except CorruptCheckpoint as e:
        raise damaged_step(store, step, e) from None
    except FormatVersionError as e:
        raise FormatVersionError(f"step {step} of {store.url}: {e}") from None
    if m.step != step:
        raise damaged_step(store, step, f"{store.url}/{key} describes step {m.step}")
    return m


def load_part(store: Store, manifest: Manifest, name: str) -> Fragment:
    """The fragment of part ``name`` of a committed manifest (see ``load_any_part``); a part saved by
    a group of ranks is refused, naming what reads it."""
    frag = load_any_part(store, manifest, name)
    if isinstance(frag, GroupFragment):
        raise CheckpointError(f"part '{name}' of step {manifest.step} was saved by a group of {frag.world} ranks: "
                              "read it with Checkpointer.restore (full tensors, or into a distributed state) or "
                              "Checkpointer.read_rank")
    return frag


def part_keys(store: Store, manifest: Manifest, name: str) -> set[str]:
    """Every object part ``name`` of a committed manifest needs: its fragment object, a group's rank
    fragments, and the chunks (delta chains included) they name. What GC marks and a branch copies."""
    keys = fragment_needs(load_any_part(store, manifest, name))
    ref = manifest.parts[name]
    if ref.key is not None:
        keys.add(ref.key)
    return keys


def fragment_needs(frag: AnyFragment) -> set[str]:
    """The objects a fragment names: the chunks of its blob table and, a group's, its rank fragments."""
    keys = {b.key for b in frag.blobs.values()}
    if isinstance(frag, GroupFragment):
        keys.update(r.key for r in frag.ranks)
    return keys


def load_any_part(store: Store, manifest: Manifest, name: str) -> AnyFragment:
    """The fragment of part ``name`` of a committed manifest, a part's or a group's: embedded, or read
    from its object and checked against the manifest (its bytes' checksum, step, part, generation
    and digest)."""
    ref = manifest.parts.get(name)
    if ref is None:
        raise NoCheckpoint(f"step {manifest.step} has no part '{name}'; it has {sorted(manifest.parts)}")
    if ref.fragment is not None:
        return ref.fragment
    try:
        return _read_part(store, manifest, name, ref)
    except CorruptCheckpoint as e:
        raise damaged_step(store, manifest.step, e) from None


def _read_part(store: Store, manifest: Manifest, name: str, ref: PartRef) -> AnyFragment:
    where = f"{store.url}/{ref.key}"
    try:  # the size the manifest recorded (older manifests: what any fragment may hold)
        data = store.get(ref.key, max_bytes=MAX_FRAGMENT_BYTES if ref.size is None else ref.size)  # type: ignore[arg-type]
    except ObjectNotFound:
        raise CorruptCheckpoint(f"{where}, part '{name}' of committed step {manifest.step}, is missing from the "
                                "store (deleted?)") from None
    except ObjectTooLarge as e:
        raise CorruptCheckpoint(f"part '{name}' of committed step {manifest.step}: {e}") from None
    if document_checksum(data) != ref.checksum:
        raise CorruptCheckpoint(f"{where} does not match the checksum committed for part '{name}' of step "
                                f"{manifest.step}: it was replaced or damaged")
    frag = loads_any_fragment(data, where)
    if (frag.step, frag.part, frag.generation, frag.digest) != (manifest.step, name, ref.generation, ref.digest):
        raise CorruptCheckpoint(f"{where} describes step {frag.step}, part '{frag.part}', generation "
                                f"{frag.generation}, not what step {manifest.step} committed")
    return frag


def build_manifest(step: int, parent: int | None, parts: dict[str, tuple[AnyFragment, str | None]], single: bool,
                   meta: dict[str, Any] | None = None, lineage: dict[str, Any] | None = None) -> Manifest:
    """A manifest of ``parts`` (name -> (fragment, checksum of its stored bytes, or None to embed it))."""
    refs = {name: PartRef.of(name, frag, embed=checksum is None, checksum=checksum)
            for name, (frag, checksum) in parts.items()}
    stored = sum({b.key: b.size for frag, _ in parts.values() for b in frag.blobs.values()}.values())
    return Manifest(step=step, parent=parent, created=datetime.now(UTC).isoformat(),
                    digest=combined_digest({n: r.digest for n, r in refs.items()}, single), single=single,
                    parts=refs, meta=dict(meta or {}), lineage=lineage, stored_bytes=stored)


def commit_step(store: Store, step: int, parts: dict[str, tuple[AnyFragment, str | None]], *, parent: int | None,
                single: bool = False, meta: dict[str, Any] | None = None,
                lineage: dict[str, Any] | None = None) -> tuple[Manifest, bool]:
    """The one commit of the protocol: the manifest of exactly ``parts`` (name -> (fragment, checksum
    of its stored bytes, or None to embed it)) at ``step``, published. Returns (manifest, whether
    this call created it); see ``publish`` for the retry and conflict rules. Every writer commits
    through here: a single-writer save, a coordinator's cut, a collective save."""
    manifest = build_manifest(step, parent, parts, single=single, meta=meta, lineage=lineage)
    return manifest, publish(store, manifest)


def publish(store: Store, manifest: Manifest, *, attempts: int = 4) -> bool:
    """Make ``manifest`` the committed checkpoint of its step. True if this call created it.

    Idempotent: returns False when the same digest is already committed (a retry, a concurrent
    identical save, or our own earlier PUT whose reply was lost). Raises CommitConflict when a
    different state is committed under the step.
    """
    key, data = manifest_key(manifest.step), dumps(manifest)
    last_error: Exception | None = None
    for attempt in range(attempts):
        try:
            if store.put_if_absent(key, data):
                return True
            existing = read_manifest(store, manifest.step)
        except (StoreError, NoCheckpoint) as e:  # a lost reply or a transient failure: look again
            last_error = e
            time.sleep(min(0.1 * 2**attempt, 2.0))
            continue
        if existing.digest == manifest.digest:
            return False
        raise CommitConflict(
            f"step {manifest.step} is already committed in {store.url} with digest {existing.digest}; this "
            f"state has digest {manifest.digest}. Save under a new step, or delete the run if it is stale."
        )
    raise StoreError(f"could not publish step {manifest.step} to {store.url} after {attempts} attempts: {last_error}")


# --- fencing -------------------------------------------------------------------------------------

def live_generation(store: Store, part: str) -> int:
    """The highest fence of ``part`` (0 when it was never fenced)."""
    gens = [int(k.rsplit("/", 1)[1]) for k in store.list(f"fences/{part}/") if k.rsplit("/", 1)[1].isdigit()]
    return max(gens, default=0)


def live_generations(store: Store) -> dict[str, int]:
    """The live generation of every part ever fenced, from one listing of ``fences/`` (a part not in
    it was never fenced: generation 0). One request per 1,000 fence tokens on S3, however many parts
    a run has: what a coordinator of many shards, or a watchdog, asks instead of one listing per part."""
    gens: dict[str, int] = {}
    for info in store.scan("fences"):
        part, _, gen = info.key[len("fences/"):].partition("/")
        if gen.isdigit():
            gens[part] = max(gens.get(part, 0), int(gen))
    return gens


def fence_key(part: str, generation: int) -> str:
    return f"fences/{part}/{generation}"


def fence(store: Store, part: str, generation: int, reason: str = "", by: str = "",
          details: dict[str, Any] | None = None) -> bool:
    """Create generation ``generation`` of ``part``. True if this caller won; False if it existed.

    The token is a JSON document: who fenced, why, when, plus ``details`` (JSON values, e.g. the
    dead attempt's last beat and the detection latency)."""
    doc = {**(details or {}), "part": part, "generation": generation, "reason": reason, "by": by, "time": time.time()}
    return store.put_if_absent(fence_key(part, generation), json.dumps(doc).encode())


def read_fence(store: Store, part: str, generation: int) -> dict[str, Any] | None:
    """The fence document of ``part``'s generation ``generation`` (None if absent or not JSON)."""
    try:
        doc = json.loads(store.get(fence_key(part, generation), max_bytes=FENCE_MAX_BYTES))
    except ObjectNotFound:
        return None
    except (ValueError, RecursionError, ObjectTooLarge):
        return {"part": part, "generation": generation}
    return doc if isinstance(doc, dict) else {"part": part, "generation": generation}


def check_live(store: Store, part: str, generation: int) -> None:
    live = live_generation(store, part)
    if generation < live:
        raise FencedError(
            f"part '{part}' generation {generation} was fenced: generation {live} is live. This attempt "
            "was declared dead (hung or a zombie) and must stop; the live attempt owns the shard."
        )


def substep_key(step: int, part: str, generation: int, substep: int) -> str:
    """The key of ``part``'s sub-step fragment ``substep`` of the cut at ``step`` (generation ``generation``)."""
    return f"fragments/{step}/{part}.g{generation}.k{substep}.json"


def substep_keys(store: Store, step: int, part: str, generation: int) -> dict[int, str]:
    """``{substep: key}`` of every sub-step fragment of ``part``'s generation ``generation`` at ``step``
    (one listing of ``fragments/<step>/``)."""
    out: dict[int, str] = {}
    for key in store.list(f"fragments/{step}"):
        m = _SUBSTEP_KEY.match(key)
        if m and (int(m.group(1)), m.group(2), int(m.group(3))) == (step, part, generation):
            out[int(m.group(4))] = key
    return out


def put_fragment(store: Store, fragment: AnyFragment, key: str | None = None) -> str:
    """Write a fragment with put_if_absent (an identical one already there is success); returns
    the checksum of the stored bytes, which the manifest that commits it records. ``key``: another
    key than the cut's (a sub-step fragment's, ``substep_key``)."""
    key = key or fragment_key(fragment.step, fragment.part, fragment.generation)
    data = dumps(fragment)
    if store.put_if_absent(key, data):
        return document_checksum(data)
    existing, stored = read_fragment(store, key)
    if existing.digest != fragment.digest:
        raise CommitConflict(
            f"{store.url}/{key} already holds a different state (digest {existing.digest} != "
            f"{fragment.digest}): the same generation produced two states. Training is not deterministic, "
            "or two attempts share a generation; fence the part to start a new generation."
        )
    return document_checksum(stored)


def read_fragment(store: Store, key: str) -> tuple[AnyFragment, bytes]:
    """The fragment stored under ``key``, a part's or a group's (read with the fragment cap, checked
    as it is parsed), and its bytes; ObjectNotFound when there is none, CorruptCheckpoint when it is
    not a fragment."""
    data = store.get(key, max_bytes=MAX_FRAGMENT_BYTES)
    return loads_any_fragment(data, f"{store.url}/{key}"), data


def gather(store: Store, step: int, parts: list[str], *, timeout: float,
           poll: float = 0.2) -> dict[str, tuple[AnyFragment, str]]:
    """Wait until every part has a fragment of its live generation for ``step``; return them with
    the checksums of their stored bytes.

    A fragment of a fenced (older) generation is never taken, whoever wrote it. Each look lists the
    fences once (``live_generations``) and reads only the fragments it does not hold yet, so a cut
    of N parts costs N fragment reads plus a listing per look, not a listing per part.
    """
    deadline = time.monotonic() + timeout
    found: dict[str, tuple[AnyFragment, str]] = {}
    while True:
        live = live_generations(store)
        for part in parts:
            gen = live.get(part, 0)
            if part in found and found[part][0].generation == gen:
                continue
            try:
                frag, data = read_fragment(store, fragment_key(step, part, gen))
            except ObjectNotFound:
                found.pop(part, None)
                continue
            found[part] = (frag, document_checksum(data))
        if len(found) == len(parts):
            live = live_generations(store)  # fenced while we read? then look again
            if all(found[p][0].generation == live.get(p, 0) for p in parts):
                break
        if time.monotonic() > deadline:
            missing = sorted(set(parts) - set(found))
            raise TimeoutError(f"step {step}: no fragment of the live generation from parts {missing} "
                               f"after {timeout:.0f} s in {store.url}")
        time.sleep(poll)
    hashes = {f.config_hash for f, _ in found.values()}
    steps = {f.step for f, _ in found.values()}
    wrong = sorted(p for p, (f, _) in found.items() if f.part != p)
    if len(hashes) > 1 or steps != {step} or wrong:
        raise CommitConflict(f"fragments of step {step} disagree: steps {sorted(steps)}, config hashes "
                             f"{sorted(map(str, hashes))}, misnamed parts {wrong}")
    return found
