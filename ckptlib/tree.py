"""State trees <-> (JSON skeleton, array leaves): every value comes back with its type, or is refused.

A state is a nested structure of containers and values. ``flatten`` turns it into a JSON
*skeleton* in which every array (torch tensor, numpy array, bytes) is replaced by
``{"__leaf__": i}``, plus the list of those leaves; ``unflatten`` is the inverse. The skeleton is
plain JSON and is decoded from a closed list of tags, so loading a checkpoint never imports or
runs anything. Dispatch is on the exact type: a subclass that is not listed (an ``IntEnum``, a
namedtuple, a ``np.memmap``) is refused with ``UnsupportedState`` naming its path, never saved as
its base class.

Node grammar (format 2; a superset of format 1's, so one decoder reads both)::

    null, true, false, "string", 12 (int), 1.5 (finite float: a JSON number with '.' or 'e')
    [..]                              list
    {"k": ..}                         dict whose keys are all str and none is a tag below
    {"__leaf__": i}                   array leaf i
    {"__ref__": i}                    the same tensor as leaf i (tied weights restore tied)
    {"__attrs__": [node, {name: node}]}   a tensor with Python attributes (``t.is_sparse_grad = True``)
    {"__tuple__": [..]}               tuple
    {"__items__": [[k, v], ..]}       dict with other keys (optimizer state is keyed by int)
    {"__map__": {"type": T, "items": [[k, v], ..], "attrs": {name: node}, "factory": F}}
                                      T: OrderedDict | defaultdict | Counter (attrs: e.g. the
                                      ``_metadata`` of a module's state_dict; F: a builtin factory)
    {"__float__": "nan" | "inf" | "-inf" | "<16 hex digits>"}   non-finite float (NaN payload kept)
    {"__complex__": [re, im]}         complex
    {"__set__": [..]}, {"__frozenset__": [..]}   in a canonical order (digests do not depend on hashing)
    {"__np__": [dtype, "<hex>"]}      numpy scalar (np.float32(0.5), np.int64(3), np.bool_, ...)
    {"__size__": [..]}                torch.Size
    {"__dtype__": "float32"}, {"__device__": "cuda:0"}   torch.dtype, torch.device

torch is imported only when the state holds torch objects (on save) or the skeleton names them
(on restore): reading manifests, listing and GC never load it.
"""

from __future__ import annotations

import collections
import json
import math
import re
import struct
import sys
from typing import Any, Literal

import numpy as np

from .errors import CorruptCheckpoint, UnsupportedState
from .types import NUMPY_KINDS, TORCH_DTYPES, LeafSpec, dense_strides

TAGS = frozenset({"__leaf__", "__ref__", "__attrs__", "__tuple__", "__items__", "__map__", "__float__", "__complex__",
                  "__set__", "__frozenset__", "__np__", "__size__", "__dtype__", "__device__"})
# Deepest nesting of containers a state may have. Real states are a handful of levels deep; the
# limit keeps encoding and decoding (of hostile manifests too) far from Python's recursion limit.
MAX_DEPTH = 100

_MAPS = {"OrderedDict": collections.OrderedDict, "defaultdict": collections.defaultdict,
         "Counter": collections.Counter}
_MAP_NAMES = {cls: name for name, cls in _MAPS.items()}
# defaultdict factories that can be restored by name without running any code of the store's.
_FACTORIES = {"list": list, "dict": dict, "set": set, "frozenset": frozenset, "tuple": tuple, "int": int,
              "float": float, "complex": complex, "str": str, "bytes": bytes, "bool": bool,
              "OrderedDict": collections.OrderedDict, "Counter": collections.Counter}
_FACTORY_NAMES = {f: name for name, f in _FACTORIES.items()}
_ATTR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _torch():
    import torch  # imported only when a state holds or names torch objects

    return torch


