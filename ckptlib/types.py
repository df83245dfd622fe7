"""What a leaf is, independent of where its bytes are: ``LeafSpec``. No torch here.

A *leaf* is one array of a state: a torch tensor, a numpy array, or a bytes/bytearray object.
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

# torch dtype name -> (element size, numeric kind). Kept here so that reading a manifest never
# needs torch: "f" real float (IEEE-like: what ordered-integer deltas may treat as floats), "c"
# complex, "i"/"u" integers, "b" bool, "f8" 8-bit floats (ordered like integers, not floats).
TORCH_DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "f"), "float32": (4, "f"), "float16": (2, "f"), "bfloat16": (2, "f"),
    "complex128": (16, "c"), "complex64": (8, "c"), "complex32": (4, "c"),
    "int64": (8, "i"), "int32": (4, "i"), "int16": (2, "i"), "int8": (1, "i"),
    "uint64": (8, "u"), "uint32": (4, "u"), "uint16": (2, "u"), "uint8": (1, "u"), "bool": (1, "b"),
    "float8_e4m3fn": (1, "f8"), "float8_e5m2": (1, "f8"), "float8_e4m3fnuz": (1, "f8"),
    "float8_e5m2fnuz": (1, "f8"), "float8_e8m0fnu": (1, "f8"),
}
KINDS = ("torch", "numpy", "bytes", "bytearray", "npscalar")  # npscalar: format 1 only
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
    kind: str  # "torch" | "numpy" | "bytes" | "bytearray" (format 1 also "npscalar")
    dtype: str  # torch: "float32", "bfloat16", ...; numpy: dtype.str, e.g. "<f4"; bytes: "|u1"
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
        if self.kind == "torch":
            return TORCH_DTYPES.get(self.dtype, (0, ""))[1] == "f"
        if self.kind in ("bytes", "bytearray"):
            return False
        return np.dtype(self.dtype).kind == "f"

    @property
    def group(self) -> tuple[str, int, bool]:
        """Small leaves of one group share packed objects: the top-level key (so a partial restore
        of one key reads only its own objects), the element size (byte planes line up) and whether
        the elements are floats (deltas treat them alike)."""
        top = self.path.split("/", 2)[1] if self.path.count("/") >= 1 else ""
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
        if self.kind in ("bytes", "bytearray") and len(self.shape) != 1:
            raise bad("a bytes leaf is one-dimensional")
        if self.param and self.kind != "torch":
            raise bad("only torch tensors can be parameters")
        if self.requires_grad and (self.kind != "torch" or TORCH_DTYPES[self.dtype][1] not in "fc"):
            raise bad("only floating point and complex torch tensors can require grad")
        return self


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
    if kind == "torch":
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
