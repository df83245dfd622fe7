"""State trees <-> (JSON skeleton, array leaves): every value comes back with its type, or is refused.

A state is a nested structure of containers and values. ``flatten`` turns it into a JSON
*skeleton* in which every array (torch tensor, numpy array, bytes) is replaced by
``{"__leaf__": i}``, plus the list of those leaves; ``unflatten`` is the inverse. Dispatch is on
the exact type: a subclass that is not listed (an ``IntEnum``, a namedtuple, a ``np.memmap``) is
refused with ``UnsupportedState`` naming its path, never saved as its base class.

The grammar (format 2; a superset of format 1's, so one decoder reads both) is written once, in
``Node`` and ``parse``: every walker (``flatten``, ``unflatten``, ``prune``, ``leaf_indices``,
``ckptlib.bind``) reads and writes nodes through them, so a new kind is added in one place::

    kind       spelling                                   Python value
    scalar     null, true, 12, 1.5, "s"                   None, bool, int, finite float, str
    list       [..]                                       list
    dict       {"k": ..} (no key is a tag)                dict of str keys, in order
    leaf       {"__leaf__": i}                            array leaf i
    ref        {"__ref__": i}                             the same tensor as leaf i (tied weights)
    view       {"__view__": {"storage": i, "offset", "shape", "stride", "dtype", flags}}
                                                          a tensor viewing storage leaf i (``types.View``)
    attrs      {"__attrs__": [node, {name: node}]}        a tensor with Python attributes
    tuple      {"__tuple__": [..]}                        tuple
    set        {"__set__": [..]}, {"__frozenset__": [..]}  set, frozenset (canonical order)
    items      {"__items__": [[k, v], ..]}                dict with other keys (int-keyed optimizer state)
    map        {"__map__": {"type", "items", "attrs", "factory"}}   OrderedDict, defaultdict, Counter
    float      {"__float__": "nan" | "inf" | "-inf" | "<16 hex>"}  non-finite float (NaN payload kept)
    complex    {"__complex__": [re, im]}                  complex
    np         {"__np__": [dtype, "<hex>"]}               numpy scalar
    size       {"__size__": [..]}                         torch.Size
    dtype      {"__dtype__": "float32"}                   torch.dtype
    device     {"__device__": "cuda:0"}                   torch.device

Tensors that share memory without being the same view (``w`` and ``w.view(20)``, slices, another
dtype over the same bytes) and tensors with a lazy conjugate/negative bit are patched after the
walk into one *storage* leaf (the bytes they span) and a ``__view__`` node each, as ``torch.save``
keeps them: a state without such tensors is flattened exactly as before (same skeleton, digest).

The decoder builds only what ``flatten`` writes (a store is not trusted: anyone who can write it
can recompute the digests): attributes only on tensors (and on the maps, as their ``__dict__``),
never with a name the type itself defines (``data``, ``shape``, ``items``); dict keys only of the
kinds a dict key may be here (None, bool, numbers, str, numpy scalars, tuples/frozensets of those);
set items only of the kinds a set may hold (those, bytes, torch dtypes and devices); each leaf once;
a storage leaf only under views that fit inside it, and views only of storage leaves.
Anything else is ``CorruptCheckpoint`` naming the path. Decoding is linear in the skeleton's size:
paths are strings only when an error names one.

torch is imported only when the state holds torch objects (on save) or the skeleton names them
(on restore): reading manifests, listing and GC never load it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CorruptCheckpoint, UnsupportedState
from .leaves import span_of, view_of, without_flags
from .types import NUMPY_KINDS, REFUSED_TORCH_DTYPES, TORCH_DTYPES, LeafSpec, View, dense_strides

# Deepest nesting of containers a state may have. Real states are a handful of levels deep; the
# limit keeps encoding and decoding (of hostile manifests too) far from Python's recursion limit.
MAX_DEPTH = 100
_MAX_SIZE_DIM = 2**63 - 1

_MAPS = {"OrderedDict": collections.OrderedDict, "defaultdict": collections.defaultdict,
         "Counter": collections.Counter}
_MAP_NAMES: dict[type, str] = {cls: name for name, cls in _MAPS.items()}
# defaultdict factories that can be restored by name without running any code of the store's.
_FACTORIES = {"list": list, "dict": dict, "set": set, "frozenset": frozenset, "tuple": tuple, "int": int,
              "float": float, "complex": complex, "str": str, "bytes": bytes, "bool": bool,
              "OrderedDict": collections.OrderedDict, "Counter": collections.Counter}
_FACTORY_NAMES = {f: name for name, f in _FACTORIES.items()}
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DEVICE = re.compile(r"^[a-z_]{1,32}(:\d{1,6})?$")


# --- the grammar -----------------------------------------------------------------------------------

# kind -> tag, for every tagged kind; "list", "dict" and "scalar" are plain JSON.
_TAG = {"leaf": "__leaf__", "ref": "__ref__", "view": "__view__", "attrs": "__attrs__", "tuple": "__tuple__", "set": "__set__",
        "frozenset": "__frozenset__", "items": "__items__", "map": "__map__", "float": "__float__",
        "complex": "__complex__", "np": "__np__", "size": "__size__", "dtype": "__dtype__", "device": "__device__"}
_KIND = {tag: kind for kind, tag in _TAG.items()}
TAGS = frozenset(_KIND)
_SEQUENCES = ("list", "tuple", "set", "frozenset")  # items: child nodes
_KEYED = ("dict", "items", "map")  # items: (key, child node) pairs


class _Bad(Exception):
    """A node that is not in the grammar (raised with why; the walker adds where)."""


@dataclass(frozen=True)
class Node:
    """One skeleton node, parsed. ``value``: a scalar's value, a leaf's index, a view's ``View``, an
    atom's raw tag value, a map's ``(type, factory)``. ``items``: a sequence's child nodes, or a keyed container's
    ``(key, child)`` pairs (str keys for a dict, key *nodes* for items/map). ``attrs``: ``(name,
    node)`` pairs of a tensor's or a map's attributes; ``inner``: the tensor node of attrs."""

    kind: str
    value: Any = None
    items: tuple = ()
    attrs: tuple = ()
    inner: Any = None

    def json(self) -> Any:
        """The node as JSON (the inverse of ``parse``)."""
        k = self.kind
        if k == "scalar":
            return self.value
        if k == "list":
            return list(self.items)
        if k == "dict":
            return dict(self.items)
        if k in ("tuple", "set", "frozenset"):
            return {_TAG[k]: list(self.items)}
        if k == "items":
            return {"__items__": [list(kv) for kv in self.items]}
        if k == "map":
            kind, factory = self.value
            doc: dict[str, Any] = {"type": kind, "items": [list(kv) for kv in self.items]}
            if kind == "defaultdict":
                doc["factory"] = factory
            if self.attrs:
                doc["attrs"] = dict(self.attrs)
            return {"__map__": doc}
        if k == "attrs":
            return {"__attrs__": [self.inner, dict(self.attrs)]}
        if k == "view":
            return {"__view__": self.value.to_json()}
        return {_TAG[k]: self.value}


def parse(node: Any) -> Node:
    """The kind and parts of a JSON node; ``_Bad`` if it is not in the grammar. Checks the node's
    own structure only (its children are parsed when they are walked)."""
    t = type(node)
    if node is None or t in (bool, int, str):
        return Node("scalar", node)
    if t is float:
        if not math.isfinite(node):
            raise _Bad("a non-finite float outside __float__")
        return Node("scalar", node)
    if t is list:
        return Node("list", items=tuple(node))
    if t is not dict:
        raise _Bad(f"unexpected {t.__name__}")
    if len(node) == 1:
        ((tag, v),) = node.items()
        kind = _KIND.get(tag)
        if kind is not None:
            return _PARSERS[kind](kind, v)
    if not TAGS.isdisjoint(node):
        raise _Bad(f"tag {sorted(TAGS.intersection(node))[0]} among other keys")
    return Node("dict", items=tuple(node.items()))


def _index(kind: str, v: Any) -> Node:
    if type(v) is not int or v < 0:
        raise _Bad(f"leaf index {v!r} is not a non-negative int")
    return Node(kind, v)


def _view(kind: str, v: Any) -> Node:
    try:
        return Node(kind, View.from_json(v))
    except ValueError as e:
        raise _Bad(f"malformed __view__: {e}") from None


def _list(kind: str, v: Any) -> Node:
    if type(v) is not list:
        raise _Bad(f"{_TAG[kind]} holds {type(v).__name__}, not a list")
    return Node(kind, items=tuple(v))


def _pairs(v: Any) -> tuple:
    if type(v) is not list or not all(type(p) is list and len(p) == 2 for p in v):
        raise _Bad("items are not [key, value] pairs")
    return tuple(tuple(p) for p in v)


def _attr_pairs(v: Any) -> tuple:
    if type(v) is not dict or not all(type(k) is str for k in v):
        raise _Bad("attributes are not an object of names")
    return tuple(v.items())


def _map(kind: str, v: Any) -> Node:
    if type(v) is not dict or v.get("type") not in _MAPS or not set(v) <= {"type", "items", "attrs", "factory"}:
        raise _Bad(f"malformed __map__ {str(v)[:80]!r}")
    factory = v.get("factory")
    if factory is not None and (v["type"] != "defaultdict" or factory not in _FACTORIES):
        raise _Bad(f"defaultdict factory {str(factory)[:40]!r} is not a builtin")
    return Node(kind, (v["type"], factory), _pairs(v.get("items", [])), _attr_pairs(v.get("attrs", {})))


def _attrs(kind: str, v: Any) -> Node:
    if type(v) is not list or len(v) != 2:
        raise _Bad("__attrs__ is not [node, {name: node}]")
    return Node(kind, attrs=_attr_pairs(v[1]), inner=v[0])


def _atom(kind: str, v: Any) -> Node:
    return Node(kind, v)


def _items(kind: str, v: Any) -> Node:
    return Node(kind, items=_pairs(v))


_PARSERS = {"leaf": _index, "ref": _index, "view": _view, "tuple": _list, "set": _list, "frozenset": _list, "items": _items,
            "map": _map, "attrs": _attrs, "float": _atom, "complex": _atom, "np": _atom, "size": _atom,
            "dtype": _atom, "device": _atom}
assert set(_PARSERS) == set(_TAG)


def tagged(kind: str, value: Any) -> dict[str, Any]:
    """The JSON node of an atom or a sequence kind (what ``flatten`` writes)."""
    return {_TAG[kind]: value}


class Path:
    """Where a node is, as a chain of labels: O(1) per child, a string only when printed."""

    __slots__ = ("parent", "label")

    def __init__(self, parent: Path | None = None, label: Any = None):
        self.parent, self.label = parent, label

    def child(self, label: Any) -> Path:
        return Path(self, label)

    def __str__(self) -> str:
        labels = []
        p: Path | None = self
        while p is not None and p.parent is not None:
            labels.append(str(p.label))
            p = p.parent
        return "/" + "/".join(reversed(labels)) if labels else "/"


# --- torch, when loaded ----------------------------------------------------------------------------

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


def _is_tensor(obj: Any) -> bool:
    types = _torch_types()
    return bool(types) and isinstance(obj, types[0])


def attribute_problem(cls: type, name: Any) -> str | None:
    """Why ``name`` cannot be stored or restored as an attribute of an instance of ``cls`` (None:
    it can). Only plain data attributes: no dunders, nothing the type itself defines (a tensor's
    ``data`` or ``shape``, a dict's ``items``): restoring those would change what the object is."""
    if not isinstance(name, str) or not _IDENTIFIER.match(name) or name.startswith("__"):
        return f"attribute {str(name)[:40]!r} is not a plain identifier"
    if hasattr(cls, name):
        return f"attribute {name!r} is defined by {cls.__name__} itself"
    return None


# --- flatten (save) --------------------------------------------------------------------------------

def flatten(state: Any, *, subclass: Any = None, memo: SpecMemo | None = None) -> tuple[Any, list[tuple[LeafSpec, Any]]]:
    """(skeleton, [(spec, leaf object)]) in a deterministic order; raises UnsupportedState.
    ``subclass(obj, path)``: the plain tensor to store for a tensor subclass (a DTensor's local
    shard, for ``ckptlib.distributed``), or None to refuse it. ``memo``: the specs of the last
    flatten of a state laid out the same way (``SpecMemo``), which this one updates."""
    enc = _Encoder()
    enc.subclass = subclass
    if memo is not None:
        enc.memo, enc.memo_last = {}, memo.last
    skeleton = enc.walk(state, "", 0)
    enc.share_storages()
    if memo is not None and enc.memo is not None:
        memo.last = enc.memo  # only after a whole walk: a refused state leaves the memo as it was
    return skeleton, enc.leaves


class SpecMemo:
    """The tensor specs of a writer's last ``flatten``, by path, for its next one.

    A tensor's ``LeafSpec`` is a function of its path and metadata (type, dtype, shape, strides,
    gradient flags, whether it is on the meta device), so a tensor found where one with the same metadata was
    last time is given that very spec object, without the checks and the object built again (a
    few microseconds a tensor, which a state of hundreds of tensors pays at every save). The next
    save's plan is then known by the specs' identity (``save.Layout``). Nested and non-strided
    tensors, and tensors with Python attributes (``isinstance(t, Parameter)`` may read one), are
    never memoised. Holds the last
    flatten's entries only: one per tensor of the state."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[tuple, LeafSpec]] = {}


def _refuse(path: str, obj: Any, hint: str) -> UnsupportedState:
    cls = type(obj)
    return UnsupportedState(f"cannot checkpoint {cls.__module__}.{cls.__qualname__} at '{path or '/'}': {hint}")


_KEY_TYPES = (str, int, float, bool, complex, tuple, frozenset)
_KEYS_HINT = "dict keys may be None, bool, int, float, complex, str, numpy scalars, or tuples/frozensets of those"


class _Encoder:
    """One ``flatten``: the leaves found so far, tied tensors, and the containers on the path."""

    def __init__(self) -> None:
        self.leaves: list[tuple[LeafSpec, Any]] = []
        self.tensor_types = _torch_types()
        self.strided = _torch().strided if self.tensor_types else None
        self.ties: dict[Any, int] = {}  # tensor identity -> leaf index
        self.on_path: set[int] = set()  # ids of the containers being walked: a repeat is a cycle
        self.nodes: list[dict[str, Any]] = []  # every leaf and ref node made (patched by share_storages)
        self.storages: dict[tuple, list[int]] = {}  # (device, storage) -> leaf indices of its tensors
        self.subclass: Any = None  # flatten's hook for tensor subclasses
        self.memo: dict[str, tuple[tuple, LeafSpec]] | None = None  # SpecMemo: this walk's entries
        self.memo_last: dict[str, tuple[tuple, LeafSpec]] = {}  # and the last walk's

    def walk(self, obj: Any, path: str, depth: int) -> Any:
        cls = type(obj)
        if obj is None or cls in (bool, str):
            return obj
        if cls is int:
            if obj.bit_length() > 13000:  # json (and Python's int->str limit) cannot hold it
                raise _refuse(path, obj, "integers above 4,000 digits cannot be stored; use a tensor")
            return obj
        if cls is float:
            return obj if math.isfinite(obj) else tagged("float", _nonfinite(obj))
        if cls is complex:
            return tagged("complex", [self.walk(obj.real, path, depth), self.walk(obj.imag, path, depth)])
        if cls in (bytes, bytearray):
            return self.add_leaf(LeafSpec(path, cls.__name__, "|u1", (len(obj),), len(obj), 1), obj)
        if cls is np.ndarray:
            return self.add_leaf(_numpy_spec(obj, path), obj)
        if isinstance(obj, np.generic):
            return tagged("np", _np_scalar(obj, path))
        if self.tensor_types:
            node = self.torch_value(obj, cls, path)
            if node is not None:
                return node
        if cls in (list, tuple, dict, set, frozenset) or cls in _MAP_NAMES:
            return self.nested(obj, cls, path, depth)
        raise _refuse(path, obj, _hint(obj))

    def torch_value(self, obj: Any, cls: type, path: str) -> Any:
        tensor, parameter, size, dtype, device = self.tensor_types
        if cls in (tensor, parameter):
            return self.add_tensor(obj, path)
        if cls is size:
            if any(int(v) < 0 for v in obj):
                raise _refuse(path, obj, "a torch.Size with negative entries is not a shape; store a tuple")
            return tagged("size", [int(v) for v in obj])
        if cls is dtype:
            name = str(obj).removeprefix("torch.")
            if name not in TORCH_DTYPES and name not in REFUSED_TORCH_DTYPES:
                raise _refuse(path, obj, f"torch dtype {name} is new to ckptlib (not in its dtype tables)")
            return tagged("dtype", name)
        if cls is device:
            return tagged("device", str(obj))
        if isinstance(obj, tensor):
            plain = self.subclass(obj, path) if self.subclass is not None else None
            if plain is not None:
                return self.add_tensor(plain, path)
            raise _refuse(path, obj, "tensor subclasses (DTensor, FakeTensor, ...) are not stored; convert "
                                     "it to a plain tensor (e.g. .full_tensor(), .to_local() or .detach()), or "
                                     "save a DTensor state through Checkpointer(process_group=...)")
        return None

    def nested(self, obj: Any, cls: type, path: str, depth: int) -> Any:
        if depth >= MAX_DEPTH:
            raise UnsupportedState(f"the state is nested deeper than {MAX_DEPTH} levels at '{path or '/'}'; "
                                   "flatten it (e.g. a dict of paths)")
        if id(obj) in self.on_path:
            raise UnsupportedState(f"the state refers to itself at '{path or '/'}' (a cycle); remove the cycle")
        self.on_path.add(id(obj))
        try:
            return self.container(obj, cls, path, depth + 1)
        finally:
            self.on_path.discard(id(obj))

    def container(self, obj: Any, cls: type, path: str, depth: int) -> Any:
        if cls is list:
            return [self.walk(v, f"{path}/{i}", depth) for i, v in enumerate(obj)]
        if cls is tuple:
            return tagged("tuple", [self.walk(v, f"{path}/{i}", depth) for i, v in enumerate(obj)])
        if cls in (set, frozenset):
            # in an order of the values themselves: iteration order depends on the hash seed
            ordered = sorted(obj, key=lambda v: _value_key(v, path))
            return tagged(cls.__name__, [self.walk(v, f"{path}/<item>", depth) for v in ordered])
        if cls is dict and all(type(k) is str and k not in TAGS for k in obj):
            return {k: self.walk(v, f"{path}/{k}", depth) for k, v in obj.items()}
        items = tuple((self.key(k, path, depth), self.walk(v, f"{path}/{k}", depth)) for k, v in obj.items())
        if cls is dict:
            return Node("items", items=items).json()
        factory = None
        if cls is collections.defaultdict:
            if obj.default_factory is not None and obj.default_factory not in _FACTORY_NAMES:
                raise _refuse(path, obj, f"its default_factory {obj.default_factory!r} would have to be run on "
                                         f"load; use one of {sorted(_FACTORIES)} or None")
            factory = _FACTORY_NAMES.get(obj.default_factory)
        attrs = self.attributes(obj, cls, path, depth)
        return Node("map", (_MAP_NAMES[cls], factory), items, attrs).json()

    def attributes(self, obj: Any, cls: type, path: str, depth: int) -> tuple:
        """The Python attributes of ``obj`` (its ``__dict__``), each a plain data attribute."""
        attrs = getattr(obj, "__dict__", None) or {}
        for name in attrs:
            why = attribute_problem(cls, name)
            if why:
                raise _refuse(path, obj, why)
        return tuple((name, self.walk(v, f"{path}/.{name}", depth)) for name, v in attrs.items())

    def key(self, key: Any, path: str, depth: int) -> Any:
        _check_key(key, f"{path}/<key>")
        return self.walk(key, f"{path}/<key>", depth)

    def add_leaf(self, spec: LeafSpec, obj: Any) -> dict[str, Any]:
        self.leaves.append((spec, obj))
        node = tagged("leaf", len(self.leaves) - 1)
        self.nodes.append(node)
        return node

    def add_tensor(self, t: Any, path: str) -> dict[str, Any]:
        spec, stride = self.tensor_spec(t, path)
        # Tensors that are the same memory (tied weights: state_dict() returns two views of one
        # parameter) come back as one tensor, as torch.save restores them.
        tie = None
        if spec.nbytes:
            device = t.device
            tie = (t.untyped_storage().data_ptr(), t.storage_offset(), spec.dtype, spec.shape, stride,
                   device, spec.param, spec.requires_grad, t.is_conj(), t.is_neg())
            if tie in self.ties:
                ref = tagged("ref", self.ties[tie])
                self.nodes.append(ref)
                return ref
        node = self.add_leaf(spec, t)
        if tie is not None:
            self.ties[tie] = node["__leaf__"]
            self.storages.setdefault((device, tie[0]), []).append(node["__leaf__"])
        elif t.is_conj() or t.is_neg():  # an empty tensor with a bit: its own (empty) storage
            self.storages[("empty", node["__leaf__"])] = [node["__leaf__"]]
        if getattr(t, "__dict__", None):  # Python attributes set on the tensor: kept, as torch.save keeps them
            return Node("attrs", attrs=self.attributes(t, type(t), path, 1), inner=node).json()
        return node

    def tensor_spec(self, t: Any, path: str) -> tuple[LeafSpec, tuple]:
        """(t's spec, its strides): the memo's spec when t's metadata are the last flatten's at ``path``."""
        if self.memo is None or t.is_nested or t.layout is not self.strided or getattr(t, "__dict__", None):
            spec = _torch_spec(t, path)  # (refuses what has no strides)
            return spec, tuple(t.stride())
        stride = t.stride()
        key = (type(t), t.dtype, t.shape, stride, t.requires_grad, t.is_leaf, t.is_meta)
        seen = self.memo_last.get(path)
        spec = seen[1] if seen is not None and seen[0] == key else _torch_spec(t, path)
        self.memo[path] = (key, spec)
        return spec, stride

    def share_storages(self) -> None:
        """After the walk: tensors that share a storage without being the same view, and tensors
        with a conjugate/negative bit, become one storage leaf (at the place of the first) and a
        ``__view__`` node each; the other leaves move up. Nothing changes for other states."""
        groups = [g for g in self.storages.values() if len(g) > 1 or _has_bits(self.leaves[g[0]][1])]
        if not groups:
            return
        views: dict[int, View] = {}  # leaf index -> its view, of the storage at the group's first index
        storages: dict[int, tuple[LeafSpec, Any]] = {}
        for group in groups:
            storage, group_views = _storage_leaf([self.leaves[i] for i in group], group[0])
            storages[group[0]] = storage
            views.update(zip(group, group_views))
        moved: dict[int, int] = {}
        leaves: list[tuple[LeafSpec, Any]] = []
        for i, leaf in enumerate(self.leaves):
            if i in storages or i not in views:
                moved[i] = len(leaves)
                leaves.append(storages.get(i, leaf))
        self.leaves = leaves
        for node in self.nodes:  # the skeleton holds these very dicts: patch them in place
            ((tag, i),) = node.items()
            node.clear()
            if i in views:
                node["__view__"] = dataclasses.replace(views[i], storage=moved[views[i].storage]).to_json()
            else:
                node[tag] = moved[i]


def _has_bits(t: Any) -> bool:
    return bool(t.is_conj() or t.is_neg())


def _storage_leaf(members: list[tuple[LeafSpec, Any]], index: int) -> tuple[tuple[LeafSpec, Any], list[View]]:
    """One storage leaf for tensors that share memory (or one tensor with a bit), and their views
    of it. The storage holds the bytes the views span, from an offset aligned to every view's
    element size (so every view's offset is whole elements), in the views' dtype when they share
    one (deltas then see floats as floats), else as bytes. A lone tensor with a bit whose layout
    has gaps is stored as a contiguous copy of its memory (a slice's storage is not saved whole)."""
    torch = _torch()
    bases = [t for _, t in members]
    if len(members) == 1:
        t = without_flags(bases[0])
        bases = [t if dense_strides(tuple(t.shape), tuple(t.stride())) else t.contiguous()]
    dtypes = {t.dtype for t in bases}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
    align = math.lcm(dtype.itemsize, *(t.element_size() for t in bases))
    geometry = [View(index, t.storage_offset(), tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."))
                for t in bases]
    lo = min(v.offset * v.itemsize for v in geometry) // align * align
    hi = max(v.end for v in geometry)
    count = (hi - lo) // dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    spec = LeafSpec(f"{members[0][0].path}#storage", "storage", name, (count,), hi - lo, dtype.itemsize)
    views = [dataclasses.replace(v, offset=(v.offset * v.itemsize - lo) // v.itemsize, param=s.param,
                                 requires_grad=s.requires_grad, conj=bool(t.is_conj()), neg=bool(t.is_neg()))
             for v, (s, t) in zip(geometry, members)]
    return (spec, span_of(bases[0], lo // dtype.itemsize, count, dtype)), views


def _check_key(key: Any, path: str) -> None:
    """Refuse a dict key of a kind keys may not be (recursively, inside tuples/frozensets)."""
    if key is None or isinstance(key, np.generic):
        return
    if type(key) not in _KEY_TYPES:
        raise _refuse(path, key, _KEYS_HINT)
    if type(key) is tuple:
        for i, k in enumerate(key):
            _check_key(k, f"{path}/{i}")
    elif type(key) is frozenset:
        for k in key:
            _check_key(k, f"{path}/<item>")


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
        why = REFUSED_TORCH_DTYPES.get(dtype, "a dtype new to ckptlib (not in its dtype tables)")
        raise UnsupportedState(f"tensor at '{path}' has dtype {t.dtype}, which ckptlib does not store: {why}")
    shape = tuple(t.shape)
    stride = tuple(t.stride())
    keep = None if t.is_contiguous() or t.numel() == 0 or not dense_strides(shape, stride) else stride
    param = isinstance(t, torch.nn.Parameter)
    rg = bool(t.requires_grad) and t.is_leaf
    return LeafSpec(path, "torch", dtype, shape, t.numel() * t.element_size(), t.element_size(), keep,
                    param=param, requires_grad=rg)


# --- unflatten (restore) ---------------------------------------------------------------------------

class _Missing:
    """Placeholder of a leaf that a partial restore did not read."""


MISSING = _Missing()


def unflatten(skeleton: Any, leaves: list[Any], specs: list[LeafSpec] | None = None) -> Any:
    """Inverse of flatten: rebuild the structure around the leaf objects. A skeleton that flatten
    would not write (from a damaged or hostile manifest) raises CorruptCheckpoint naming where;
    nothing in it is ever imported or called, except the fixed constructors of the grammar.
    ``specs``: the leaves' specs, which say what kind each leaf is (else the objects do; a
    placeholder such as ``MISSING`` passes as any kind)."""
    dec = _Decoder(leaves, specs or [])
    try:
        return dec.build(skeleton, Path(), 0)
    except RecursionError:
        raise CorruptCheckpoint("malformed state skeleton in manifest: nested too deeply") from None


def _bad(path: Path | str, why: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"malformed state skeleton in manifest at '{path}': {why}")


class _Decoder:
    """One ``unflatten``: the leaves given, and which of them the skeleton has placed already."""

    def __init__(self, leaves: list[Any], specs: list[LeafSpec]):
        self.leaves, self.specs = leaves, specs
        self.placed: set[int] = set()
        self.views: dict[View, Any] = {}  # a view built already: the same node is the same tensor

    def kind(self, i: int) -> str | None:
        """Leaf ``i``'s kind ("torch", "numpy", "bytes", ...), or None when unknown (a placeholder)."""
        if i < len(self.specs):
            return self.specs[i].kind
        obj = self.leaves[i]
        if _is_tensor(obj):
            return "torch"
        return type(obj).__name__ if type(obj) in (bytes, bytearray, np.ndarray) else None

    def parse(self, node: Any, path: Path, depth: int) -> Node:
        if depth > MAX_DEPTH + 1:
            raise _bad(path, f"nested deeper than {MAX_DEPTH} levels")
        try:
            return parse(node)
        except _Bad as e:
            raise _bad(path, str(e)) from None

    def build(self, node: Any, path: Path, depth: int) -> Any:
        n = self.parse(node, path, depth)
        k = n.kind
        if k == "scalar":
            return n.value
        if k in ("list", "tuple"):
            out = [self.build(x, path.child(i), depth + 1) for i, x in enumerate(n.items)]
            return out if k == "list" else tuple(out)
        if k == "dict":
            return {key: self.build(v, path.child(key), depth + 1) for key, v in n.items}
        if k in ("set", "frozenset"):
            items = [self.set_item(x, path.child("<item>"), depth + 1) for x in n.items]
            return set(items) if k == "set" else frozenset(items)
        if k == "items":
            return dict(self.pairs(n.items, path, depth))
        if k == "map":
            return self.mapping(n, path, depth)
        if k == "attrs":
            return self.tensor_attrs(n, path, depth)
        if k in ("leaf", "ref"):
            return self.leaf(n, path)
        if k == "view":
            return self.view(n.value, path)
        return _ATOMS[k](n.value, path)

    def leaf(self, n: Node, path: Path) -> Any:
        i = n.value
        if i >= len(self.leaves):
            raise _bad(path, f"leaf index {i} out of range (the part has {len(self.leaves)} leaves)")
        obj = self.leaves[i]
        if self.kind(i) == "storage":
            raise _bad(path, f"{_TAG[n.kind]} {i} names a storage leaf: save writes storages only under __view__")
        if n.kind == "leaf":
            if i in self.placed:
                raise _bad(path, f"leaf {i} is placed twice (a second place would be a __ref__)")
            self.placed.add(i)
        elif self.kind(i) not in ("torch", None):
            raise _bad(path, f"__ref__ {i} names a {self.kind(i)} leaf: only tensors are tied")
        return obj

    def view(self, v: View, path: Path) -> Any:
        """The tensor a ``__view__`` node describes: of a storage leaf, inside it."""
        s = v.storage
        if s >= len(self.leaves):
            raise _bad(path, f"__view__ of leaf {s}, out of range (the part has {len(self.leaves)} leaves)")
        if self.kind(s) not in ("storage", None):
            raise _bad(path, f"__view__ of a {self.kind(s)} leaf: save writes views only of storage leaves")
        size = self.specs[s].nbytes if s < len(self.specs) else None
        if size is not None and v.end > size:
            raise _bad(path, f"the view ends at byte {v.end} of a {size}-byte storage")
        obj = self.leaves[s]
        if not _is_tensor(obj):  # a placeholder: the view is checked, not built
            return obj
        built = self.views.get(v)
        if built is None:
            try:
                built = self.views[v] = view_of(obj, v)
            except (ValueError, RuntimeError) as e:
                raise _bad(path, f"the view does not fit its storage ({str(e)[:120]})") from None
        return built

    def pairs(self, items: tuple, path: Path, depth: int) -> list[tuple[Any, Any]]:
        out = []
        for k, v in items:
            key = self.key(k, path.child("<key>"), depth + 1)
            out.append((key, self.build(v, path.child(key), depth + 1)))
        return out

    def key(self, node: Any, path: Path, depth: int) -> Any:
        """A dict key: only the kinds ``flatten`` writes as keys."""
        if type(node) is list:  # format 1 stored tuple keys as lists
            return tuple(self.key(x, path, depth + 1) for x in node)
        n = self.parse(node, path, depth)
        if n.kind in ("tuple", "frozenset"):
            keys = [self.key(x, path, depth + 1) for x in n.items]
            return tuple(keys) if n.kind == "tuple" else frozenset(keys)
        if n.kind not in ("scalar", "float", "complex", "np"):
            raise _bad(path, f"a dict key of kind {n.kind}: save writes keys only of None, bool, numbers, str, "
                             "numpy scalars and tuples/frozensets of those")
        return self.build(node, path, depth)

    def set_item(self, node: Any, path: Path, depth: int) -> Any:
        """A set's item: only the kinds ``flatten`` writes in sets (bytes are leaves)."""
        n = self.parse(node, path, depth)
        if n.kind in ("tuple", "frozenset"):
            items = [self.set_item(x, path, depth + 1) for x in n.items]
            return tuple(items) if n.kind == "tuple" else frozenset(items)
        if n.kind == "leaf":
            obj = self.leaf(n, path)
            if self.kind(n.value) not in ("bytes", None):
                raise _bad(path, f"a set holds a {self.kind(n.value)} leaf: save writes only bytes leaves in sets")
            return obj
        if n.kind not in ("scalar", "float", "complex", "np", "dtype", "device"):
            raise _bad(path, f"a set item of kind {n.kind}: sets hold only None, bool, numbers, str, bytes, numpy "
                             "scalars, torch dtypes and devices, and tuples/frozensets of those")
        return self.build(node, path, depth)

    def mapping(self, n: Node, path: Path, depth: int) -> Any:
        kind, factory = n.value
        cls = _MAPS[kind]
        items = self.pairs(n.items, path, depth)
        if kind == "defaultdict":
            obj = collections.defaultdict(_FACTORIES[factory] if factory else None, items)
        else:
            obj = cls()
            if kind == "Counter":
                dict.update(obj, items)  # Counter(pairs) would count the pairs
            else:
                obj.update(items)
        self.set_attrs(obj, cls, n.attrs, path, depth)
        return obj

    def tensor_attrs(self, n: Node, path: Path, depth: int) -> Any:
        inner = self.parse(n.inner, path, depth + 1)
        if inner.kind not in ("leaf", "ref", "view"):
            raise _bad(path, f"__attrs__ on a {inner.kind}: save writes attributes only on tensors")
        if inner.kind == "view":
            obj = self.view(inner.value, path)
        else:
            obj = self.leaf(inner, path)
            kind = self.kind(inner.value)
            if kind not in ("torch", None):
                raise _bad(path, f"__attrs__ on a {kind} leaf: save writes attributes only on tensors")
        if not _is_tensor(obj):  # a placeholder: the attributes are checked, not set
            for name, _ in n.attrs:
                why = attribute_problem(_torch_types()[0] if _torch_types() else object, name)
                if why:
                    raise _bad(path, why)
            return obj
        self.set_attrs(obj, type(obj), n.attrs, path, depth)
        return obj

    def set_attrs(self, obj: Any, cls: type, attrs: tuple, path: Path, depth: int) -> None:
        for name, node in attrs:
            why = attribute_problem(cls, name)
            if why:
                raise _bad(path, why)
            setattr(obj, name, self.build(node, path.child(f".{name}"), depth + 1))


def _float(v: Any, path: Path) -> Any:
    if v in ("nan", "inf", "-inf"):
        return float(v)
    if isinstance(v, str) and re.fullmatch(r"[0-9a-f]{16}", v):
        return struct.unpack(">d", bytes.fromhex(v))[0]
    # Format 1 wrote numpy float64 NaN/inf (a float subclass) as its repr; read them back exactly.
    m = re.fullmatch(r"np\.float64\((nan|inf|-inf)\)", v) if isinstance(v, str) else None
    if m:
        return np.float64(m.group(1))
    raise _bad(path, f"bad float {str(v)[:40]!r}")


def _complex(v: Any, path: Path) -> complex:
    if type(v) is not list or len(v) != 2:
        raise _bad(path, "complex needs [real, imag]")
    parts = []
    for x in v:
        if type(x) is float:
            parts.append(x)
        elif type(x) is dict and len(x) == 1 and "__float__" in x:
            parts.append(_float(x["__float__"], path))
        else:
            raise _bad(path, "complex parts are not floats")
    return complex(*parts)


def _np_from(v: Any, path: Path) -> np.generic:
    try:
        dtype_str, hexbytes = v
        dt = np.dtype(dtype_str)
        if dt.kind not in NUMPY_KINDS or dt.fields is not None or dt.hasobject or dt.str != dtype_str:
            raise ValueError(f"dtype {str(dtype_str)[:20]!r}")
        raw = bytes.fromhex(hexbytes)
        if len(raw) != dt.itemsize:
            raise ValueError(f"{len(raw)} bytes for a {dt.itemsize}-byte scalar")
        return np.frombuffer(raw, dtype=dt)[0]
    except (TypeError, ValueError) as e:
        raise _bad(path, f"bad numpy scalar ({e})") from None


def _size(v: Any, path: Path) -> Any:
    if type(v) is not list or not all(type(x) is int and 0 <= x <= _MAX_SIZE_DIM for x in v):
        raise _bad(path, "torch.Size of other than non-negative ints")
    return _torch().Size(v)


def _dtype(v: Any, path: Path) -> Any:
    torch = _torch()
    dtype = getattr(torch, v, None) if v in TORCH_DTYPES or v in REFUSED_TORCH_DTYPES else None
    if not isinstance(dtype, torch.dtype):
        raise _bad(path, f"unknown torch dtype {str(v)[:40]!r}")
    return dtype


def _device(v: Any, path: Path) -> Any:
    if not isinstance(v, str) or not _DEVICE.match(v):
        raise _bad(path, f"malformed device {str(v)[:40]!r}")
    try:
        return _torch().device(v)
    except (RuntimeError, ValueError) as e:
        raise _bad(path, f"device {v!r} is not one torch knows ({str(e)[:80]})") from None


_ATOMS = {"float": _float, "complex": _complex, "np": _np_from, "size": _size, "dtype": _dtype, "device": _device}


# --- queries on a skeleton -------------------------------------------------------------------------

def leaf_indices(skeleton: Any) -> set[int]:
    """The leaf indices a skeleton refers to (``__leaf__`` and ``__ref__``); malformed nodes are
    skipped (``unflatten`` reports them)."""
    found: set[int] = set()
    stack = [skeleton]
    while stack:
        try:
            n = parse(stack.pop())
        except _Bad:
            continue
        if n.kind in ("leaf", "ref"):
            found.add(n.value)
        elif n.kind == "view":
            found.add(n.value.storage)
        elif n.kind in _SEQUENCES:
            stack.extend(n.items)
        elif n.kind in _KEYED:
            stack.extend(v for _, v in n.items)
        if n.kind in ("attrs", "map"):
            stack.extend(v for _, v in n.attrs)
        if n.kind == "attrs":
            stack.append(n.inner)
    return found


def view_paths(skeleton: Any) -> list[tuple[str, View]]:
    """Each distinct ``__view__`` of a skeleton with the path of its first place, spelled as leaf
    paths are (``/model/w``), in walk order; malformed nodes are skipped (``unflatten`` reports them)."""
    found: dict[View, str] = {}
    stack: list[tuple[Any, str]] = [(skeleton, "")]
    while stack:
        node, path = stack.pop()
        try:
            n = parse(node)
        except _Bad:
            continue
        children: list[tuple[Any, str]] = []
        if n.kind == "view":
            found.setdefault(n.value, path or "/")
        elif n.kind in ("list", "tuple"):
            children = [(x, f"{path}/{i}") for i, x in enumerate(n.items)]
        elif n.kind == "dict":
            children = [(v, f"{path}/{k}") for k, v in n.items]
        elif n.kind in ("items", "map"):
            for k, v in n.items:
                try:
                    children.append((v, f"{path}/{decode_key(k)}"))
                except (CorruptCheckpoint, TypeError):
                    continue
        elif n.kind == "attrs":
            children = [(n.inner, path)]
        if n.kind in ("attrs", "map"):
            children += [(v, f"{path}/.{name}") for name, v in n.attrs]
        stack.extend(reversed(children))
    return [(p, v) for v, p in found.items()]


def decode_key(node: Any) -> Any:
    """A keyed container's key node as the Python value; raises CorruptCheckpoint if malformed."""
    key = _Decoder([], []).key(node, Path(), 0)
    hash(key)
    return key


def key_name(key: Any) -> str:
    """How a '/'-path names a key: a str as itself, an int as its digits, others as JSON."""
    import json

    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    return json.dumps(key) if key is None or isinstance(key, (bool, float)) else repr(key)


def prune(skeleton: Any, select: list[str]) -> Any:
    """The part of ``skeleton`` under the given '/'-separated key paths (e.g. ``["model"]``, or
    ``["optimizer/param_groups"]``), inside the same containers. Raises KeyError naming a path
    that is not in the state. "0" names the int key 0 of optimizer state, unless "0" is a key."""
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

    def take(node: Any, want: dict[str, Any] | None, path: str) -> Any:
        if want is None:
            return node
        try:
            n = parse(node)
        except _Bad:
            n = Node("scalar")
        pairs = n.items if n.kind in _KEYED else ()
        names: dict[str, int] = {}  # a key's name -> its position (a str key wins over an int's digits)
        for pos, (k, _) in enumerate(pairs):
            try:
                key = k if n.kind == "dict" else decode_key(k)
            except (CorruptCheckpoint, TypeError):
                continue
            name = key_name(key)
            if name not in names or isinstance(key, str):
                names[name] = pos
        for name in want:
            if name not in names:
                raise KeyError(f"'{path}/{name}' is not in the saved state")
        chosen = {names[name]: name for name in want}
        kept = tuple((k, take(v, want[chosen[pos]], f"{path}/{chosen[pos]}")) for pos, (k, v) in enumerate(pairs)
                     if pos in chosen)
        return Node(n.kind, n.value, kept, n.attrs, n.inner).json()

    return take(skeleton, wanted, "")