def _torch_types() -> tuple:
    """(Tensor, Parameter, Size, dtype, device) if torch is loaded, else empty: a state cannot
    hold torch objects unless the caller imported torch."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "nn"):
        return ()
    return torch.Tensor, torch.nn.Parameter, torch.Size, torch.dtype, torch.device


def _refuse(path: str, obj: Any, hint: str) -> UnsupportedState:
    cls = type(obj)
    return UnsupportedState(f"cannot checkpoint {cls.__module__}.{cls.__qualname__} at '{path or '/'}': {hint}")


def _hint(obj: Any) -> str:
    """What to do with a value of a type the format does not hold."""
    import enum

    if isinstance(obj, enum.Enum):
        return "enums would have to be imported on load; store its .value (or .name) instead"
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return "namedtuples would have to be imported on load; store tuple(x) or x._asdict() instead"
    if hasattr(obj, "__dataclass_fields__"):
        return "dataclasses would have to be imported on load; store dataclasses.asdict(x) instead"
    if hasattr(obj, "state_dict"):
        return "store its .state_dict() instead"
    if isinstance(obj, np.ndarray):
        return "only plain numpy arrays are stored; convert it with np.asarray(x)"
    return ("a state may hold dicts (also OrderedDict, defaultdict, Counter), lists, tuples, sets, torch "
            "tensors, numpy arrays and scalars, bytes, and None/bool/int/float/complex/str; "
            "convert the value to one of those")


def flatten(state: Any) -> tuple[Any, list[tuple[LeafSpec, Any]]]:
    """(skeleton, [(spec, leaf object)]) in a deterministic order; raises UnsupportedState."""
    leaves: list[tuple[LeafSpec, Any]] = []
    tensor_types = _torch_types()
    tensor_cls = tensor_types[:2]
    ties: dict[Any, int] = {}  # tensor identity -> leaf index
    on_path: set[int] = set()  # ids of the containers being walked: a repeat is a cycle

    def walk(obj: Any, path: str, depth: int) -> Any:
        cls = type(obj)
        if obj is None or cls in (bool, str):
            return obj
        if cls is int:
            if obj.bit_length() > 13000:  # json (and Python's int->str limit) cannot hold it
                raise _refuse(path, obj, "integers above 4,000 digits cannot be stored; use a tensor")
            return obj
        if cls is float:
            return obj if math.isfinite(obj) else {"__float__": _nonfinite(obj)}
        if cls is complex:
            return {"__complex__": [walk(obj.real, path, depth), walk(obj.imag, path, depth)]}
        if cls in (bytes, bytearray):
            return add_leaf(LeafSpec(path, cls.__name__, "|u1", (len(obj),), len(obj), 1), obj)
        if cls is np.ndarray:
            return add_leaf(_numpy_spec(obj, path), obj)
        if isinstance(obj, np.generic):
            return {"__np__": _np_scalar(obj, path)}
        if tensor_types:
            if cls in tensor_cls:
                return add_tensor(obj, path)
            if cls is tensor_types[2]:
                return {"__size__": [int(v) for v in obj]}
            if cls is tensor_types[3]:
                name = str(obj).removeprefix("torch.")
                if name not in TORCH_DTYPES:
                    raise _refuse(path, obj, f"torch dtype {name} is not supported")
                return {"__dtype__": name}
            if cls is tensor_types[4]:
                return {"__device__": str(obj)}
            if isinstance(obj, tensor_types[0]):
                raise _refuse(path, obj, "tensor subclasses (DTensor, FakeTensor, ...) are not stored; convert "
                                         "it to a plain tensor (e.g. .full_tensor(), .to_local() or .detach())")
        if cls in (list, tuple, dict, set, frozenset) or cls in _MAP_NAMES:
            if depth >= MAX_DEPTH:
                raise UnsupportedState(f"the state is nested deeper than {MAX_DEPTH} levels at '{path or '/'}'; "
                                       "flatten it (e.g. a dict of paths)")
            if id(obj) in on_path:
                raise UnsupportedState(f"the state refers to itself at '{path or '/'}' (a cycle); remove the cycle")
            on_path.add(id(obj))
            try:
                return container(obj, cls, path, depth + 1)
            finally:
                on_path.discard(id(obj))
        raise _refuse(path, obj, _hint(obj))

    def container(obj: Any, cls: type, path: str, depth: int) -> Any:
        if cls is list:
            return [walk(v, f"{path}/{i}", depth) for i, v in enumerate(obj)]
        if cls is tuple:
            return {"__tuple__": [walk(v, f"{path}/{i}", depth) for i, v in enumerate(obj)]}
        if cls in (set, frozenset):
            # in an order of the values themselves: iteration order depends on the hash seed
            ordered = sorted(obj, key=lambda v: _value_key(v, path))
            return {f"__{cls.__name__}__": [walk(v, f"{path}/<item>", depth) for v in ordered]}
        if cls is dict and all(type(k) is str and k not in TAGS for k in obj):
            return {k: walk(v, f"{path}/{k}", depth) for k, v in obj.items()}
        items = [[walk_key(k, path, depth), walk(v, f"{path}/{k}", depth)] for k, v in obj.items()]
        if cls is dict:
            return {"__items__": items}
        node: dict[str, Any] = {"type": _MAP_NAMES[cls], "items": items}  # type: ignore[index]
        if cls is collections.defaultdict:
            if obj.default_factory is not None and obj.default_factory not in _FACTORY_NAMES:
                raise _refuse(path, obj, f"its default_factory {obj.default_factory!r} would have to be run on "
                                         f"load; use one of {sorted(_FACTORIES)} or None")
            node["factory"] = _FACTORY_NAMES.get(obj.default_factory)
        attrs = getattr(obj, "__dict__", None) or {}
        if attrs:
            for name in attrs:
                if not isinstance(name, str) or not _ATTR.match(name) or name.startswith("__"):
                    raise _refuse(path, obj, f"attribute {name!r} is not a plain identifier")
            node["attrs"] = {name: walk(v, f"{path}/.{name}", depth) for name, v in attrs.items()}
        return {"__map__": node}

    def walk_key(key: Any, path: str, depth: int) -> Any:
        if type(key) not in (str, int, float, bool, complex, tuple, frozenset) and key is not None \
                and not isinstance(key, np.generic):
            raise _refuse(f"{path}/<key>", key, "dict keys may be None, bool, int, float, complex, str, numpy "
                                                "scalars, or tuples/frozensets of those")
        return walk(key, f"{path}/<key>", depth)

    def add_leaf(spec: LeafSpec, obj: Any) -> dict[str, int]:
        leaves.append((spec, obj))
        return {"__leaf__": len(leaves) - 1}

    def add_tensor(t: Any, path: str) -> dict[str, int]:
        spec = _torch_spec(t, path)
        # Tensors that are the same memory (tied weights: state_dict() returns two views of one
        # parameter) come back as one tensor, as torch.save restores them.
        tie = None
        if spec.nbytes:
            tie = (t.untyped_storage().data_ptr(), t.storage_offset(), spec.dtype, spec.shape, tuple(t.stride()),
                   str(t.device), spec.param, spec.requires_grad, t.is_conj(), t.is_neg())
            if tie in ties:
                return {"__ref__": ties[tie]}
        node: dict[str, Any] = add_leaf(spec, t)
        if tie is not None:
            ties[tie] = node["__leaf__"]
        attrs = getattr(t, "__dict__", None)
        if attrs:  # Python attributes set on the tensor: kept, as torch.save keeps them
            for name in attrs:
                if not isinstance(name, str) or not _ATTR.match(name) or name.startswith("__"):
                    raise _refuse(path, t, f"its attribute {name!r} is not a plain identifier")
            node = {"__attrs__": [node, {name: walk(v, f"{path}/.{name}", 1) for name, v in attrs.items()}]}
        return node

    return walk(state, "", 0), leaves


def _value_key(v: Any, path: str) -> tuple:
    """A total order on the values a set may hold that does not depend on hashing or memory."""
    cls = type(v)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if v is None or cls in (bool, int, float, complex):
        return (name, repr(v))
    if cls in (str, bytes):
        return (name, v)
    if cls is tuple:
        return (name, tuple(_value_key(x, path) for x in v))
    if cls is frozenset:
        return (name, tuple(sorted(_value_key(x, path) for x in v)))
    if isinstance(v, np.generic):
        a = np.asarray(v)
        return (name, a.dtype.str, a.tobytes())
    if name in ("torch.dtype", "torch.device"):
        return (name, str(v))
    raise _refuse(f"{path}/<item>", v, "sets may hold None, bool, numbers, str, bytes, numpy scalars, torch dtypes and "
                                       "devices, and tuples/frozensets of those (a set of tensors has no stable order: "
                                       "store a list)")


def _nonfinite(x: float) -> str:
    if x != x:
        bits = struct.pack(">d", x).hex()
        return "nan" if bits == struct.pack(">d", float("nan")).hex() else bits
    return "inf" if x > 0 else "-inf"


def _np_scalar(obj: np.generic, path: str) -> list[str]:
    dt = obj.dtype
    if dt.kind not in NUMPY_KINDS or dt.fields is not None:
        raise _refuse(path, obj, "only numeric, bool, datetime and fixed-width string numpy scalars are "
                                 "stored (object and structured scalars would need pickle)")
    a = np.asarray(obj)  # an empty string scalar is '<U0', its array '<U1': use the array's dtype
    return [a.dtype.str, a.tobytes().hex()]


def _numpy_spec(a: np.ndarray, path: str) -> LeafSpec:
    dt = a.dtype
    if dt.kind not in NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None or dt.hasobject:
        raise UnsupportedState(
            f"numpy array at '{path}' has dtype {dt}: only numeric, bool, datetime and fixed-width string "
            "dtypes are stored (object and structured arrays would need pickle)")
    order = "F" if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    return LeafSpec(path, "numpy", dt.str, tuple(a.shape), a.nbytes, dt.itemsize, order=order)


def _torch_spec(t: Any, path: str) -> LeafSpec:
    torch = _torch()
    if t.is_meta:
        raise UnsupportedState(f"tensor at '{path}' is on the meta device and has no data: materialise it "
                               "(e.g. module.to_empty(device=...) and initialise) or leave it out of the state")
    if t.is_quantized:
        raise UnsupportedState(f"tensor at '{path}' is quantized: store t.dequantize(), or t.int_repr() with "
                               "its q_scale()/q_zero_point()")
    if t.is_nested:
        raise UnsupportedState(f"tensor at '{path}' is a nested tensor: store t.unbind() (a list of tensors)")
    if t.layout != torch.strided:
        raise UnsupportedState(f"tensor at '{path}' has layout {t.layout}: store t.to_dense(), or its "
                               "indices()/values() as separate tensors")
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in TORCH_DTYPES:
        raise UnsupportedState(f"tensor at '{path}' has dtype {t.dtype}, which ckptlib cannot store")
    shape = tuple(t.shape)
    stride = tuple(t.stride())
    keep = None if t.is_contiguous() or t.numel() == 0 or not dense_strides(shape, stride) else stride
    param = isinstance(t, torch.nn.Parameter)
    rg = bool(t.requires_grad) and t.is_leaf
    return LeafSpec(path, "torch", dtype, shape, t.numel() * t.element_size(), t.element_size(), keep,
                    param=param, requires_grad=rg)


def copy_into(obj: Any, spec: LeafSpec, out: np.ndarray, non_blocking: bool = False) -> None:
    """Copy a leaf's bytes, in the order the spec stores them, into ``out`` (uint8, spec.nbytes).
    One copy from any device or layout. ``non_blocking`` (pinned ``out`` only): the caller
    synchronises the device before using ``out``."""
    if spec.nbytes == 0:
        return
    if spec.kind == "torch":
        torch = _torch()
        src = obj.detach()
        if spec.stride is not None:  # memory order of a dense non-contiguous layout
            src = src.as_strided((spec.numel,), (1,))
        dst = torch.from_numpy(out).view(src.dtype).view(src.shape)
        dst.copy_(src, non_blocking=non_blocking and src.is_cuda)
    elif spec.kind in ("bytes", "bytearray"):
        out[:] = np.frombuffer(obj, dtype=np.uint8)
    else:
        a = np.asarray(obj)
        out[:] = (a.ravel(order="K") if spec.order == "F" else np.ascontiguousarray(a).reshape(-1)).view(np.uint8)


def raw_view(obj: Any, spec: LeafSpec) -> np.ndarray | None:
    """The leaf's bytes in stored order without a copy (a view of a CPU tensor/array's memory), or
    None when only a copy can give them (another device, a layout the spec does not store as is)."""
    if spec.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    if spec.kind == "torch":
        if obj.device.type != "cpu" or obj.is_conj() or obj.is_neg():
            return None
        t = obj.detach()
        if spec.stride is not None:
            if tuple(t.stride()) != spec.stride:
                return None
            t = t.as_strided((spec.numel,), (1,))
        elif not t.is_contiguous():
            return None
        return t.reshape(-1).view(_torch().uint8).numpy()
    if spec.kind in ("bytes", "bytearray"):
        return np.frombuffer(obj, dtype=np.uint8)
    a = obj
    if spec.order == "F":
        return a.ravel(order="F").view(np.uint8) if a.flags.f_contiguous else None
    return a.reshape(-1).view(np.uint8) if a.flags.c_contiguous else None


def empty_leaf(spec: LeafSpec) -> tuple[Any, np.ndarray]:
    """A new CPU leaf object for ``spec`` and a uint8 view of its memory, in stored order."""
    if spec.kind == "torch":
        torch = _torch()
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpoint(f"torch {torch.__version__} has no dtype {spec.dtype!r} (leaf '{spec.path}')")
        if spec.stride is not None:
            t = torch.empty_strided(spec.shape, spec.stride, dtype=dtype)
            flat = t.as_strided((spec.numel,), (1,))
        else:
            t = torch.empty(spec.shape, dtype=dtype)
            flat = t.reshape(-1)
        raw = flat.view(torch.uint8).numpy() if spec.nbytes else np.empty(0, np.uint8)
        return t, raw
    if spec.kind in ("bytes", "bytearray"):
        buf = bytearray(spec.nbytes)
        return buf, np.frombuffer(buf, dtype=np.uint8) if spec.nbytes else np.empty(0, np.uint8)
    order: Literal["C", "F"] = "F" if spec.order == "F" else "C"
    a = np.empty(spec.shape, dtype=np.dtype(spec.dtype), order=order)
    return a, a.ravel(order=order).view(np.uint8)


def finish_leaf(obj: Any, spec: LeafSpec, device: Any = "cpu") -> Any:
    """The leaf as the state held it: on ``device``, a Parameter again, bytes immutable again."""
    if spec.kind == "torch":
        if str(device) != "cpu":
            obj = obj.to(device)
        if spec.param:
            return _torch().nn.Parameter(obj, requires_grad=spec.requires_grad)
        return obj.requires_grad_(True) if spec.requires_grad else obj
    if spec.kind == "bytes":
        return bytes(obj)
    if spec.kind == "npscalar":  # format 1
        return obj[()]
    return obj


class _Missing:
    """Placeholder of a leaf that a partial restore did not read."""


MISSING = _Missing()


def unflatten(skeleton: Any, leaves: list[Any]) -> Any:
    """Inverse of flatten: rebuild the structure around the leaf objects. A malformed skeleton
    (from a damaged or hostile manifest) raises CorruptCheckpoint naming where; nothing in it is
    ever imported or called, except the fixed constructors named in the grammar."""

    def bad(path: str, why: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"malformed state skeleton in manifest at '{path or '/'}': {why}")

    def build(node: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH + 1:
            raise bad(path, f"nested deeper than {MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [build(v, f"{path}/{i}", depth + 1) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            raise bad(path, f"unexpected {type(node).__name__}")
        if len(node) == 1:
            (tag, value), = node.items()
            if tag in TAGS:
                return tagged(tag, value, path, depth)
        if TAGS.intersection(node):
            raise bad(path, f"tag {sorted(TAGS.intersection(node))[0]} among other keys")
        return {k: build(v, f"{path}/{k}", depth + 1) for k, v in node.items()}

    def tagged(tag: str, v: Any, path: str, depth: int) -> Any:
        if tag in ("__leaf__", "__ref__"):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < len(leaves):
                raise bad(path, f"leaf index {v!r} out of range")
            return leaves[v]
        if tag == "__float__":
            return _float(v, path)
        if tag == "__np__":
            return _np_from(v, path)
        if tag == "__dtype__":
            if v not in TORCH_DTYPES:
                raise bad(path, f"unknown torch dtype {v!r}")
            return getattr(_torch(), v)
        if tag == "__device__":
            if not isinstance(v, str) or not re.fullmatch(r"[a-z_]+(:\d+)?", v):
                raise bad(path, f"malformed device {v!r}")
            return _torch().device(v)
        if tag == "__map__":
            return mapping(v, path, depth)
        if tag == "__attrs__":
            if not (isinstance(v, list) and len(v) == 2 and isinstance(v[1], dict)):
                raise bad(path, "__attrs__ is not [node, {name: node}]")
            obj = build(v[0], path, depth + 1)
            for name, node in v[1].items():
                if not _ATTR.match(name) or name.startswith("__"):
                    raise bad(path, f"attribute name {name!r} is not a plain identifier")
                setattr(obj, name, build(node, f"{path}/.{name}", depth + 1))
            return obj
        if not isinstance(v, list):
            raise bad(path, f"{tag} holds {type(v).__name__}, not a list")
        if tag == "__tuple__":
            return tuple(build(x, f"{path}/{i}", depth + 1) for i, x in enumerate(v))
        if tag == "__size__":
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise bad(path, "torch.Size of non-integers")
            return _torch().Size(v)
        if tag == "__complex__":
            if len(v) != 2:
                raise bad(path, "complex needs [real, imag]")
            re_, im = (build(x, path, depth + 1) for x in v)
            if not all(isinstance(x, float) for x in (re_, im)):
                raise bad(path, "complex parts are not floats")
            return complex(re_, im)
        if tag in ("__set__", "__frozenset__"):
            items = [hashable(build(x, f"{path}/<item>", depth + 1), path) for x in v]
            return set(items) if tag == "__set__" else frozenset(items)
        return dict(pairs(v, path, depth))  # __items__

    def pairs(items: Any, path: str, depth: int) -> list[tuple[Any, Any]]:
        if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
            raise bad(path, "items are not [key, value] pairs")
        out = []
        for k, v in items:
            key = hashable(build(k, f"{path}/<key>", depth + 1), path)
            out.append((key, build(v, f"{path}/{key}", depth + 1)))
        return out

    def mapping(v: Any, path: str, depth: int) -> Any:
        if not isinstance(v, dict) or v.get("type") not in _MAPS or not set(v) <= {"type", "items", "attrs", "factory"}:
            raise bad(path, f"malformed __map__ {str(v)[:80]!r}")
        items = pairs(v.get("items", []), path, depth)
        if v["type"] == "defaultdict":
            factory = v.get("factory")
            if factory is not None and factory not in _FACTORIES:
                raise bad(path, f"defaultdict factory {factory!r} is not a builtin")
            obj = collections.defaultdict(_FACTORIES.get(factory) if factory else None, items)
        else:
            obj = _MAPS[v["type"]]()
            if v["type"] == "Counter":
                dict.update(obj, items)  # Counter(pairs) would count the pairs
            else:
                obj.update(items)
        attrs = v.get("attrs", {})
        if not isinstance(attrs, dict):
            raise bad(path, "attrs is not an object")
        for name, node in attrs.items():
            if not _ATTR.match(name) or name.startswith("__"):
                raise bad(path, f"attribute name {name!r} is not a plain identifier")
            setattr(obj, name, build(node, f"{path}/.{name}", depth + 1))
        return obj

    def hashable(key: Any, path: str) -> Any:
        if isinstance(key, list):  # format 1 stored tuple keys as lists
            key = tuple(hashable(k, path) for k in key)
        try:
            hash(key)
        except TypeError:
            raise bad(path, f"dict key of type {type(key).__name__} is not hashable") from None
        return key

    try:
        return build(skeleton, "", 0)
    except RecursionError:
        raise bad("", "nested too deeply") from None


def _float(v: Any, path: str) -> Any:
    if v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, str) and re.fullmatch(r"[0-9a-f]{16}", v):
        return struct.unpack(">d", bytes.fromhex(v))[0]
    # Format 1 wrote numpy float64 NaN/inf (a float subclass) as its repr; read them back exactly.
    m = re.fullmatch(r"np\.float64\((nan|inf|-inf)\)", v) if isinstance(v, str) else None
    if m:
        return np.float64(m.group(1))
    raise CorruptCheckpoint(f"malformed state skeleton in manifest at '{path or '/'}': bad float {v!r}")


def _np_from(v: Any, path: str) -> np.generic:
    try:
        dtype_str, hexbytes = v
        dt = np.dtype(dtype_str)
        if dt.kind not in NUMPY_KINDS or dt.fields is not None or dt.hasobject or dt.str != dtype_str:
            raise ValueError(f"dtype {dtype_str!r}")
        raw = bytes.fromhex(hexbytes)
        if len(raw) != dt.itemsize:
            raise ValueError(f"{len(raw)} bytes for a {dt.itemsize}-byte scalar")
        return np.frombuffer(raw, dtype=dt)[0]
    except (TypeError, ValueError) as e:
        raise CorruptCheckpoint(f"malformed state skeleton in manifest at '{path or '/'}': bad numpy scalar "
                                f"({e})") from None


def prune(skeleton: Any, select: list[str]) -> Any:
    """The part of ``skeleton`` under the given '/'-separated key paths (e.g. ``["model"]``, or
    ``["optimizer/param_groups"]``), inside the same containers. Raises KeyError naming a path
    that is not in the state."""
    wanted: dict[str, Any] = {}  # nested key -> None (the whole subtree) or a dict of wanted children
    for path in select:
        parts = [p for p in path.split("/") if p]
        if not parts:
            return skeleton
        node = wanted
        for part in parts[:-1]:
            if part in node and node[part] is None:
                break  # its whole subtree is wanted already
            node = node.setdefault(part, {})
        else:
            node[parts[-1]] = None

    def children(node: Any) -> list[tuple[Any, Any]] | None:
        if isinstance(node, dict):
            if len(node) == 1 and "__map__" in node and isinstance(node["__map__"], dict):
                return [tuple(kv) for kv in node["__map__"].get("items", [])]
            if len(node) == 1 and "__items__" in node:
                return [tuple(kv) for kv in node["__items__"]]
            if not TAGS.intersection(node):
                return list(node.items())
        return None

    def with_children(node: Any, kept: list[tuple[Any, Any]]) -> Any:
        if "__map__" in node and len(node) == 1:
            return {"__map__": {**node["__map__"], "items": [list(kv) for kv in kept]}}
        if "__items__" in node and len(node) == 1:
            return {"__items__": [list(kv) for kv in kept]}
        return dict(kept)

    def take(node: Any, want: dict[str, Any] | None, path: str) -> Any:
        if want is None:
            return node
        kids = children(node) or []
        # a path names a key by its text: "0" finds the int key 0 of optimizer state, unless "0" is a key
        by_name: dict[str, Any] = {}
        for k, _ in kids:
            if isinstance(k, str):
                by_name[k] = k
        for k, _ in kids:
            if isinstance(k, (int, float, bool)) or k is None:
                by_name.setdefault(json.dumps(k) if not isinstance(k, int) or isinstance(k, bool) else str(k), k)
        for key in want:
            if key not in by_name:
                raise KeyError(f"'{path}/{key}' is not in the saved state")
        chosen = {by_name[key]: key for key in want}
        return with_children(node, [(k, take(v, want[chosen[k]], f"{path}/{k}")) for k, v in kids
                                    if _hashable_node(k) and k in chosen])

    return take(skeleton, wanted, "")


def _hashable_node(k: Any) -> bool:
    return not isinstance(k, (list, dict))


def leaf_indices(skeleton: Any) -> set[int]:
    """The leaf indices a skeleton refers to (``__leaf__`` and ``__ref__``)."""
    found: set[int] = set()
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if len(node) == 1 and next(iter(node)) in ("__leaf__", "__ref__"):
                v = next(iter(node.values()))
                if isinstance(v, int):
                    found.add(v)
            else:
                stack.extend(node.values())
    return found


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
    problems = []
    if dtype != spec.dtype:
        problems.append(f"dtype {dtype} in the destination, {spec.dtype} saved")
    if tuple(obj.shape) != spec.shape:
        problems.append(f"shape {list(obj.shape)} in the destination, {list(spec.shape)} saved")
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


def bind_into(skeleton: Any, specs: list[LeafSpec], into: Any) -> tuple[Any, dict[int, Any], list[tuple[int, int, Any]], list[str]]:
    """Match a destination state ``into`` against a saved skeleton, for a restore in place.

    Returns (skeleton, destinations, aliases, mismatches): ``destinations`` maps a leaf index to
    the tensor/array of ``into`` that receives it (a saved leaf with no array at its place in
    ``into`` is allocated anew, like any other value that is replaced); ``aliases`` lists leaves
    saved tied (``__ref__``) whose destinations are distinct objects, as (new leaf index, source
    leaf, destination), with the returned skeleton naming the new index there; ``mismatches``
    lists every place where ``into`` holds an array the checkpoint cannot fill: a different dtype,
    shape or type, or no saved value at all."""
    dest: dict[int, Any] = {}
    aliases: list[tuple[int, int, Any]] = []
    mismatches: list[str] = []
    count = [len(specs)]

    def child(obj: Any, key: Any) -> Any:
        if isinstance(obj, dict):
            return obj.get(key, _ABSENT)
        if isinstance(obj, (list, tuple)) and isinstance(key, int) and 0 <= key < len(obj):
            return obj[key]
        return _ABSENT

    def extras(obj: Any, seen: set, path: str) -> None:
        if isinstance(obj, dict):
            items = [(k, v) for k, v in obj.items() if k not in seen]
        elif isinstance(obj, (list, tuple)):
            items = [(i, v) for i, v in enumerate(obj) if i not in seen]
        else:
            return
        for k, v in items:
            for p in _arrays_in(v, f"{path}/{k}"):
                mismatches.append(f"{p}: the destination holds an array the checkpoint does not have")

    def walk(node: Any, obj: Any, path: str) -> Any:
        if isinstance(node, list):
            out = [walk(v, child(obj, i), f"{path}/{i}") for i, v in enumerate(node)]
            extras(obj, set(range(len(node))), path)
            return out
        if not isinstance(node, dict):
            if _is_array(obj):
                mismatches.append(f"{path or '/'}: the destination holds an array, the checkpoint a "
                                  f"{type(node).__name__}")
            return node
        if len(node) == 1 and next(iter(node)) in ("__leaf__", "__ref__"):
            (tag, i), = node.items()
            if not isinstance(i, int) or not 0 <= i < len(specs):
                return node  # unflatten reports it
            if obj is _ABSENT or not _is_array(obj):
                return node
            why = _matches(obj, specs[i])
            if why:
                mismatches.append(f"{path or '/'}: {why}")
                return node
            if i not in dest:
                dest[i] = obj
                return {"__leaf__": i}
            if dest[i] is obj:
                return node
            aliases.append((count[0], i, obj))
            count[0] += 1
            return {"__leaf__": count[0] - 1}
        if len(node) == 1 and next(iter(node)) in TAGS:
            (tag, v), = node.items()
            if tag == "__attrs__" and isinstance(v, list) and len(v) == 2:
                return {"__attrs__": [walk(v[0], obj, path), v[1]]}
            if tag == "__tuple__" and isinstance(v, list):
                walked = {"__tuple__": [walk(x, child(obj, k), f"{path}/{k}") for k, x in enumerate(v)]}
                extras(obj, set(range(len(v))), path)
                return walked
            pairs = v if tag == "__items__" else (v.get("items") if tag == "__map__" and isinstance(v, dict) else None)
            if isinstance(pairs, list):
                new_pairs, seen = [], set()
                for kv in pairs:
                    if not (isinstance(kv, list) and len(kv) == 2):
                        continue
                    key = _decode_key(kv[0])
                    if key is _ABSENT:
                        new_pairs.append(kv)
                        continue
                    seen.add(key)
                    new_pairs.append([kv[0], walk(kv[1], child(obj, key), f"{path}/{key}")])
                extras(obj, seen, path)
                return {"__items__": new_pairs} if tag == "__items__" else {"__map__": {**v, "items": new_pairs}}
            if _is_array(obj):
                mismatches.append(f"{path or '/'}: the destination holds an array, the checkpoint a {tag.strip('_')}")
            return node
        mapping = {k: walk(v, child(obj, k), f"{path}/{k}") for k, v in node.items()}
        extras(obj, set(node), path)
        return mapping

    new_skeleton = walk(skeleton, into, "")
    return new_skeleton, dest, aliases, mismatches


def _decode_key(node: Any) -> Any:
    """A dict key of a skeleton as the Python value (keys hold no leaves); _ABSENT if malformed."""
    try:
        key = unflatten(node, [])
        hash(key)
        return key
    except (CorruptCheckpoint, TypeError):
        return _ABSENT

