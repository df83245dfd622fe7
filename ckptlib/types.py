"""What a leaf is, independent of where its bytes are: ``LeafSpec``. No torch here.

A *leaf* is one array of a state: a torch tensor, a numpy array, or a bytes/bytearray object; or
the *storage* that torch tensors sharing memory view (kind ``storage``: a 1-D tensor of the bytes
they span, which the skeleton's ``__view__`` nodes view; see ``View``).
Its spec is what a manifest records of it and what a restore needs to allocate it again. Every
spec read from a store passes :meth:`LeafSpec.checked` before anything is allocated: sizes,
shapes, strides and dtypes from a hostile or damaged manifest are refused with
``CorruptCheckpoint`` instead of becoming huge allocations or raw errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CorruptCheckpoint

# torch dtype name -> (element size, numeric kind): the dtypes whose tensors are stored. Kept here
# so that reading a manifest never needs torch: "f" real float (IEEE-like: what ordered-integer
# deltas may treat as floats), "c" complex, "i"/"u" integers, "b" bool, "f8" 8-bit floats and "f4"
# pairs of 4-bit floats (stored as their bits, like integers), "x" raw bits (no arithmetic at all).
TORCH_DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "f"), "float32": (4, "f"), "float16": (2, "f"), "bfloat16": (2, "f"),
    "complex128": (16, "c"), "complex64": (8, "c"), "complex32": (4, "c"),
    "int64": (8, "i"), "int32": (4, "i"), "int16": (2, "i"), "int8": (1, "i"),
    "uint64": (8, "u"), "uint32": (4, "u"), "uint16": (2, "u"), "uint8": (1, "u"), "bool": (1, "b"),
    "float8_e4m3fn": (1, "f8"), "float8_e5m2": (1, "f8"), "float8_e4m3fnuz": (1, "f8"),
    "float8_e5m2fnuz": (1, "f8"), "float8_e8m0fnu": (1, "f8"), "float4_e2m1fn_x2": (1, "f4"),
    "bits8": (1, "x"), "bits16": (2, "x"), "bits1x8": (1, "x"), "bits2x4": (1, "x"), "bits4x2": (1, "x"),
}
_SHELL = ("a shell dtype: this torch has no kernels for it, not even a copy; store t.view(torch.uint8) "
          "(its bytes) and the dtype's name")
_QUANTIZED = ("quantized: its scale and zero point are not in its bytes; store t.int_repr() with "
              "t.q_scale()/t.q_zero_point(), or t.dequantize()")
# torch dtype name -> why its tensors are refused. Every dtype of torch is in one of the two tables
# (tests/test_state_roundtrip.py checks it against the installed torch); a torch.dtype *value* of
# either table is stored (it is a name).
REFUSED_TORCH_DTYPES: dict[str, str] = {
    **{f"{sign}int{bits}": _SHELL for sign in ("", "u") for bits in range(1, 8)},
    **dict.fromkeys(("qint8", "qint32", "quint8", "quint4x2", "quint2x4"), _QUANTIZED),
}
GRAD_KINDS = ("f", "f8", "f4", "c")  # what torch lets require grad: floating point and complex
KINDS = ("torch", "storage", "numpy", "bytes", "bytearray", "npscalar")  # npscalar: format 1 only
TORCH_KINDS = ("torch", "storage")  # leaves that are torch tensors (a storage: bytes that views share)
NUMPY_KINDS = "biufcmMUS"  # numeric, bool, datetime, fixed-width strings: plain bytes, no pickle

MAX_NDIM = 64
# Largest leaf a manifest may declare. Far above any real tensor, far below what would make a
# size computation overflow; what actually fits is checked against memory by the reader.
MAX_LEAF_BYTES = 1 << 50


@dataclass(frozen=True)
class LeafSpec:
    """One leaf: where it sits in the state, its type and layout. Immutable, JSON-serialisable.

    ``stride``: element strides of a torch tensor stored in memory order (channels-last and other
    dense layouts); None means C-contiguous. ``order``: "F" for a Fortran-ordered numpy array.
    ``param``/``requires_grad``: a torch ``nn.Parameter`` and its flag, restored as such.
    """

    path: str  # human-readable location, e.g. "/optimizer/state/0/exp_avg"
    kind: str  # "torch" | "storage" | "numpy" | "bytes" | "bytearray" (format 1 also "npscalar")
    dtype: str  # torch, storage: "float32", "bfloat16", ...; numpy: dtype.str, e.g. "<f4"; bytes: "|u1"
    shape: tuple[int, ...]
    nbytes: int
    itemsize: int
    stride: tuple[int, ...] | None = None
    order: str = "C"
    param: bool = False
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        """Real IEEE-like floating point elements (what deltas may map to ordered integers)."""
        if self.kind in TORCH_KINDS:
            return TORCH_DTYPES.get(self.dtype, (0, ""))[1] == "f"
        if self.kind in ("bytes", "bytearray"):
            return False
        return np.dtype(self.dtype).kind == "f"

    @property
    def group(self) -> tuple[str, int, bool]:
        """Small leaves of one group share packed objects: the top-level key (so a partial restore
        of one key reads only its own objects), the element size (byte planes line up) and whether
        the elements are floats (deltas treat them alike). A leaf that is itself the value of a
        dotted top-level key (a flat ``state_dict()`` of names) groups by the key's first dotted
        component, numbered ones together (the layers of a top-level ``nn.Sequential``): the leaves
        of "layer1.0.conv1.weight", "layer1.0.bn1.bias", ... share packs, so a flat state is about
        ``bytes / chunk`` objects too, and a restore of one key still reads one pack."""
        parts = self.path.split("/", 2)
        top = parts[1] if len(parts) > 1 else ""
        if len(parts) == 2 and "." in top:
            head = top.split(".", 1)[0]
            top = "." if head.isdigit() else f"{head}."
        return top, self.itemsize, self.is_float

    def logical_json(self) -> dict[str, Any]:
        """The fields that make up the leaf's identity in the logical digest (no storage details)."""
        d: dict[str, Any] = {"path": self.path, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}
        if self.stride is not None:
            d["stride"] = list(self.stride)
        if self.order != "C":
            d["order"] = self.order
        if self.param:
            d["param"] = True
        if self.requires_grad:
            d["requires_grad"] = True
        return d

    def to_json(self) -> dict[str, Any]:
        return {**self.logical_json(), "nbytes": self.nbytes, "itemsize": self.itemsize}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LeafSpec:
        """Parse and check a spec from a manifest (raises CorruptCheckpoint on anything wrong)."""
        try:
            stride = d.get("stride")
            spec = cls(str(d["path"]), d["kind"], d["dtype"], tuple(d["shape"]), d["nbytes"], d["itemsize"],
                       tuple(stride) if stride is not None else None, d.get("order", "C"),
                       d.get("param", False), d.get("requires_grad", False))
        except (KeyError, TypeError) as e:
            raise CorruptCheckpoint(f"malformed leaf entry in manifest ({type(e).__name__}: {e})") from None
        return spec.checked()

    def checked(self) -> LeafSpec:
        """This spec, if it describes an array that can exist; CorruptCheckpoint otherwise."""
        where = f"leaf {self.path!r}"

        def bad(why: str) -> CorruptCheckpoint:
            return CorruptCheckpoint(f"{where} in the manifest is malformed: {why}")

        if self.kind not in KINDS:
            raise bad(f"unknown kind {self.kind!r}")
        if not all(_is_int(v) and v >= 0 for v in self.shape) or len(self.shape) > MAX_NDIM:
            raise bad(f"shape {list(self.shape)!r} is not a list of at most {MAX_NDIM} non-negative ints")
        if not all(isinstance(f, bool) for f in (self.param, self.requires_grad)) or self.order not in ("C", "F"):
            raise bad("param/requires_grad must be booleans and order 'C' or 'F'")
        itemsize = _itemsize(self.kind, self.dtype)
        if itemsize is None:
            raise bad(f"dtype {self.dtype!r} is not a plain {self.kind} dtype")
        if not _is_int(self.itemsize) or self.itemsize != itemsize:
            raise bad(f"itemsize {self.itemsize!r} does not match dtype {self.dtype!r} ({itemsize})")
        numel = 1
        for v in self.shape:
            numel *= v
            if numel * itemsize > MAX_LEAF_BYTES:
                raise bad(f"shape {list(self.shape)} is larger than {MAX_LEAF_BYTES} bytes")
        if not _is_int(self.nbytes) or self.nbytes != numel * itemsize:
            raise bad(f"nbytes {self.nbytes!r} is not shape x itemsize ({numel * itemsize})")
        if self.stride is not None and (self.kind != "torch" or len(self.stride) != len(self.shape)
                                        or not all(_is_int(v) and v >= 0 for v in self.stride)
                                        or not dense_strides(self.shape, self.stride)):
            raise bad(f"stride {list(self.stride)!r} is not a dense layout of shape {list(self.shape)}")
        if self.kind in ("bytes", "bytearray", "storage") and len(self.shape) != 1:
            raise bad(f"a {self.kind} leaf is one-dimensional")
        if self.param and self.kind != "torch":
            raise bad("only torch tensors can be parameters")
        if self.requires_grad and (self.kind != "torch" or TORCH_DTYPES[self.dtype][1] not in GRAD_KINDS):
            raise bad("only floating point and complex torch tensors can require grad")
        return self


