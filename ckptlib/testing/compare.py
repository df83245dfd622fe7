"""One definition of "the same state", with its strictness as a parameter.

``differences(expected, actual)`` walks two states side by side and returns what differs, one line
per difference (``"<path>: <what> expected, got <what>"``), [] when they are the same;
``first_difference`` is the first of them or None; ``assert_same_state`` raises AssertionError
listing them. Two strictnesses:

``exact_types=True`` (the default): what ckptlib promises of its own restores (the README's table
of what is kept exactly).

* ``type(a) is type(b)`` at every node: an ``int`` is not a ``bool``, an ``OrderedDict`` is not a
  ``dict``, a ``Parameter`` is not a ``Tensor``, ``np.float64`` is not ``float``, a list is not a
  tuple;
* dicts: the same keys in the same order (keys compared as strictly as values), ``default_factory``
  of a ``defaultdict``, instance attributes (a ``state_dict``'s ``_metadata``);
* floats, complex numbers and numpy scalars by their bits (NaN payloads, -0.0, inf);
* tensors: dtype, shape, strides (of tensors with more than one element), ``requires_grad``,
  device, layout, the lazy conjugate/negative bits, Python attributes and the bytes; numpy arrays:
  dtype with byte order, shape, strides (Fortran order) and the bytes;
* tensors that are one object in ``expected`` are one object in ``actual``, and the other way round;
  tensors that share a storage in one share it in the other, at the same byte distances.

``exact_types=False``: the data, whatever carries it: what a checkpointer that loads into tensors
the caller allocated (DCP) or rebuilds plain containers can keep. The benchmark judges every
system's restore with it.

* any ``dict`` equals any ``dict`` (``OrderedDict``, ``defaultdict``, ...) with the same keys, in any
  order, and the same values; factories and attributes aside;
* tensors: dtype, shape and the bytes (their class, ``requires_grad``, strides, device and
  attributes aside); arrays: dtype, shape and the bytes (strides aside); ties aside;
* everything else as above: a list is not a tuple, an int is not a float, floats by their bits.

``loose(expected, actual)`` (``assert_same_state``, ``differences``): return True where a type
difference is allowed (e.g. what an old format could not keep); the values are still compared.

Nothing here imports torch or numpy: a state that holds their objects has imported them already.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["assert_same_state", "differences", "first_difference", "storage_pattern", "tie_pattern"]

LIMIT = 20  # differences reported at most
MAX_DEPTH = 200  # deeper than any state ckptlib saves (100 levels)
Loose = Callable[[Any, Any], bool]


def differences(expected: Any, actual: Any, *, exact_types: bool = True, limit: int = LIMIT, path: str = "",
                loose: Loose | None = None) -> list[str]:
    """What differs between two states (see the module docstring), at most ``limit`` lines;
    [] when they are the same. ``path`` prefixes every location (e.g. ``"step 3"``)."""
    walk = _Walk(exact_types, limit, loose)
    walk.node(expected, actual, path, 0)
    if not walk.out and exact_types:
        pa, pb = tie_pattern(expected), tie_pattern(actual)
        if pa != pb:
            walk.out.append(f"{path or '/'}: tied tensors {_groups(pa)} expected, got {_groups(pb)}")
        else:
            sa, sb = storage_pattern(expected), storage_pattern(actual)
            if sa != sb:
                walk.out.append(f"{path or '/'}: tensors sharing a storage {_shared(sa)} expected, got {_shared(sb)}")
    return walk.out


def first_difference(expected: Any, actual: Any, *, exact_types: bool = True, path: str = "") -> str | None:
    """The first difference between two states, or None when they are the same."""
    found = differences(expected, actual, exact_types=exact_types, limit=1, path=path)
    return found[0] if found else None


def assert_same_state(expected: Any, actual: Any, path: str = "", *, exact_types: bool = True,
                      loose: Loose | None = None) -> None:
    """Raise AssertionError listing the differences of ``actual`` from ``expected``, if any."""
    found = differences(expected, actual, exact_types=exact_types, path=path, loose=loose)
    if found:
        raise AssertionError("states differ:\n  " + "\n  ".join(found))


def tie_pattern(state: Any) -> list[tuple[str, str]]:
    """For each tensor, in walk order: (its path, the path of the first tensor that is the same object)."""
    first: dict[int, str] = {}
    return [(p, first.setdefault(id(t), p)) for p, t in _tensors_in_order(state, "", 0)]


def storage_pattern(state: Any) -> list[tuple[str, str, int]]:
    """For each tensor with elements, in walk order: (its path, the path of the first tensor that
    shares its storage, its first byte's distance from that tensor's first byte)."""
    first: dict[tuple, tuple[str, int]] = {}
    out = []
    for p, t in _tensors_in_order(state, "", 0):
        if t.numel() == 0:
            continue
        start = t.storage_offset() * t.element_size()
        root, root_start = first.setdefault((str(t.device), t.untyped_storage().data_ptr()), (p, start))
        out.append((p, root, start - root_start))
    return out


def _shared(pattern: list[tuple[str, str, int]]) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for p, root, at in pattern:
        groups.setdefault(root, []).append(f"{p}@{at}")
    return [g for g in groups.values() if len(g) > 1]


# --- the walk ------------------------------------------------------------------------------------


def _type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _float_bits(x: float) -> str:
    return struct.pack(">d", x).hex()


class _Walk:
    """One comparison: the differences found so far, and a comparer per kind of node."""

    def __init__(self, exact_types: bool, limit: int, loose: Loose | None):
        self.exact, self.limit, self.loose = exact_types, limit, loose
        self.out: list[str] = []
        self.torch: Any = sys.modules.get("torch")  # None: no value can be a tensor
        self.np: Any = sys.modules.get("numpy")

    def note(self, path: str, why: str) -> None:
        if len(self.out) < self.limit:
            self.out.append(f"{path or '/'}: {why}")

    def kind(self, x: Any) -> str:
        """The comparer of ``x``: what kind of node it is, whatever its exact type."""
        torch, np = self.torch, self.np
        if torch is not None:
            if isinstance(x, torch.Tensor):
                return "tensor"
            if isinstance(x, (torch.Size, torch.dtype, torch.device)):
                return "torch_value"
        if np is not None:
            if isinstance(x, np.ndarray):
                return "array"
            if isinstance(x, np.generic):
                return "numpy_scalar"
        for kind, types in (("dict", dict), ("sequence", (list, tuple)), ("set", (set, frozenset)),
                            ("float", float), ("complex", complex)):
            if isinstance(x, types):
                return kind
        return "value"

    def node(self, a: Any, b: Any, path: str, depth: int) -> None:
        if len(self.out) >= self.limit:
            return
        if depth > MAX_DEPTH:
            self.note(path, "too deep to compare")
            return
        kind = self.kind(a)
        if kind != self.kind(b) or (type(a) is not type(b) and not self.may_differ(a, b, kind)):
            self.note(path, f"type {_type_name(type(a))} expected, got {_type_name(type(b))}")
            return
        getattr(self, "cmp_" + kind)(a, b, path, depth)

    def may_differ(self, a: Any, b: Any, kind: str) -> bool:
        """Whether ``a`` and ``b``, of one kind, may have different types."""
        return (not self.exact and kind in ("dict", "tensor", "array")) or bool(self.loose and self.loose(a, b))

    # --- leaves

    def cmp_value(self, a: Any, b: Any, path: str, depth: int) -> None:
        if a != b:
            self.note(path, f"{a!r:.80} expected, got {b!r:.80}")

    def cmp_float(self, a: float, b: float, path: str, depth: int) -> None:
        if _float_bits(a) != _float_bits(b):
            self.note(path, f"float {a!r} ({_float_bits(a)}) expected, got {b!r} ({_float_bits(b)})")

    def cmp_complex(self, a: complex, b: complex, path: str, depth: int) -> None:
        if (_float_bits(a.real), _float_bits(a.imag)) != (_float_bits(b.real), _float_bits(b.imag)):
            self.note(path, f"complex {a!r} expected, got {b!r}")

    def cmp_torch_value(self, a: Any, b: Any, path: str, depth: int) -> None:
        if a != b or str(a) != str(b):
            self.note(path, f"{a!r} expected, got {b!r}")

    def cmp_numpy_scalar(self, a: Any, b: Any, path: str, depth: int) -> None:
        if a.dtype.str != b.dtype.str or _numpy_bytes(a) != _numpy_bytes(b):
            self.note(path, f"numpy scalar {a!r} ({a.dtype.str}) expected, got {b!r} ({b.dtype.str})")

    def cmp_array(self, a: Any, b: Any, path: str, depth: int) -> None:
        if a.dtype.str != b.dtype.str:
            self.note(path, f"dtype {a.dtype.str} expected, got {b.dtype.str}")
        elif a.shape != b.shape:
            self.note(path, f"shape {a.shape} expected, got {b.shape}")
        elif self.exact and a.strides != b.strides:
            self.note(path, f"strides {a.strides} expected, got {b.strides}")
        elif _numpy_bytes(a) != _numpy_bytes(b):
            self.note(path, "array bytes differ")

    def cmp_tensor(self, a: Any, b: Any, path: str, depth: int) -> None:
        if a.dtype != b.dtype:
            self.note(path, f"dtype {a.dtype} expected, got {b.dtype}")
            return
        if tuple(a.shape) != tuple(b.shape):
            self.note(path, f"shape {tuple(a.shape)} expected, got {tuple(b.shape)}")
            return
        if self.exact:
            for what, x, y in (("strides", a.stride() if a.numel() > 1 else (), b.stride() if b.numel() > 1 else ()),
                               ("requires_grad", a.requires_grad, b.requires_grad), ("device", a.device, b.device),
                               ("conj bit", a.is_conj(), b.is_conj()), ("neg bit", a.is_neg(), b.is_neg())):
                if x != y:
                    self.note(path, f"{what} {x} expected, got {y}")
        if a.layout != b.layout:
            self.note(path, f"layout {a.layout} expected, got {b.layout}")
        elif not self.torch.equal(_tensor_bits(a), _tensor_bits(b)):
            self.note(path, "tensor bytes differ")
        if self.exact:
            self.attributes(a, b, path, depth)

    # --- containers

    def cmp_dict(self, a: dict, b: dict, path: str, depth: int) -> None:
        if not self.exact:
            if a.keys() != b.keys():
                only_a, only_b = (", ".join(sorted(map(repr, x.keys() - y.keys()))[:5]) or "-" for x, y in ((a, b), (b, a)))
                self.note(path, f"keys differ: only in expected {only_a}; only in actual {only_b}")
                return
            for k, v in a.items():
                self.node(v, b[k], f"{path}/{k}", depth + 1)
            return
        if len(a) != len(b):
            self.note(path, f"keys {list(a)!r:.200} expected, got {list(b)!r:.200}")
            return
        for i, ((x, va), (y, vb)) in enumerate(zip(a.items(), b.items())):
            before = len(self.out)
            self.node(x, y, f"{path}/<key {i}>", depth + 1)
            if len(self.out) > before:
                return
            self.node(va, vb, f"{path}/{x}", depth + 1)
        factories = getattr(a, "default_factory", None), getattr(b, "default_factory", None)
        if factories[0] is not factories[1]:
            self.note(path, f"default_factory {factories[0]!r} expected, got {factories[1]!r}")
        self.attributes(a, b, path, depth)

    def cmp_sequence(self, a: Any, b: Any, path: str, depth: int) -> None:
        if len(a) != len(b):
            self.note(path, f"length {len(a)} expected, got {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            self.node(x, y, f"{path}/{i}", depth + 1)

    def cmp_set(self, a: Any, b: Any, path: str, depth: int) -> None:
        if len(a) != len(b):
            self.note(path, f"{len(a)} items expected, got {len(b)}")
            return
        for i, (x, y) in enumerate(zip(sorted(a, key=_set_key), sorted(b, key=_set_key))):
            self.node(x, y, f"{path}/<item {i}>", depth + 1)

    def attributes(self, a: Any, b: Any, path: str, depth: int) -> None:
        va, vb = getattr(a, "__dict__", {}), getattr(b, "__dict__", {})
        if list(va) != list(vb):
            self.note(path, f"attributes {sorted(va)} expected, got {sorted(vb)}")
            return
        for name in va:
            self.node(va[name], vb[name], f"{path}/.{name}", depth + 1)


def _set_key(x: Any) -> tuple[str, str]:
    return (type(x).__name__, repr(x))


def _tensor_bits(t: Any) -> Any:
    """The bytes of a tensor's elements in C order, as a flat uint8 tensor on the CPU."""
    t = t.detach().cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def _numpy_bytes(a: Any) -> bytes:
    """The significant bytes of a numpy array or scalar, in C order. x87 long doubles (float128,
    complex256 on x86-64) hold 10 significant bytes in 16: their padding is whatever the last
    computation left there, so it is not part of the value."""
    import numpy as np

    arr = np.ascontiguousarray(a)
    kind, size = arr.dtype.kind, arr.dtype.itemsize
    if kind in "fc" and np.finfo(arr.dtype).nmant == 63 and size in (16, 32):
        rows = arr.reshape(-1).view(np.uint8).reshape(-1, 16)
        lo = slice(0, 10) if arr.dtype.byteorder in "<=|" else slice(6, 16)
        return rows[:, lo].tobytes()
    return arr.tobytes()


def _tensors_in_order(state: Any, path: str, depth: int) -> list[tuple[str, Any]]:
    """(path, tensor) for every torch tensor, in a deterministic walk (sets are not entered)."""
    torch = sys.modules.get("torch")
    if torch is None or depth > MAX_DEPTH:
        return []
    if isinstance(state, torch.Tensor):
        return [(path or "/", state)]
    found: list[tuple[str, Any]] = []
    if isinstance(state, dict):
        for k, v in state.items():
            found += _tensors_in_order(v, f"{path}/{k}", depth + 1)
        for name, v in getattr(state, "__dict__", {}).items():
            found += _tensors_in_order(v, f"{path}/.{name}", depth + 1)
    elif isinstance(state, (list, tuple)) and not isinstance(state, torch.Size):
        for i, v in enumerate(state):
            found += _tensors_in_order(v, f"{path}/{i}", depth + 1)
    return found


def _groups(pattern: list[tuple[str, str]]) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for p, root in pattern:
        groups.setdefault(root, []).append(p)
    return [g for g in groups.values() if len(g) > 1]
