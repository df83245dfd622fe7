"""Write a restored state as one file other tools read: ``.pt`` (``torch.load(weights_only=True)``) or
``.safetensors`` (flat tensors + JSON metadata).

Both formats hold less than a checkpoint: numpy arrays become tensors, numpy scalars plain numbers,
sets lists; safetensors holds only named tensors (other values go to its string metadata as
JSON). What a format cannot hold at all (numpy ``longdouble`` or fixed-width strings, complex
tensors in safetensors) is refused with ``UnsupportedState`` naming the value, before anything is
written. The file is written atomically (a temp file beside it, fsynced, renamed) and an existing
file is replaced only with ``force``.
"""

from __future__ import annotations

import collections
import json
import os
import uuid
from typing import Any

import numpy as np

from .errors import UnsupportedState

FORMATS = {".pt": "pt", ".pth": "pt", ".safetensors": "safetensors"}


def format_of(path: str) -> str:
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise ValueError(f"cannot export to {path!r}: the file name must end in .pt (torch.load with "
                         "weights_only=True) or .safetensors (flat tensors + JSON metadata)")
    return fmt


def _numpy_to_tensor(a: np.ndarray, path: str) -> Any:
    import torch

    if a.dtype.kind in "mM":  # datetimes: their int64 ticks
        a = a.view(np.int64)
    if a.dtype.kind in "US" or a.dtype == np.longdouble and a.dtype.itemsize > 8:
        raise UnsupportedState(f"'{path or '/'}' is a numpy {a.dtype} array, which torch has no dtype for; "
                               "export can only write numeric arrays torch can hold (convert it first)")
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))  # same values, this machine's byte order
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def to_weights_only(obj: Any, path: str = "") -> Any:
    """A structure ``torch.load(weights_only=True)`` accepts: tensors, containers, plain values."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, np.ndarray):
        return _numpy_to_tensor(obj, path)
    if isinstance(obj, np.generic):
        if obj.dtype.kind in "US" or (obj.dtype.kind == "f" and obj.dtype.itemsize > 8):
            raise UnsupportedState(f"'{path or '/'}' is a numpy {obj.dtype} scalar, which a .pt export cannot hold")
        return obj.item()
    if isinstance(obj, (bytes, bytearray)):
        return torch.frombuffer(bytearray(obj), dtype=torch.uint8) if obj else torch.empty(0, dtype=torch.uint8)
    if isinstance(obj, (collections.Counter, collections.defaultdict)):
        return {k: to_weights_only(v, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, collections.OrderedDict):
        out = collections.OrderedDict((k, to_weights_only(v, f"{path}/{k}")) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(obj, dict):
        return {k: to_weights_only(v, f"{path}/{k}") for k, v in obj.items()}
    if isinstance(obj, (set, frozenset)):
        return [to_weights_only(v, f"{path}/<item>") for v in obj]
    if isinstance(obj, list):
        return [to_weights_only(v, f"{path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(to_weights_only(v, f"{path}/{i}") for i, v in enumerate(obj))
    return obj


def flatten_for_safetensors(state: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """(dotted name -> tensor, dotted name -> JSON string of a non-tensor value)."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}

    def has_tensor(obj: Any) -> bool:
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            return True
        if isinstance(obj, dict):
            return any(has_tensor(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return any(has_tensor(v) for v in obj)
        return False

    def claim(name: str) -> str:
        if name in tensors or name in metadata:
            raise UnsupportedState(f"two values of the state flatten to the same safetensors name {name!r}; "
                                   "export to .pt instead")
        return name

    seen: set[int] = set()

    def walk(obj: Any, name: str, path: str) -> None:
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            t = obj.detach().cpu().contiguous() if isinstance(obj, torch.Tensor) else _numpy_to_tensor(obj, path)
            if t.untyped_storage().data_ptr() in seen and t.numel():
                t = t.clone()  # tied weights: safetensors holds each name's own bytes
            seen.add(t.untyped_storage().data_ptr())
            if t.is_complex():
                raise UnsupportedState(f"'{path or '/'}' is a complex tensor ({t.dtype}), which safetensors cannot "
                                       "hold; export to .pt instead, or store torch.view_as_real(t)")
            tensors[claim(name)] = t
        elif isinstance(obj, dict) and has_tensor(obj):
            for k, v in obj.items():
                walk(v, f"{name}.{k}" if name else str(k), f"{path}/{k}")
        elif isinstance(obj, (list, tuple)) and has_tensor(obj):
            for i, v in enumerate(obj):
                walk(v, f"{name}.{i}" if name else str(i), f"{path}/{i}")
        else:
            try:
                metadata[claim(name or "__root__")] = json.dumps(to_weights_only(obj, path), default=_json_default)
            except (TypeError, ValueError) as e:
                raise UnsupportedState(f"'{path or '/'}' cannot be written as safetensors metadata (JSON: {e}); "
                                       "export to .pt instead") from None

    walk(state, "", "")
    return tensors, metadata


def _json_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    if isinstance(obj, complex):
        return [obj.real, obj.imag]
    import torch

    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    raise UnsupportedState(f"a value of type {type(obj).__name__} cannot be written as safetensors metadata; "
                           "export to .pt instead")


def write_export(state: Any, path: str, *, info: dict[str, Any], force: bool = False) -> int:
    """Write ``state`` to ``path`` (format by suffix), atomically; returns the file's size."""
    fmt = format_of(path)
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {path}: the directory {folder} does not exist; create it first")
    if os.path.lexists(path) and not force:
        raise FileExistsError(f"{path} exists; pass force=True (ckpt export --force) to replace it")
    if fmt == "safetensors":
        tensors, metadata = flatten_for_safetensors(state)
        metadata["__ckpt__"] = json.dumps(info)
    else:
        payload = to_weights_only(state)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
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
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return os.path.getsize(path)
