"""Strict structural equality for restored states: exact types, bits, layouts, attributes, ties.

``differences(expected, actual)`` returns a list of human-readable differences ([] when the two are
the same value in every way a checkpoint promises to keep):

* ``type(a) is type(b)`` at every node (an ``int`` is not a ``bool``, an ``OrderedDict`` is not a
  ``dict``, a ``Parameter`` is not a ``Tensor``, ``np.float64`` is not ``float``);
* dicts (and OrderedDict/defaultdict/Counter): the same keys *in the same order*, keys compared
  strictly too, ``default_factory``, and instance attributes (``_metadata`` of a state_dict);
* floats, complex numbers, numpy scalars, tensors and arrays compared by their bits (NaN payloads,
  -0.0, inf);
* tensors: dtype, shape, strides (unless ``strides=False``), requires_grad, device, Python attributes;
* numpy arrays: dtype including byte order, shape, strides (Fortran order), bytes;
* torch tensors that are one object in ``expected`` are one object in ``actual`` and vice versa.

No ckptlib import: the comparison must not depend on the code under test.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

import numpy as np

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def _float_bits(x: float) -> str:
    return struct.pack(">d", x).hex()


def _tensor_bytes(t: Any) -> bytes:
    t = t.detach().cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return bytes(t.view(torch.uint8).numpy().tobytes())


def _np_bytes(a: Any) -> bytes:
    """The significant bytes of a numpy array or scalar, in C order. x87 long doubles (float128,
    complex256 on x86-64) hold 10 significant bytes in 16: their padding is whatever the last
    computation left there, so it is not part of the value."""
    arr = np.ascontiguousarray(a)
    kind, size = arr.dtype.kind, arr.dtype.itemsize
    if kind in "fc" and np.finfo(arr.dtype).nmant == 63 and size in (16, 32):
        rows = arr.reshape(-1).view(np.uint8).reshape(-1, 16)
        lo = slice(0, 10) if arr.dtype.byteorder in "<=|" else slice(6, 16)
        return rows[:, lo].tobytes()
    return arr.tobytes()


def _set_key(x: Any) -> tuple:
    return (type(x).__name__, repr(x))


def differences(expected: Any, actual: Any, *, strides: bool = True, max_report: int = 20) -> list[str]:
    out: list[str] = []

    def note(path: str, why: str) -> None:
        if len(out) < max_report:
            out.append(f"{path or '/'}: {why}")

    def cmp(a: Any, b: Any, path: str, depth: int = 0) -> None:
        if depth > 200:
            note(path, "too deep to compare")
            return
        ta, tb = type(a), type(b)
        if ta is not tb:
            note(path, f"type {ta.__module__}.{ta.__qualname__} expected, got {tb.__module__}.{tb.__qualname__}")
            return
        if a is None or ta in (bool, str, bytes, bytearray, range):
            if a != b:
                note(path, f"{a!r:.80} expected, got {b!r:.80}")
            return
        if ta is int:
            if a != b:
                note(path, f"{a} expected, got {b}")
            return
        if ta is float:
            if _float_bits(a) != _float_bits(b):
                note(path, f"float {a!r} ({_float_bits(a)}) expected, got {b!r} ({_float_bits(b)})")
            return
        if ta is complex:
            if (_float_bits(a.real), _float_bits(a.imag)) != (_float_bits(b.real), _float_bits(b.imag)):
                note(path, f"complex {a!r} expected, got {b!r}")
            return
        if isinstance(a, np.generic):
            if a.dtype.str != b.dtype.str or _np_bytes(a) != _np_bytes(b):
                note(path, f"numpy scalar {a!r} ({a.dtype.str}) expected, got {b!r} ({b.dtype.str})")
            return
        if ta is np.ndarray:
            if a.dtype.str != b.dtype.str:
                note(path, f"dtype {a.dtype.str} expected, got {b.dtype.str}")
            elif a.shape != b.shape:
                note(path, f"shape {a.shape} expected, got {b.shape}")
            elif strides and a.strides != b.strides:
                note(path, f"strides {a.strides} expected, got {b.strides}")
            elif _np_bytes(a) != _np_bytes(b):
                note(path, "array bytes differ")
            return
        if torch is not None and isinstance(a, torch.Tensor):
            cmp_tensor(a, b, path)
            return
        if torch is not None and ta in (torch.Size, torch.dtype, torch.device):
            if a != b or str(a) != str(b):
                note(path, f"{a!r} expected, got {b!r}")
            return
        if isinstance(a, dict):
            ka, kb = list(a.keys()), list(b.keys())
            if len(ka) != len(kb):
                note(path, f"keys {ka!r:.200} expected, got {kb!r:.200}")
                return
            for i, ((x, va), (y, vb)) in enumerate(zip(a.items(), b.items())):
                before = len(out)
                cmp(x, y, f"{path}/<key {i}>", depth + 1)
                if len(out) > before:
                    return
                cmp(va, vb, f"{path}/{x}", depth + 1)
            if ta is collections.defaultdict and a.default_factory is not b.default_factory:
                note(path, f"default_factory {a.default_factory!r} expected, got {b.default_factory!r}")
            cmp_attrs(a, b, path, depth)
            return
        if ta in (list, tuple):
            if len(a) != len(b):
                note(path, f"length {len(a)} expected, got {len(b)}")
                return
            for i, (x, y) in enumerate(zip(a, b)):
                cmp(x, y, f"{path}/{i}", depth + 1)
            return
        if ta in (set, frozenset):
            sa, sb = sorted(a, key=_set_key), sorted(b, key=_set_key)
            if len(sa) != len(sb):
                note(path, f"{len(sa)} items expected, got {len(sb)}")
                return
            for i, (x, y) in enumerate(zip(sa, sb)):
                cmp(x, y, f"{path}/<item {i}>", depth + 1)
            return
        if a != b:
            note(path, f"{a!r:.80} expected, got {b!r:.80} (compared with ==)")

    def cmp_attrs(a: Any, b: Any, path: str, depth: int) -> None:
        va, vb = getattr(a, "__dict__", {}), getattr(b, "__dict__", {})
        if list(va) != list(vb):
            note(path, f"attributes {sorted(va)} expected, got {sorted(vb)}")
            return
        for name in va:
            cmp(va[name], vb[name], f"{path}/.{name}", depth + 1)

    def cmp_tensor(a: Any, b: Any, path: str) -> None:
        if a.dtype != b.dtype:
            note(path, f"dtype {a.dtype} expected, got {b.dtype}")
            return
        if tuple(a.shape) != tuple(b.shape):
            note(path, f"shape {tuple(a.shape)} expected, got {tuple(b.shape)}")
            return
        if strides and a.numel() > 1 and tuple(a.stride()) != tuple(b.stride()):
            note(path, f"strides {a.stride()} expected, got {b.stride()}")
        if a.requires_grad != b.requires_grad:
            note(path, f"requires_grad {a.requires_grad} expected, got {b.requires_grad}")
        if a.device != b.device:
            note(path, f"device {a.device} expected, got {b.device}")
        if a.layout != b.layout:
            note(path, f"layout {a.layout} expected, got {b.layout}")
        elif _tensor_bytes(a) != _tensor_bytes(b):
            note(path, "tensor bytes differ")
        cmp_attrs(a, b, path, 0)

    cmp(expected, actual, "")
    if not out:
        pa, pb = tie_pattern(expected), tie_pattern(actual)
        if pa != pb:
            out.append(f"tied tensors differ: expected groups {_groups(pa)}, got {_groups(pb)}")
    return out


def tensors_in_order(obj: Any, path: str = "", depth: int = 0) -> list[tuple[str, Any]]:
    """(path, tensor) for every torch tensor, in a deterministic walk (sets are not entered)."""
    if torch is not None and isinstance(obj, torch.Tensor):
        return [(path or "/", obj)]
    if depth > 200:
        return []
    found: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += tensors_in_order(v, f"{path}/{k}", depth + 1)
        for name, v in getattr(obj, "__dict__", {}).items():
            found += tensors_in_order(v, f"{path}/.{name}", depth + 1)
    elif isinstance(obj, (list, tuple)) and not (torch is not None and isinstance(obj, torch.Size)):
        for i, v in enumerate(obj):
            found += tensors_in_order(v, f"{path}/{i}", depth + 1)
    return found


def tie_pattern(obj: Any) -> list[tuple[str, str]]:
    """For each tensor (by walk order): (its path, the path of the first tensor that is the same object)."""
    first: dict[int, str] = {}
    pattern = []
    for p, t in tensors_in_order(obj):
        pattern.append((p, first.setdefault(id(t), p)))
    return pattern


def _groups(pattern: list[tuple[str, str]]) -> list[list[str]]:
    g: dict[str, list[str]] = {}
    for p, root in pattern:
        g.setdefault(root, []).append(p)
    return [v for v in g.values() if len(v) > 1]


def assert_same(expected: Any, actual: Any, **kw: Any) -> None:
    diffs = differences(expected, actual, **kw)
    assert not diffs, "restored state differs:\n  " + "\n  ".join(diffs)

