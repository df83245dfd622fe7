"""Write a restored state as one file other tools read: ``.pt`` (``torch.load(weights_only=True)``) or
``.safetensors`` (flat tensors + JSON metadata).

Exact or refused, as a checkpoint is: a value the target format holds exactly is written as it is;
any other is refused with ``UnsupportedState`` naming its path and type, before anything is
written, unless ``convert`` asks for the nearest value the format holds, and every conversion made
is listed in the result (``Exported.converted``). What each format holds is probed from the
installed torch and safetensors (a round trip of a small sample), never assumed from a version:

* ``.pt``: everything ``torch.load(weights_only=True)`` gives back with its type and value: tensors
  of every dtype it loads, with their bits, strides, attributes and storage sharing, Parameters,
  containers, sets, bytes, Counter and OrderedDict (with attributes) where the installed torch keeps
  them. ``convert``: numpy arrays become tensors (datetimes their int64 ticks), numpy scalars Python
  numbers, frozensets sets, defaultdicts dicts, and what else the probe says torch does not keep.
* ``.safetensors``: named tensors of the dtypes the installed safetensors stores and numpy arrays of
  those dtypes, under dotted names (the containers of tensors are names: their types, key types and
  attributes are not kept, by the format's design); other values go to its string
  metadata as JSON, under their dotted name, when JSON holds them exactly (None, bool, int, finite
  float, str, lists and str-keyed dicts of those). ``convert``: the other values as the nearest
  JSON (tuples and sets as lists, other keys as strings, NaN/inf, complex, dtypes and devices as
  strings, tensors in metadata as lists). safetensors holds no storage sharing and no lazy bits:
  tensors that share memory are written each as its own copy, and conjugate/negative views with
  their values resolved (same values; documented, not a conversion).

What no conversion can hold (numpy ``longdouble`` or fixed-width strings as tensors) is refused
either way. The file is written atomically (a temp file beside it, fsynced, renamed), gets the
mode any file the user writes gets (0666 less the umask), in both formats, and an existing file is
replaced only with ``force``.
"""

from __future__ import annotations

import collections
import functools
import io
import json
import math
import os
import stat
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import UnsupportedState
from .leaves import without_flags

FORMATS = {".pt": "pt", ".pth": "pt", ".safetensors": "safetensors"}
_CONVERT_HINT = "pass convert=True (ckpt export --convert) to write the nearest value the format holds"


@dataclass(frozen=True)
class Exported:
    """A written export: the file's size, and each conversion made ("<path>: <from> -> <to>")."""

    size: int
    converted: tuple[str, ...] = ()


def format_of(path: str) -> str:
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise ValueError(f"cannot export to {path!r}: the file name must end in .pt (torch.load with "
                         "weights_only=True) or .safetensors (flat tensors + JSON metadata)")
    return fmt


def _type_name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


# --- what the installed libraries hold (probed once per process) -----------------------------------

def _pt_samples() -> dict[str, Any]:
    import torch

    od = collections.OrderedDict(a=1)
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    tagged = torch.ones(1)
    tagged.note = "x"  # type: ignore[attr-defined]
    return {"set": {1, (2, "a")}, "frozenset": frozenset({1}), "bytes": b"\x00a", "bytearray": bytearray(b"a"),
            "Counter": collections.Counter(a=2), "defaultdict": collections.defaultdict(list, {"a": [1]}),
            "OrderedDict": od, "tensor attributes": tagged, "numpy array": np.zeros(1), "numpy scalar": np.float64(1)}


@functools.cache
def pt_keeps(kind: str) -> bool:
    """Whether ``torch.load(weights_only=True)`` of the installed torch gives back a value of this
    kind (a key of the probe's samples) with its exact type, attributes and value."""
    import torch

    sample = _pt_samples()[kind]
    buf = io.BytesIO()
    try:
        torch.save({"v": sample}, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)["v"]
    except Exception:  # noqa: BLE001 - any failure means: not kept
        return False
    if type(back) is not type(sample) or getattr(back, "__dict__", {}) != getattr(sample, "__dict__", {}):
        return False
    if isinstance(sample, torch.Tensor):
        return bool(torch.equal(back, sample))
    if isinstance(sample, np.ndarray):
        return bool(np.array_equal(back, sample))
    return bool(back == sample) and getattr(back, "default_factory", None) is getattr(sample, "default_factory", None)


def _sample_tensor(dtype: Any) -> Any:
    import torch

    return torch.zeros(2 * dtype.itemsize, dtype=torch.uint8).view(dtype)


@functools.cache
def pt_keeps_dtype(dtype: Any) -> bool:
    """Whether the installed torch saves and loads (weights_only) a tensor of ``dtype``, bit-exact."""
    import torch

    t, buf = _sample_tensor(dtype), io.BytesIO()
    try:
        torch.save(t, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)
        return back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    except Exception:  # noqa: BLE001 - any failure means: not kept
        return False


