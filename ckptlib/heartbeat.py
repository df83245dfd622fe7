"""Heartbeats of a shard attempt: liveness and progress, written from inside the training loop.

Who calls what
--------------
The training loop of one shard attempt (docs/watchdog.md)::

    hb = Heartbeat(store, "shard-1", generation=g, round=3, steps_per_round=200, every_s=2.0)
    hb.start(step=data_position)          # first beat; FencedError if generation g is not live
    for _ in range(h):
        loss = workload.train_step()
        hb.beat(step=workload.data_position, loss=loss)   # writes at most every `every_s` seconds
    hb.finish("finished")                 # final beat with a status (also "failed", "fenced")

A watchdog (or a progress display) reads them with ``read_heartbeats(store)``. Nothing here knows
Prefect; an ``on_beat`` callback may forward each beat elsewhere (e.g. a Prefect event).

Guarantees
----------
* Beats come from the caller's thread: a loop that hangs stops beating even if its process lives.
  There is deliberately no timer thread.
* Every written beat (not every ``beat`` call) checks the fence first: when a newer generation of
  the part exists, ``beat`` raises ``FencedError`` without writing, and the attempt must stop. Its
  final beat (``finish``) is not stored either once the live generation beats under the same key,
  so a zombie never hides the live attempt's progress from a watchdog. Between two writes a
  fenced attempt keeps training for at most ``every_s`` seconds; its fragment is never taken by the
  coordinator anyway (``commit.gather`` takes the live generation only).
* A beat that cannot be written (a transient store error) is logged and skipped: missing beats
  make the watchdog suspicious, which is the right reaction to a store we cannot reach.

Document ``heartbeats/<part>.json`` (JSON, replaced on every beat; ``Beat`` is its typed view)::

    {"format": 1, "part": "shard-1", "generation": 0, "round": 3, "step": 612, "round_step": 12,
     "steps_per_round": 200, "status": "running", "time": 1764466000.12, "started": 1764465990.0,
     "beats": 5, "host": "node-7", "pid": 4242, "attempt": 1, "loss": 2.31, "error": null, "meta": {...}}

``time``/``started`` are Unix wall times (seconds); ``step`` is the shard's inner step count (its data
position), ``round_step`` the steps done in this round (both null while the attempt still loads its state);
``status`` is running | finished | failed | fenced; ``loss`` the running mean loss of the round
(or null); ``error`` says why a final beat is failed or fenced. ``meta`` belongs to the caller (a
training run keeps what a watchdog needs there). A beat that does not parse, or is larger than
``HEARTBEAT_MAX_BYTES`` (4 MiB: refused unread), is read as no beat (logged): it cannot say when
its writer lived.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from . import commit
from .documents import Document, DocumentError
from .errors import FencedError, ObjectNotFound, StoreError
from .store import Store

log = logging.getLogger("ckptlib.heartbeat")

HEARTBEAT_FORMAT = 1
# A beat is a few KiB (a coordinator's meta holds the run's spec and its cut: O(shards) names); a
# larger one was not written here and is refused unread (docs/format.md, "Caps").
HEARTBEAT_MAX_BYTES = 4 << 20
MAX_WORLD = 1 << 16  # ranks a group's beats may name (as ckptlib.distributed.documents.MAX_WORLD)
Status = Literal["running", "finished", "failed", "fenced"]
STATUSES: tuple[Status, ...] = ("running", "finished", "failed", "fenced")


def heartbeat_key(part: str, rank: int | None = None) -> str:
    """``heartbeats/<part>.json``: the part's beat (rank 0 of a group beats here too); another rank
    ``r`` of a group's part beats under ``heartbeats/ranks/<part>/<r>.json``."""
    if rank:
        return f"heartbeats/ranks/{commit.check_part_name(part)}/{int(rank)}.json"
    return f"heartbeats/{commit.check_part_name(part)}.json"


@dataclass(frozen=True)
class Beat(Document):
    """One beat of one attempt of a part: ``heartbeats/<part>.json`` (format in the module docstring)."""

    KIND = "heartbeat"
    FORMAT = HEARTBEAT_FORMAT
    MAX_BYTES = HEARTBEAT_MAX_BYTES

    part: str
    generation: int
    round: int
    status: Status
    time: float  # wall time of this beat
    started: float  # wall time the attempt started
    step: int | None = None
    round_step: int | None = None
    steps_per_round: int | None = None
    beats: int = 1
    host: str = ""
    pid: int | None = None
    attempt: int | None = None
    loss: float | None = None
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None  # the rank of a group's part (None: a part trained by one process)

    def age(self, now: float) -> float:
        """Seconds since this beat, on the reader's clock (clocks across machines must agree)."""
        return now - self.time


