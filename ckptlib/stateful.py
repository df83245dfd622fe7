"""Stateful objects in a state: saved through ``state_dict()``, restored through ``load_state_dict()``.

A *Stateful* is what ``torch.distributed.checkpoint`` takes as one (its ``Stateful`` protocol): any
object whose class has a ``state_dict()`` method - a model, an optimizer, an LR scheduler, a user
object. It may sit at any position of a state (a dict value or a list item, nested); containers are
walked, a Stateful's own state dict is not (what it returns is checked by the format like any
value, so an object inside it that the format refuses is refused with its path).

``expand`` replaces each Stateful by its state dict and remembers where it was; the checkpointer
saves or restores the plain tree, and ``load`` hands each restored subtree to its object's
``load_state_dict()``. Nothing is ever imported or called from what a store holds: the objects are
the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tree import MAX_DEPTH

Key = str | int
_ATOMS = frozenset({int, float, str, bool, bytes, type(None)})  # never Stateful: the walk skips them at once


@dataclass(frozen=True)
class Found:
    """One Stateful at ``path`` (dict keys and list positions) of a state."""

    path: tuple[Key, ...]
    obj: Any

    @property
    def name(self) -> str:
        return "/".join(map(str, self.path)) or "(the state itself)"


def is_stateful(obj: Any) -> bool:
    """Whether ``obj``'s class has a ``state_dict()`` method (a tensor, an array or a container has none)."""
    return callable(getattr(type(obj), "state_dict", None))


def expand(state: Any, *, loading: bool = False) -> tuple[Any, list[Found]]:
    """``state`` with every Stateful replaced by its ``state_dict()``, and where they were. Containers
    without a Stateful are returned as they are (no copy). ``loading``: the state is a restore's
    ``into``, so each Stateful must also have ``load_state_dict()`` (TypeError naming its path)."""
    found: list[Found] = []
    open_ids: set[int] = set()  # the containers being walked: a cycle or a too deep state is left as it is,
    # for the format to refuse with its own message
    verdicts: dict[type, bool] = {}  # per class: a state holds few classes and many values

    def walk(node: Any, at: Any, depth: int) -> Any:  # at: (parent's at, key), built cheaply, unrolled if found
        kind = type(node)
        if kind in _ATOMS or depth > MAX_DEPTH or id(node) in open_ids:
            return node
        if kind is dict or kind is list or kind is tuple:  # exact: the format refuses subclasses it does not know
            open_ids.add(id(node))
            out, changed = [], False
            for k, v in (node.items() if kind is dict else enumerate(node)):
                w = walk(v, (at, k), depth + 1)
                changed = changed or w is not v
                out.append((k, w))
            open_ids.discard(id(node))
            if not changed:
                return node
            return dict(out) if kind is dict else kind(w for _, w in out)
        stateful = verdicts.get(kind)
        if stateful is None:
            stateful = verdicts[kind] = is_stateful(node)
        if not stateful:
            return node
        path = _unroll(at)
        if loading and not callable(getattr(kind, "load_state_dict", None)):
            where = "/".join(map(str, path)) or "the state itself"
            raise TypeError(f"restore(into=...): {where} is a {kind.__name__}, which has state_dict() but no "
                            f"load_state_dict(), so it cannot be restored in place: give it a load_state_dict(sd) "
                            f"method, or pass its state_dict() and use the returned values yourself")
        found.append(Found(path, node))
        return node.state_dict()

    return walk(state, None, 0), found


def _unroll(at: Any) -> tuple[Key, ...]:
    keys = []
    while at is not None:
        at, key = at
        keys.append(key)
    return tuple(reversed(keys))


def check_selected(found: list[Found], select: list[str] | None) -> list[Found]:
    """The Statefuls a restore with ``select`` ('/'-paths) restores whole; ValueError for one it would
    restore only in part (``load_state_dict`` would get half a state)."""
    if select is None:
        return found
    wanted = [tuple(p for p in s.split("/") if p) for s in select]
    chosen = []
    for f in found:
        path = tuple(map(str, f.path))
        if any(path[:len(w)] == w for w in wanted):
            chosen.append(f)
        elif any(w[:len(path)] == path for w in wanted):
            raise ValueError(f"select={select} picks part of the Stateful {type(f.obj).__name__} at {f.name}, whose "
                             f"load_state_dict() needs all of it: select {f.name!r} whole, or pass its state_dict() "
                             f"in into= instead of the object")
    return chosen


def load(found: list[Found], restored: Any) -> None:
    """Hand each Stateful the subtree of ``restored`` at its path (its values checked by the restore)."""
    for f in found:
        node = restored
        for key in f.path:
            node = node[key]
        f.obj.load_state_dict(node)