@functools.cache
def safetensors_keeps(dtype: Any) -> bool:
    """Whether the installed safetensors stores and loads a tensor of ``dtype``, bit-exact."""
    import torch
    from safetensors.torch import load, save

    t = _sample_tensor(dtype)
    try:
        back = load(save({"t": t}))["t"]
        return back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    except Exception:  # noqa: BLE001 - any failure means: not kept
        return False


def _safetensors_version() -> str:
    import safetensors

    return getattr(safetensors, "__version__", "?")


# --- .pt -------------------------------------------------------------------------------------------

class _Conversions:
    """What an export walk converted, or refuses without ``convert``."""

    def __init__(self, convert: bool, fmt: str):
        self.convert, self.fmt = convert, fmt
        self.done: list[str] = []

    def note(self, path: str, obj: Any, to: str, why: str) -> None:
        """Convert ``obj`` at ``path`` to ``to`` (recorded), or refuse when not asked to."""
        if not self.convert:
            raise UnsupportedState(f"'{path or '/'}' is a {_type_name(obj)}, which a .{self.fmt} export {why}; "
                                   f"{_CONVERT_HINT} ({to})")
        self.done.append(f"{path or '/'}: {_type_name(obj)} -> {to}")


def _numpy_to_tensor(a: np.ndarray, path: str, conv: _Conversions, why: str | None = None) -> Any:
    """The array as a tensor of the same values; ``why``: the format holds no arrays (a conversion)."""
    import torch

    if a.dtype.kind in "US" or a.dtype == np.longdouble and a.dtype.itemsize > 8:
        raise UnsupportedState(f"'{path or '/'}' is a numpy {a.dtype} array, which torch has no dtype for; "
                               "export can only write numeric arrays torch can hold (convert it first)")
    if why is not None:
        conv.note(path, a, "torch.Tensor", why)
    if a.dtype.kind in "mM":  # datetimes: their int64 ticks
        conv.note(path, a, f"its int64 ticks ({a.dtype})", "holds as no dtype")
        a = a.view(np.int64)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))  # same values, this machine's byte order
    return torch.from_numpy(np.ascontiguousarray(a).copy())