class Heartbeat:
    """Writes ``heartbeats/<part>.json`` every ``every_s`` seconds of a training loop; checks the fence."""

    def __init__(self, store: Store, part: str, *, generation: int, round: int, steps_per_round: int | None = None,
                 every_s: float = 2.0, attempt: int | None = None, meta: dict[str, Any] | None = None,
                 on_beat: Callable[[Beat], None] | None = None, rank: int | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic):
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}: a beat every few seconds suits most runs")
        self.store = store
        self.part = commit.check_part_name(part)
        self.rank = rank
        self.key = heartbeat_key(part, rank)
        self.generation = int(generation)
        self.round = int(round)
        self.steps_per_round = steps_per_round
        self.every_s = float(every_s)
        self.attempt = attempt
        self.meta = dict(meta or {})
        self.on_beat = on_beat
        self._clock, self._monotonic = clock, monotonic
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._started = clock()
        self._last_write: float | None = None
        self._first_step: int | None = None
        self._step: int | None = None
        self._beats = 0
        self._loss_sum = 0.0
        self._loss_n = 0

    # --- the loop's calls ----------------------------------------------------------------------

    def start(self, step: int | None = None) -> Beat:
        """The first beat of the attempt (always written); raises FencedError when already fenced.
        ``step`` may be None while the attempt is still loading its state (the first ``beat`` sets it)."""
        if step is not None:
            self._first_step = self._step = int(step)
        return self._write("running")

    def beat(self, step: int, loss: float | None = None, *, force: bool = False) -> Beat | None:
        """Record progress; write (and check the fence) if ``every_s`` passed since the last write
        (or ``force``: now, e.g. when the caller changed ``round`` or ``meta``).

        Returns the beat when one was written, else None. Raises FencedError when fenced.
        """
        self._step = int(step)
        if self._first_step is None:
            self._first_step = int(step)
        if loss is not None:
            self._loss_sum += float(loss)
            self._loss_n += 1
        if not force and self._last_write is not None and self._monotonic() - self._last_write < self.every_s:
            return None
        return self._write("running")

    def rebase(self, origin: int) -> None:
        """Count round steps from step ``origin`` (an attempt that continues its round mid-way: its
        round steps start where the round did, not where the attempt did)."""
        self._first_step = int(origin)

    def finish(self, status: Status = "finished", *, loss: float | None = None, error: str | None = None) -> Beat:
        """The last beat of the attempt, with its final status. Never raises FencedError.

        Not stored when a newer generation already beats under the key (a fenced attempt never
        hides the live attempt's beat); the ``on_beat`` callback still gets it."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        stored = read_heartbeat(self.store, self.part, self.rank)
        newer = stored is not None and stored.generation > self.generation
        return self._write(status, check_fence=False, loss=loss, error=error, store=not newer)

    # --- internals -----------------------------------------------------------------------------

    def document(self, status: Status) -> Beat:
        """The beat this attempt would write now."""
        round_step = None if self._step is None or self._first_step is None else self._step - self._first_step
        return Beat(part=self.part, generation=self.generation, round=self.round, status=status,
                    time=self._clock(), started=self._started, step=self._step, round_step=round_step,
                    steps_per_round=self.steps_per_round, beats=self._beats + 1, host=self._host, pid=self._pid,
                    attempt=self.attempt, loss=self._loss_sum / self._loss_n if self._loss_n else None,
                    meta=dict(self.meta), rank=self.rank)

    def _write(self, status: Status, *, check_fence: bool = True, loss: float | None = None,
               error: str | None = None, store: bool = True) -> Beat:
        doc = self.document(status)
        if loss is not None or error is not None:
            doc = replace(doc, loss=doc.loss if loss is None else float(loss), error=error)
        self._last_write = self._monotonic()
        self._beats += 1
        data = doc.to_json()
        if len(data) > HEARTBEAT_MAX_BYTES:
            raise ValueError(f"the heartbeat of {self.part} would be {len(data)} bytes, more than the {HEARTBEAT_MAX_BYTES} "
                             "a reader accepts: keep its meta to what a watchdog needs (kilobytes)")
        if check_fence:  # before the write: a fenced attempt must not overwrite the live attempt's beat
            self.check_fence()
        if store:
            try:
                self.store.put(self.key, data)
            except StoreError as e:
                log.warning("heartbeat of %s could not be written to %s (%s); training goes on", self.part,
                            self.store.url, e)
        if self.on_beat is not None:
            try:
                self.on_beat(doc)
            except Exception as e:  # noqa: BLE001 - a forwarder must never stop training
                log.warning("heartbeat forwarder failed for %s: %s", self.part, e)
        return doc

    def check_fence(self) -> None:
        """Raise FencedError if a newer generation of this part exists (a transient error is not a fence)."""
        try:
            commit.check_live(self.store, self.part, self.generation)
        except FencedError:
            raise
        except StoreError as e:
            log.warning("could not read the fences of %s (%s); assuming still live", self.part, e)


def read_heartbeat(store: Store, part: str, rank: int | None = None) -> Beat | None:
    """The latest beat of ``part`` (of its rank ``rank``), or None if it never beat (or its document
    is unreadable: logged)."""
    try:
        return Beat.read(store, heartbeat_key(part, rank))
    except ObjectNotFound:
        return None
    except (DocumentError, StoreError) as e:
        log.warning("heartbeat of %s in %s ignored: %s", part, store.url, e)
        return None


def read_heartbeats(store: Store, *, threads: int = 1) -> dict[str, Beat]:
    """Every part's latest beat: ``{part: Beat}`` (unreadable ones left out, logged). One listing,
    then one read per part, ``threads`` at a time (a watchdog of a thousand shards on S3 reads them
    in parallel: each read is a round trip)."""
    parts = []
    for key in store.list("heartbeats/"):
        if key.count("/") != 1:
            continue  # heartbeats/ranks/...: the other ranks of groups (read_rank_heartbeats)
        name = key.rsplit("/", 1)[1]
        if name.endswith(".json"):
            try:
                parts.append(commit.check_part_name(name[: -len(".json")]))
            except ValueError:
                continue  # not a heartbeat this module wrote
    if threads > 1 and len(parts) > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(parts)), thread_name_prefix="ckpt-beats") as pool:
            beats = list(pool.map(lambda p: read_heartbeat(store, p), parts))
    else:
        beats = [read_heartbeat(store, p) for p in parts]
    return {b.part: b for b in beats if b is not None}


class RankBeats(dict[int, Beat]):
    """``{rank: Beat}`` of a group's part, and ``ignored``: how many beats under its ranks' folder are
    of no rank of its group (a rank beyond its world, or a name no rank writes), at most
    ``MAX_FOREIGN_COUNTED``: counted from names, never read."""

    ignored: int = 0


UNNAMED_WORLD = 1024  # ranks read of a group whose rank 0's beat names no world (read_rank_heartbeats)
MAX_FOREIGN_COUNTED = 100_000  # names listed to count foreign beats, at most (the listing stops there)


def read_rank_heartbeats(store: Store, part: str, world: int | None = None) -> RankBeats:
    """The latest beat of every rank of ``part`` that beat as a group: ``{rank: Beat}``, rank 0's
    from the part's own key (only when it carries a rank). Only ranks below the group's ``world``
    are read (None: the ``"ranks"`` its rank 0's beat names in ``meta``, as trainrun writes it;
    ``UNNAMED_WORLD`` without one), one read each; any other beat there is counted (``RankBeats.ignored``), not read:
    planted beats cost a name each, and at most ``MAX_FOREIGN_COUNTED`` of those."""
    found = RankBeats()
    first = read_heartbeat(store, part)
    if first is not None and first.rank is not None:
        found[0] = first
    if world is None:
        named = first.meta.get("ranks") if first is not None and first.rank is not None else None
        world = UNNAMED_WORLD
        if isinstance(named, int) and not isinstance(named, bool) and 1 <= named <= MAX_WORLD:
            world = named
    prefix = f"heartbeats/ranks/{commit.check_part_name(part)}/"
    ranks = set()
    for n, info in enumerate(store.scan(prefix)):
        if n >= MAX_FOREIGN_COUNTED + world:
            break
        name = info.key[len(prefix):]
        stem = name[: -len(".json")] if name.endswith(".json") else ""
        if stem.isdigit() and stem == str(int(stem)) and 0 < int(stem) < world:
            ranks.add(int(stem))
        else:
            found.ignored += 1
    for r in sorted(ranks):
        beat = read_heartbeat(store, part, r)
        if beat is not None:
            found[r] = beat
    return found
