"""State trees <-> (JSON skeleton, tensor leaves). The only module that knows torch and numpy types.

A state is a nested structure of dicts, lists and tuples whose leaves are torch tensors, numpy
arrays or scalars, and JSON values. ``flatten`` turns it into a JSON skeleton where every array
leaf is replaced by ``{"__leaf__": i}``, plus the list of leaves; ``unflatten`` is the inverse.
The skeleton is plain JSON, so a checkpoint never needs pickle to load and loading one never runs
code. Tags keep the encoding unambiguous:

    tuple            {"__tuple__": [...]}
    non-str-key dict {"__items__": [[key, value], ...]}   (optimizer state is keyed by int)
    NaN / +-inf      {"__float__": "nan" | "inf" | "-inf"}
    a str-key dict that uses one of these tag names as a key is stored as __items__ too.

``snapshot`` copies every leaf into a host ``uint8`` buffer (one copy from any device or layout),
which is what a save encodes and what the writer keeps as the base for the next delta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import CorruptCheckpoint, UnsupportedState

_TAGS = ("__leaf__", "__tuple__", "__items__", "__float__")


@dataclass(frozen=True)
class LeafSpec:
    """What a leaf is, independent of where its bytes are."""

    path: str  # human-readable location, e.g. "optimizer/state/0/exp_avg"
    kind: str  # "torch" | "numpy" | "npscalar"
    dtype: str  # torch: "float32", "bfloat16", ...; numpy: dtype.str, e.g. "<f4"
    shape: tuple[int, ...]
    nbytes: int
    itemsize: int

    @property
    def is_float(self) -> bool:
        """Real floating point elements (what sparse deltas may map to ordered integers)."""
        if self.kind == "torch":
            return self.dtype in ("float16", "bfloat16", "float32", "float64")
        return np.dtype(self.dtype).kind == "f"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "dtype": self.dtype,
                "shape": list(self.shape), "nbytes": self.nbytes, "itemsize": self.itemsize}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LeafSpec":
        return cls(d["path"], d["kind"], d["dtype"], tuple(d["shape"]), int(d["nbytes"]), int(d["itemsize"]))


def flatten(state: Any) -> tuple[Any, list[tuple[LeafSpec, Any]]]:
    """(skeleton, [(spec, leaf object)]) in a deterministic order."""
    leaves: list[tuple[LeafSpec, Any]] = []

    def walk(obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int) and not isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return add_leaf(_torch_spec(obj, path), obj)
        if isinstance(obj, np.ndarray):
            return add_leaf(_numpy_spec(obj, path, "numpy"), obj)
        if isinstance(obj, np.generic):
            return add_leaf(_numpy_spec(np.asarray(obj), path, "npscalar"), np.asarray(obj))
        if isinstance(obj, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"__tuple__": [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            if all(isinstance(k, str) and k not in _TAGS for k in obj):
                return {k: walk(v, f"{path}/{k}") for k, v in obj.items()}
            return {"__items__": [[walk_key(k, path), walk(v, f"{path}/{k}")] for k, v in obj.items()]}
        raise UnsupportedState(
            f"cannot checkpoint {type(obj).__module__}.{type(obj).__qualname__} at '{path or '/'}': "
            "a state may hold dicts, lists, tuples, torch tensors, numpy arrays and scalars, and JSON "
            "values (None, bool, int, float, str). Convert it (e.g. call .state_dict(), or store "
            "bytes as a torch.uint8 tensor)."
        )

    def walk_key(key: Any, path: str) -> Any:
        if isinstance(key, (torch.Tensor, np.ndarray, dict, list)):
            raise UnsupportedState(f"dict key {key!r} at '{path or '/'}' is not a JSON scalar or tuple")
        return walk(key, f"{path}/<key>")

    def add_leaf(spec: LeafSpec, obj: Any) -> dict[str, int]:
        leaves.append((spec, obj))
        return {"__leaf__": len(leaves) - 1}

    return walk(state, ""), leaves


def _torch_spec(t: torch.Tensor, path: str) -> LeafSpec:
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise UnsupportedState(
            f"tensor at '{path}' has layout {t.layout}: only dense (strided) tensors can be "
            "checkpointed; convert it with .to_dense() first"
        )
    if t.dtype not in _TORCH_DTYPES.values():
        raise UnsupportedState(f"tensor at '{path}' has unsupported dtype {t.dtype}")
    dtype = str(t.dtype).removeprefix("torch.")
    return LeafSpec(path, "torch", dtype, tuple(t.shape), t.numel() * t.element_size(), t.element_size())


def _numpy_spec(a: np.ndarray, path: str, kind: str) -> LeafSpec:
    if a.dtype.kind not in "biufcmM" or a.dtype.fields is not None or a.dtype.subdtype is not None:
        raise UnsupportedState(
            f"numpy array at '{path}' has dtype {a.dtype}: only plain numeric and bool dtypes can be "
            "checkpointed (object and structured arrays would need pickle)"
        )
    return LeafSpec(path, kind, a.dtype.str, tuple(a.shape), a.nbytes, a.dtype.itemsize)


_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
)}


def copy_into(obj: Any, spec: LeafSpec, out: np.ndarray, non_blocking: bool = False) -> None:
    """Copy a leaf's bytes into ``out`` (uint8, spec.nbytes long). One copy from any device/layout.
    ``non_blocking`` (pinned ``out`` only): the caller synchronises the device before using ``out``."""
    if spec.nbytes == 0:
        return
    if spec.kind == "torch":
        dst = torch.from_numpy(out).view(obj.dtype).view(obj.shape)
        dst.copy_(obj.detach(), non_blocking=non_blocking and obj.is_cuda)
    else:
        out[:] = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)


def empty_leaf(spec: LeafSpec, device: str | torch.device = "cpu") -> tuple[Any, np.ndarray]:
    """A new leaf object for ``spec`` and a uint8 view of its memory to decode into (CPU)."""
    if spec.kind == "torch":
        try:
            dtype = _TORCH_DTYPES[spec.dtype]
        except KeyError:
            raise CorruptCheckpoint(f"unknown torch dtype {spec.dtype!r} for '{spec.path}'") from None
        t = torch.empty(spec.shape, dtype=dtype)
        raw = t.reshape(-1).view(torch.uint8).numpy() if spec.nbytes else np.empty(0, np.uint8)
        return t, raw
    try:
        a = np.empty(spec.shape, dtype=np.dtype(spec.dtype))
    except TypeError:
        raise CorruptCheckpoint(f"unknown numpy dtype {spec.dtype!r} for '{spec.path}'") from None
    return a, a.reshape(-1).view(np.uint8)


def finish_leaf(obj: Any, spec: LeafSpec, device: str | torch.device) -> Any:
    if spec.kind == "torch":
        return obj if str(device) == "cpu" else obj.to(device)
    if spec.kind == "npscalar":
        return obj[()]
    return obj


def unflatten(skeleton: Any, leaves: list[Any]) -> Any:
    """Inverse of flatten: rebuild the nested structure around the given leaf objects."""

    def build(node: Any) -> Any:
        if isinstance(node, list):
            return [build(v) for v in node]
        if isinstance(node, dict):
            if "__leaf__" in node:
                return leaves[node["__leaf__"]]
            if "__tuple__" in node:
                return tuple(build(v) for v in node["__tuple__"])
            if "__items__" in node:
                return {_hashable(build(k)): build(v) for k, v in node["__items__"]}
            if "__float__" in node:
                return float(node["__float__"])
            return {k: build(v) for k, v in node.items()}
        return node

    try:
        return build(skeleton)
    except (IndexError, KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpoint(f"malformed state skeleton in manifest ({e!r})") from None


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key