class _PtWalk:
    """A state as ``torch.load(weights_only=True)`` gives it back: the same, or refused/converted."""

    def __init__(self, conv: _Conversions):
        import torch

        self.torch, self.conv = torch, conv
        self.dtypes: dict[tuple[str, int], Any] = {}  # storage -> the dtype its first tensor views it as

    def value(self, obj: Any, path: str) -> Any:
        torch, conv = self.torch, self.conv
        if isinstance(obj, torch.Tensor):
            if not pt_keeps_dtype(obj.dtype):
                raise UnsupportedState(f"'{path or '/'}' is a {obj.dtype} tensor, which torch {torch.__version__} "
                                       "cannot save and load with weights_only=True")
            if getattr(obj, "__dict__", None) and not pt_keeps("tensor attributes"):
                conv.note(path, obj, "a tensor without its Python attributes", "loads without them")
            return self.one_dtype_per_storage(obj.detach() if obj.requires_grad and not obj.is_leaf else obj, path)
        if isinstance(obj, np.ndarray):
            return _numpy_to_tensor(obj, path, conv, "cannot load (weights_only=True refuses numpy arrays)")
        if isinstance(obj, np.generic):
            return self.scalar(obj, path)
        if isinstance(obj, (bytes, bytearray)) and not pt_keeps(type(obj).__name__):
            conv.note(path, obj, "a uint8 tensor", "does not load back")
            return torch.frombuffer(bytearray(obj), dtype=torch.uint8) if obj else torch.empty(0, dtype=torch.uint8)
        if isinstance(obj, dict):
            return self.mapping(obj, path)
        if isinstance(obj, (set, frozenset)):
            return self.set(obj, path)
        if type(obj) is list:
            return [self.value(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(self.value(v, f"{path}/{i}") for i, v in enumerate(obj))
        return obj

    def one_dtype_per_storage(self, t: Any, path: str) -> Any:
        """torch.save cannot save views of one storage as different dtypes: such a view is written
        as its own copy (converted)."""
        if not t.numel():
            return t
        where = (str(t.device), t.untyped_storage().data_ptr())
        if self.dtypes.setdefault(where, t.dtype) == t.dtype:
            return t
        self.conv.note(path, t, f"its own copy (it views memory that a {self.dtypes[where]} tensor views)",
                       "cannot hold as a view (torch.save saves a storage as one dtype)")
        copy = without_flags(t).clone()  # the memory's values; the bits again on top
        copy = copy.conj() if t.is_conj() else copy
        return self.torch._neg_view(copy) if t.is_neg() else copy

    def scalar(self, obj: np.generic, path: str) -> Any:
        """A numpy scalar as the Python value of its bits (converted): long doubles have none."""
        dt = obj.dtype
        if dt.kind in "fc" and dt.itemsize > (8 if dt.kind == "f" else 16):
            raise UnsupportedState(f"'{path or '/'}' is a numpy {dt} scalar, which a .pt export cannot hold "
                                   "(a Python float has fewer bits)")
        item = obj.astype(np.int64).item() if dt.kind in "mM" else obj.item()
        self.conv.note(path, obj, type(item).__name__, "cannot load (weights_only=True refuses numpy scalars)")
        return item

    def mapping(self, obj: dict, path: str) -> Any:
        items = [(self.hashable(k, f"{path}/<key>"), self.value(v, f"{path}/{k}")) for k, v in obj.items()]
        if len({k for k, _ in items}) != len(items):
            raise UnsupportedState(f"'{path or '/'}': two keys are the same once converted; export to .safetensors "
                                   "or convert the keys first")
        cls = type(obj)
        name = cls.__name__
        if cls is not dict and not pt_keeps(name):
            self.conv.note(path, obj, "dict", "does not load back (the type and its factory are lost)")
            return dict(items)
        out = collections.defaultdict(obj.default_factory) if isinstance(obj, collections.defaultdict) else cls()
        if cls is collections.Counter:
            dict.update(out, items)
        else:
            out.update(items)
        for attr, v in getattr(obj, "__dict__", {}).items():
            setattr(out, attr, self.value(v, f"{path}/.{attr}"))
        return out

    def set(self, obj: set | frozenset, path: str) -> Any:
        items = [self.hashable(v, f"{path}/<item>") for v in obj]
        if type(obj) is frozenset and not pt_keeps("frozenset"):
            self.conv.note(path, obj, "set", "does not load back")
            return set(items)
        if type(obj) is set and not pt_keeps("set"):
            self.conv.note(path, obj, "list", "does not load back")
            return items
        return type(obj)(items)

    def hashable(self, v: Any, path: str) -> Any:
        """A dict key or a set item as .pt holds it: numpy scalars convert; a frozenset cannot (a set
        is not hashable), unless torch keeps frozensets."""
        if isinstance(v, np.generic):
            return self.scalar(v, path)
        if type(v) is tuple:
            return tuple(self.hashable(k, f"{path}/{i}") for i, k in enumerate(v))
        if type(v) is frozenset:
            if not pt_keeps("frozenset"):
                raise UnsupportedState(f"'{path}' is a frozenset inside a dict key or a set, which a .pt export cannot "
                                       "hold (no conversion keeps it hashable); store a tuple, or export to "
                                       ".safetensors with convert")
            return frozenset(self.hashable(k, f"{path}/<item>") for k in v)
        return v


def to_weights_only(state: Any, *, convert: bool = False) -> tuple[Any, list[str]]:
    """(the state as ``torch.load(weights_only=True)`` gives it back, the conversions made).
    Raises UnsupportedState naming the first value .pt cannot hold (without ``convert``: also the
    first value it would have to convert)."""
    conv = _Conversions(convert, "pt")
    return _PtWalk(conv).value(state, ""), conv.done


# --- .safetensors ----------------------------------------------------------------------------------

def _json_exact(obj: Any, depth: int = 0) -> bool:
    """Whether ``json.loads(json.dumps(obj))`` is ``obj`` again, type and value."""
    if obj is None or type(obj) in (bool, int, str):
        return True
    if type(obj) is float:
        return math.isfinite(obj)
    if depth > 100:
        return False
    if type(obj) is list:
        return all(_json_exact(v, depth + 1) for v in obj)
    if type(obj) is dict:
        return all(type(k) is str and _json_exact(v, depth + 1) for k, v in obj.items())
    return False


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, complex):
        return [obj.real, obj.imag]
    if isinstance(obj, (bytes, bytearray)):
        return list(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    import torch

    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().resolve_conj().resolve_neg().tolist()
    raise TypeError(f"a value of type {type(obj).__name__}")


def _loose_json(obj: Any) -> str:
    """The nearest JSON of a value (``convert``): keys as strings, NaN/inf as JSON's extensions."""
    def keys(o: Any) -> Any:
        if isinstance(o, dict):
            return {str(k) if not isinstance(k, str) else k: keys(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [keys(v) for v in o]
        return o

    return json.dumps(keys(obj), default=_json_default)


class _SafetensorsWalk:
    """A state as safetensors holds it: dotted names of tensors, JSON metadata of the rest."""

    def __init__(self, conv: _Conversions):
        import torch

        self.torch, self.conv = torch, conv
        self.tensors: dict[str, Any] = {}
        self.metadata: dict[str, str] = {}
        self.seen: set[tuple[str, int]] = set()  # storages written already

    def claim(self, name: str) -> str:
        if name in self.tensors or name in self.metadata:
            raise UnsupportedState(f"two values of the state flatten to the same safetensors name {name!r}; "
                                   "export to .pt instead")
        return name

    def has_tensor(self, obj: Any) -> bool:
        if isinstance(obj, (self.torch.Tensor, np.ndarray)):
            return True
        if isinstance(obj, dict):
            return any(self.has_tensor(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(self.has_tensor(v) for v in obj)
        return False

    def tensor(self, obj: Any, name: str, path: str) -> None:
        torch = self.torch
        t = obj.detach().cpu() if isinstance(obj, torch.Tensor) else _numpy_to_tensor(obj, path, self.conv)
        if not safetensors_keeps(t.dtype):
            raise UnsupportedState(f"'{path or '/'}' is a {t.dtype} tensor, which safetensors {_safetensors_version()} "
                                   "cannot hold; export to .pt instead")
        t = t.resolve_conj().resolve_neg().contiguous()  # the values, as a file of bytes holds them
        where = (str(t.device), t.untyped_storage().data_ptr())
        if t.numel() and where in self.seen:
            t = t.clone()  # sharing memory with a tensor written already: safetensors holds each name's own bytes
        self.seen.add(where)
        self.tensors[self.claim(name)] = t

    def walk(self, obj: Any, name: str, path: str) -> None:
        if isinstance(obj, (self.torch.Tensor, np.ndarray)):
            self.tensor(obj, name, path)
        elif isinstance(obj, dict) and self.has_tensor(obj):
            for k, v in obj.items():
                self.walk(v, f"{name}.{k}" if name else str(k), f"{path}/{k}")
        elif isinstance(obj, (list, tuple)) and self.has_tensor(obj):
            for i, v in enumerate(obj):
                self.walk(v, f"{name}.{i}" if name else str(i), f"{path}/{i}")
        else:
            self.metadata[self.claim(name or "__root__")] = self.json(obj, path)

    def json(self, obj: Any, path: str) -> str:
        if _json_exact(obj):
            return json.dumps(obj)
        self.conv.note(path, obj, "its nearest JSON in the metadata", "holds only as JSON metadata, not exactly")
        try:
            return _loose_json(obj)
        except (TypeError, ValueError) as e:
            raise UnsupportedState(f"'{path or '/'}' cannot be written as safetensors metadata (JSON: {e}); "
                                   "export to .pt instead") from None


def flatten_for_safetensors(state: Any, *, convert: bool = False) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """(dotted name -> tensor, dotted name -> JSON string of a non-tensor value, conversions made)."""
    conv = _Conversions(convert, "safetensors")
    walk = _SafetensorsWalk(conv)
    walk.walk(state, "", "")
    return walk.tensors, walk.metadata, conv.done


# --- writing ---------------------------------------------------------------------------------------

def write_export(state: Any, path: str, *, info: dict[str, Any], force: bool = False,
                 convert: bool = False) -> Exported:
    """Write ``state`` to ``path`` (format by suffix), atomically: what was written and converted."""
    fmt = format_of(path)
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {path}: the directory {folder} does not exist; create it first")
    if os.path.lexists(path) and not force:
        raise FileExistsError(f"{path} exists; pass force=True (ckpt export --force) to replace it")
    if fmt == "safetensors":
        tensors, metadata, converted = flatten_for_safetensors(state, convert=convert)
        metadata["__ckpt__"] = json.dumps(info)
    else:
        payload, converted = to_weights_only(state, convert=convert)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        mode = _user_file_mode(tmp)
        if fmt == "safetensors":
            from safetensors.torch import save_file

            try:
                save_file(tensors, tmp, metadata=metadata)
            except (ValueError, TypeError, RuntimeError) as e:
                raise UnsupportedState(f"safetensors cannot hold this state ({e}); export to .pt instead") from None
        else:
            import torch

            try:
                torch.save(payload, tmp)
            except RuntimeError as e:  # torch's file writer reports I/O problems as RuntimeError
                raise OSError(f"cannot write {path}: {e}") from None
        os.chmod(tmp, mode)  # safetensors writes 0600; an export is a file like any other the user writes
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync(folder, directory=True)
    return Exported(os.path.getsize(path), tuple(converted))


def _user_file_mode(path: str) -> int:
    """Create the empty file ``path`` and return its mode: 0666 less the umask (and whatever the
    directory imposes), as for any file the user writes. Asked of the kernel, not of ``os.umask``,
    which would set the process's umask for a moment under every other thread."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def _fsync(path: str, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
