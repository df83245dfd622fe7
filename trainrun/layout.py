"""A training run in its store: the names of its parts, its keys beside ckptlib's, run ids, finding runs.

A run lives at ``<store>/<run id>`` (a ckptlib store root, ``docs/format.md``). Its cut has one part
per shard, ``shard-<i>``, and the coordinator's, ``coordinator`` (``docs/run-layout.md``). Beside
ckptlib's keys (manifests, fragments, chunks, fences, heartbeats, validations, reports) a run holds::

    chaos/<part>.r<round>.a<attempt>.json   a chaos strike (put-if-absent: each spec strikes once)
    recoveries/<round>/<part>.g<gen>.a<attempt>.json   what a shard's recovery cost (trainrun.recovery)
    watchdog/run-dead-<id>.json             the first watchdog that found the coordinator silent

A run is a prefix holding ``manifests/`` (committed checkpoints) or ``heartbeats/`` (a run that has
started and not committed yet); ``find_runs`` is the one way to find them. Every command and flow
checks run ids with ``check_run_id``.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no import at run time: the CLI and the form check run ids without loading ckptlib
    from ckptlib.store import Store

COORDINATOR = "coordinator"
SHARD_PREFIX = "shard-"
_SHARD = re.compile(r"^shard-(\d+)$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
RUN_MARKERS = ("manifests", "heartbeats")
# How deep find_runs looks below a store root for runs (``<root>/<team>/<run id>`` is depth 2).
MAX_RUN_DEPTH = 3


def shard_part(shard: int) -> str:
    return f"{SHARD_PREFIX}{shard}"


def shard_index(part: str) -> int | None:
    """``3`` for ``"shard-3"``; None for any other part (the coordinator)."""
    m = _SHARD.match(part)
    return int(m.group(1)) if m else None


def run_parts(shards: int) -> list[str]:
    """Every part of a cut of a run with ``shards`` shards, coordinator first."""
    return [COORDINATOR] + [shard_part(i) for i in range(shards)]


def strike_key(part: str, round_no: int, attempt: int) -> str:
    return f"chaos/{part}.r{round_no}.a{attempt}.json"


def recovery_key(round_no: int, part: str, generation: int, attempt: int) -> str:
    return f"recoveries/{round_no}/{part}.g{generation}.a{attempt}.json"


def run_dead_key(ident: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in str(ident))[:100]
    return f"watchdog/run-dead-{safe}.json"


# --- run ids and URLs -----------------------------------------------------------------------------

def check_run_id(run_id: str) -> str:
    """``run_id`` if it is a valid run id, else ValueError naming the rule (no '/', no '..')."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id) or run_id in (".", ".."):
        raise ValueError(f"run id {run_id!r} must be 1-128 letters, digits, '_', '.' or '-', starting with a "
                         "letter or digit (it names a folder directly under the store)")
    return run_id


def new_run_id() -> str:
    """Date and time plus a short random suffix, e.g. ``20261130-142501-3fa2c1``."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def store_url(store: str) -> str:
    """A URL as given; a local path made absolute (every process and worker then sees the same)."""
    if "://" in store:
        return store.rstrip("/") or store
    return os.path.abspath(os.path.expanduser(store))


def run_url(store: str, run_id: str) -> str:
    """``<store>/<run_id>`` (see ``store_url``); the run id is checked first."""
    return f"{store_url(store).rstrip('/')}/{check_run_id(run_id)}"


def run_name(url: str) -> str:
    """The last path component of a run's URL (its run id when it follows the layout)."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def child_url(root_url: str, prefix: str) -> str:
    return root_url if not prefix else f"{root_url.rstrip('/')}/{prefix}"


# --- finding runs ---------------------------------------------------------------------------------

def find_runs(store: Store, *, max_depth: int = MAX_RUN_DEPTH) -> list[str]:
    """The prefixes of the runs at or under ``store``'s root, sorted ('' = the root is a run).

    One folder listing per folder visited: the root, each folder above a run, each run. A run's own
    folders are not looked into; folders deeper than ``max_depth`` below the root are not either."""
    found: list[str] = []

    def walk(at: Store, prefix: str, depth: int) -> None:
        names = at.list_dirs("")
        if any(name in RUN_MARKERS for name in names):
            found.append(prefix)
            return
        if depth >= max_depth:
            return
        for name in names:
            if not name.startswith("."):
                walk(at.child(name), f"{prefix}/{name}" if prefix else name, depth + 1)

    walk(store, "", 0)
    return sorted(found)
