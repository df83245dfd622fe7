"""Matching a destination state against a saved skeleton, for a restore in place (``into=``).

``bind_into`` walks the skeleton (through the grammar of ``ckptlib.tree``) beside the caller's
state and finds, for each saved leaf, the tensor or array of the destination that receives it;
every place where the destination holds an array the checkpoint cannot fill is a mismatch, and
all of them are reported at once before anything is written. A saved view of a storage
(``__view__``) is copied into its destination tensor once the storage is decoded
(``fill_aliases``): destinations that share memory are filled consistently, whatever their layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import CorruptCheckpoint
from .leaves import view_of
from .tree import MAX_DEPTH, Node, Path, _Bad, _torch_types, decode_key, parse
from .types import TORCH_KINDS, LeafSpec, View

# (new leaf index, the leaf it is filled from, the destination, the view of that leaf or None)
Alias = tuple[int, int, Any, View | None]

_ABSENT = object()


def _is_array(obj: Any) -> bool:
    types = _torch_types()
    return type(obj) in (np.ndarray, bytearray) or (bool(types) and isinstance(obj, types[0]))


def _matches(obj: Any, spec: LeafSpec) -> str | None:
    """Why ``obj`` cannot receive leaf ``spec`` in place (None: it can)."""
    if spec.kind == "torch":
        types = _torch_types()
        if not types or not isinstance(obj, types[0]):
            return f"the checkpoint holds a torch tensor, the destination a {type(obj).__name__}"
        dtype = str(obj.dtype).removeprefix("torch.")
    elif spec.kind in ("numpy", "npscalar"):
        if type(obj) is not np.ndarray:
            return f"the checkpoint holds a numpy array, the destination a {type(obj).__name__}"
        dtype = obj.dtype.str
    else:
        if type(obj) is not bytearray:
            return f"the checkpoint holds {spec.kind}, the destination a {type(obj).__name__}"
        return None if len(obj) == spec.nbytes else f"{len(obj)} bytes in the destination, {spec.nbytes} saved"
    return _same_layout(dtype, tuple(obj.shape), spec.dtype, spec.shape)


def _same_layout(dtype: str, shape: tuple, saved_dtype: str, saved_shape: tuple) -> str | None:
    problems = []
    if dtype != saved_dtype:
        problems.append(f"dtype {dtype} in the destination, {saved_dtype} saved")
    if shape != saved_shape:
        problems.append(f"shape {list(shape)} in the destination, {list(saved_shape)} saved")
    return "; ".join(problems) or None


def _arrays_in(obj: Any, path: str, depth: int = 0) -> list[str]:
    """Paths of the arrays inside ``obj`` (what a destination expects the checkpoint to fill)."""
    if _is_array(obj):
        return [path or "/"]
    if depth > MAX_DEPTH:
        return []
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _arrays_in(v, f"{path}/{k}", depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in _arrays_in(v, f"{path}/{i}", depth + 1)]
    return []


def _child(obj: Any, key: Any) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, _ABSENT)
    if isinstance(obj, (list, tuple)) and isinstance(key, int) and 0 <= key < len(obj):
        return obj[key]
    return _ABSENT


class _Binder:
    """One ``bind_into``: destinations found, aliases made, mismatches seen."""

    def __init__(self, specs: list[LeafSpec]):
        self.specs = specs
        self.dest: dict[int, Any] = {}
        self.aliases: list[Alias] = []
        self.view_dest: dict[View, tuple[int, Any]] = {}  # a saved view -> (its new leaf, the destination)
        self.mismatches: list[str] = []
        self.count = len(specs)

    def extras(self, obj: Any, seen: set, path: Path) -> None:
        if isinstance(obj, dict):
            items = [(k, v) for k, v in obj.items() if k not in seen]
        elif isinstance(obj, (list, tuple)):
            items = [(i, v) for i, v in enumerate(obj) if i not in seen]
        else:
            return
        for k, v in items:
            for p in _arrays_in(v, str(path.child(k))):
                self.mismatches.append(f"{p}: the destination holds an array the checkpoint does not have")

    def walk(self, node: Any, obj: Any, path: Path) -> Any:
        try:
            n = parse(node)
        except _Bad:
            return node  # unflatten reports it
        if n.kind in ("leaf", "ref"):
            return self.leaf(n, node, obj, path)
        if n.kind == "view":
            return self.view(n.value, node, obj, path)
        if n.kind == "attrs":
            return Node("attrs", attrs=n.attrs, inner=self.walk(n.inner, obj, path)).json()
        if n.kind in ("list", "tuple"):
            items = tuple(self.walk(x, _child(obj, i), path.child(i)) for i, x in enumerate(n.items))
            self.extras(obj, set(range(len(n.items))), path)
            return Node(n.kind, items=items).json()
        if n.kind in ("dict", "items", "map"):
            return self.keyed(n, obj, path)
        if _is_array(obj):
            what = n.kind if n.kind != "scalar" else type(node).__name__
            self.mismatches.append(f"{path}: the destination holds an array, the checkpoint a {what}")
        return node

    def keyed(self, n: Node, obj: Any, path: Path) -> Any:
        pairs, seen = [], set()
        for k, v in n.items:
            try:
                key = k if n.kind == "dict" else decode_key(k)
            except (CorruptCheckpoint, TypeError):
                pairs.append((k, v))  # unflatten reports it
                continue
            seen.add(key)
            pairs.append((k, self.walk(v, _child(obj, key), path.child(key))))
        before = len(self.mismatches)
        self.extras(obj, seen, path)
        why = _keyed_otherwise(seen, obj) if len(self.mismatches) > before else None
        if why:  # one cause, said once, rather than a mismatch for each tensor below
            self.mismatches[before:] = [f"{path}: {why}"]
        return Node(n.kind, n.value, tuple(pairs), n.attrs).json()

    def leaf(self, n: Node, node: Any, obj: Any, path: Path) -> Any:
        i = n.value
        if not 0 <= i < len(self.specs) or obj is _ABSENT or not _is_array(obj):
            return node  # out of range: unflatten reports it; no array here: allocated anew
        why = _matches(obj, self.specs[i])
        if why:
            self.mismatches.append(f"{path}: {why}")
            return node
        if i not in self.dest:
            self.dest[i] = obj
            return {"__leaf__": i}
        if self.dest[i] is obj:
            return node
        return self.alias(i, obj, None)

    def alias(self, source: int, obj: Any, view: View | None) -> dict[str, int]:
        self.aliases.append((self.count, source, obj, view))
        self.count += 1
        return {"__leaf__": self.count - 1}

    def view(self, v: View, node: Any, obj: Any, path: Path) -> Any:
        s = v.storage
        if obj is _ABSENT or not _is_array(obj) or not 0 <= s < len(self.specs) or \
                self.specs[s].kind != "storage" or v.end > self.specs[s].nbytes:
            return node  # no array here: built anew; a malformed view: unflatten reports it
        types = _torch_types()
        if not isinstance(obj, types[0]):
            self.mismatches.append(f"{path}: the checkpoint holds a torch tensor, the destination a {type(obj).__name__}")
            return node
        why = _same_layout(str(obj.dtype).removeprefix("torch."), tuple(obj.shape), v.dtype, v.shape)
        if why:
            self.mismatches.append(f"{path}: {why}")
            return node
        known = self.view_dest.get(v)
        if known is not None and known[1] is obj:
            return {"__ref__": known[0]}
        new = self.alias(s, obj, v)
        self.view_dest.setdefault(v, (new["__leaf__"], obj))
        return new


def _keyed_otherwise(saved: set, obj: Any) -> str | None:
    """Why a destination dict cannot take the saved one, when one numbers its entries and the other
    names them: an optimizer's ``opt.state_dict()`` (parameters 0, 1, ...) against the state of
    ``get_state_dict`` (parameter names, as FSDP2 and every other layout has them)."""
    if not isinstance(obj, dict) or not saved or not obj or saved & obj.keys():
        return None
    numbered = [all(isinstance(k, int) for k in keys) for keys in (saved, obj.keys())]
    named = [all(isinstance(k, str) for k in keys) for keys in (saved, obj.keys())]
    if not (numbered[0] and named[1]) and not (named[0] and numbered[1]):
        return None
    how = ("by number, the destination by name" if numbered[0] else "by name, the destination by number")
    return (f"the checkpoint keys these entries {how} ({sorted(saved, key=str)[0]!r} against "
            f"{sorted(obj, key=str)[0]!r}): an optimizer's opt.state_dict() numbers its parameters, "
            "get_state_dict(model, opt) (torch.distributed.checkpoint.state_dict) names them; restore "
            "into the kind of state that was saved, and save get_state_dict's to restore into FSDP2, DDP "
            "or another world size alike (docs/distributed.md)")


def bind_into(skeleton: Any, specs: list[LeafSpec], into: Any) -> tuple[Any, dict[int, Any], list[Alias], list[str]]:
    """Match a destination state ``into`` against a saved skeleton, for a restore in place.

    Returns (skeleton, destinations, aliases, mismatches): ``destinations`` maps a leaf index to
    the tensor/array of ``into`` that receives it (a saved leaf with no array at its place in
    ``into`` is allocated anew, like any other value that is replaced); ``aliases`` lists leaves
    saved tied (``__ref__``) whose destinations are distinct objects, and views of a storage
    (``__view__``) that have a destination, as (new leaf index, source leaf, destination, view or
    None), with the returned skeleton naming the new index there (``fill_aliases`` fills them);
    ``mismatches``
    lists every place where ``into`` holds an array the checkpoint cannot fill: a different dtype,
    shape or type, or no saved value at all."""
    binder = _Binder(specs)
    new_skeleton = binder.walk(skeleton, into, Path())
    return new_skeleton, binder.dest, binder.aliases, binder.mismatches


def fill_aliases(aliases: list[Alias], objects: Mapping[int, Any], specs: list[LeafSpec], leaves: list[Any]) -> None:
    """Copy each alias's source (a decoded leaf, or its view of a decoded storage) into its
    destination, and place the destination at the alias's index of ``leaves``."""
    for j, source, obj, view in aliases:
        src = objects[source]
        if view is not None:
            src = view_of(src, view)
        if specs[source].kind in TORCH_KINDS:
            obj.detach().copy_(src.detach().to(obj.device))
        else:
            obj[...] = src
        leaves[j] = obj