@dataclass(frozen=True)
class View:
    """A tensor that views a storage leaf (the skeleton's ``__view__`` node): torch tensors that
    share memory but are not the same view (``w`` and ``w.view(20)``, slices, another dtype), or
    that carry a lazy conjugate/negative bit, are stored as one storage leaf and a view each.
    ``offset``: where the view starts in the storage, in elements of its own ``dtype``."""

    storage: int  # the index of the storage leaf
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # a torch dtype name
    param: bool = False
    requires_grad: bool = False
    conj: bool = False
    neg: bool = False

    @property
    def itemsize(self) -> int:
        return TORCH_DTYPES[self.dtype][0]

    @property
    def end(self) -> int:
        """The byte just after the view's last element in its storage."""
        if math.prod(self.shape) == 0:
            return self.offset * self.itemsize
        last = self.offset + sum((n - 1) * st for n, st in zip(self.shape, self.stride))
        return (last + 1) * self.itemsize

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"storage": self.storage, "offset": self.offset, "shape": list(self.shape),
                             "stride": list(self.stride), "dtype": self.dtype}
        d.update((flag, True) for flag in _VIEW_FLAGS if getattr(self, flag))
        return d

    @classmethod
    def from_json(cls, d: Any) -> View:
        """Parse and check a view node's fields (ValueError saying what is wrong). Its bounds
        against its storage are the decoder's to check: the storage is a leaf of the part."""
        if type(d) is not dict or not set(d) >= _VIEW_FIELDS or not set(d) <= _VIEW_FIELDS | set(_VIEW_FLAGS):
            raise ValueError(f"a view has the fields {sorted(_VIEW_FIELDS)} and the flags {list(_VIEW_FLAGS)}")
        shape, stride, dtype = d["shape"], d["stride"], d["dtype"]
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"unknown torch dtype {str(dtype)[:40]!r}")
        ints = [d["storage"], d["offset"]]
        if type(shape) is not list or type(stride) is not list or len(shape) != len(stride) or len(shape) > MAX_NDIM:
            raise ValueError(f"shape and stride are not two lists of one length up to {MAX_NDIM}")
        if not all(_is_int(v) and 0 <= v <= MAX_LEAF_BYTES for v in ints + shape + stride):
            raise ValueError("storage, offset, shape and stride are not non-negative ints")
        flags = [d.get(flag, False) for flag in _VIEW_FLAGS]
        if not all(type(f) is bool for f in flags):
            raise ValueError("a view's flags are booleans")
        view = cls(d["storage"], d["offset"], tuple(shape), tuple(stride), dtype, *flags)
        kind = TORCH_DTYPES[dtype][1]
        if view.conj and kind != "c":
            raise ValueError("only a complex view has a conjugate bit")
        if view.requires_grad and kind not in GRAD_KINDS:
            raise ValueError("only floating point and complex tensors can require grad")
        if math.prod(view.shape) * view.itemsize > MAX_LEAF_BYTES or view.end > MAX_LEAF_BYTES:
            raise ValueError(f"the view is larger than {MAX_LEAF_BYTES} bytes")
        return view


_VIEW_FIELDS = {"storage", "offset", "shape", "stride", "dtype"}
_VIEW_FLAGS = ("param", "requires_grad", "conj", "neg")


def dense_strides(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``shape`` out densely without overlap (a permutation of a contiguous
    layout, e.g. channels-last): then the tensor's memory is exactly numel elements."""
    expected = 1
    for st, size in sorted((st, size) for st, size in zip(stride, shape) if size != 1):
        if st != expected:
            return False
        expected *= size
    return True


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _itemsize(kind: str, dtype: Any) -> int | None:
    """Element size of a (kind, dtype) a manifest may name; None if it names anything else."""
    if not isinstance(dtype, str):
        return None
    if kind in TORCH_KINDS:
        return TORCH_DTYPES.get(dtype, (None, ""))[0]
    if kind in ("bytes", "bytearray"):
        return 1 if dtype == "|u1" else None
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        return None
    if dt.kind not in NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None or dt.hasobject \
            or dt.str != dtype:
        return None
    return dt.itemsize
