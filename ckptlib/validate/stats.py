"""Per-tensor statistics and the readable scalars of a part, for the validation's tables.

Pure functions of tensors and manifests: NaN/Inf counts, value range and norm over the finite
values, relative change against a reference tensor, a tensor's role (parameter, Adam moment, ...),
whether a restored value matches its recorded spec, and the scalars of a part's skeleton (no chunk
read). Specs themselves are checked by ckptlib when a fragment is read (``LeafSpec.checked``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import commit
from ..errors import CheckpointError
from ..leaves import view_of
from ..manifest import Fragment, Manifest
from ..store import Store
from ..tree import unflatten, view_paths
from ..types import TORCH_DTYPES, View


def norm_path(path: str) -> str:
    return path.lstrip("/") or "/"


def role(path: str, single: bool) -> str:
    """param | first_moment | second_moment | opt_step | rng | other, from a tensor's path."""
    segs = path.split("/")
    last = segs[-1]
    if last in ("exp_avg_sq", "max_exp_avg_sq"):
        return "second_moment"
    if last == "exp_avg":
        return "first_moment"
    if last == "step" and len(segs) >= 3 and segs[-3] == "state":
        return "opt_step"
    if "rng" in segs:
        return "rng"
    if segs[0] == "model":
        return "param"
    if single and not any("optim" in s or "sched" in s for s in segs):
        return "param"  # a generic single-part state: any float tensor outside optimizer/scheduler
    return "other"


def model_filter(single: bool) -> Any:
    if single:
        return lambda p: role(p, True) == "param"
    return lambda p: p.startswith("model/")


def _as_torch(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (np.ndarray, np.generic)):
        a = np.asarray(obj)
        if a.dtype.kind in "biufc":
            try:
                return torch.from_numpy(np.ascontiguousarray(a))
            except TypeError:  # a numpy dtype torch lacks
                return None
    return None


def _floating(t: torch.Tensor) -> torch.Tensor | None:
    """A float32/64 view of a floating or complex tensor for statistics; None for integers, bools
    and dtypes torch has no arithmetic for (packed float4, raw bits)."""
    if TORCH_DTYPES.get(str(t.dtype).removeprefix("torch."), (0, "f"))[1] in ("f4", "x"):
        return None
    t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        return None
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def tensor_stats(obj: Any) -> dict[str, Any]:
    """nan_count, inf_count, min, max, abs_max, norm (over the finite values), ``finite`` (all were)."""
    t = _as_torch(obj)
    if t is None:
        return {}
    f = _floating(t)
    if f is None:  # integers and bools hold no NaN or Inf
        return {"nan_count": 0, "inf_count": 0}
    out: dict[str, Any] = {"nan_count": 0, "inf_count": 0}
    if f.numel() == 0:
        return out
    # one cheap pass decides the common case: min and max propagate NaN and show an Inf
    lo, hi = (float(v) for v in torch.aminmax(f))
    finite = f
    if not (math.isfinite(lo) and math.isfinite(hi)):
        out["nan_count"], out["inf_count"] = int(torch.isnan(f).sum()), int(torch.isinf(f).sum())
        finite = f[torch.isfinite(f)]
        if finite.numel():
            lo, hi = (float(v) for v in torch.aminmax(finite))
    out["finite"] = finite is f
    if finite.numel():
        out["min"], out["max"] = lo, hi
        out["abs_max"] = max(abs(lo), abs(hi))
        # over the finite values: a NaN/Inf is no_nan's/no_inf's finding, not also a norm's
        out["norm"] = float(torch.linalg.vector_norm(finite))
    return out


def rel_change(cur: Any, ref: Any, floor: float, *, cur_finite: bool = False) -> float | None:
    """||cur - ref|| / max(||ref||, floor * sqrt(numel)) over the elements finite in both."""
    a, b = _as_torch(cur), _as_torch(ref)
    if a is None or b is None or a.shape != b.shape:
        return None
    fa, fb = _floating(a), _floating(b)
    if fa is None or fb is None or fa.numel() == 0:
        return None
    if not cur_finite or not all(math.isfinite(float(v)) for v in torch.aminmax(fb)):
        ok = torch.isfinite(fa) & torch.isfinite(fb)
        if not bool(ok.all()):  # non-finite values are no_nan's/no_inf's finding: compare the rest
            fa, fb = fa[ok], fb[ok]
    denom = max(float(torch.linalg.vector_norm(fb)), floor * math.sqrt(max(fa.numel(), 1)))
    return float(torch.dist(fa, fb)) / denom if denom > 0 else None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a part as validation tables it: a leaf, or a view of a storage leaf (then its
    bytes are the storage's, ``leaf``), or a storage leaf itself (``storage``: bytes that views
    share, not a tensor of the model: integrity only, no statistics)."""

    path: str  # normalised (no leading '/')
    leaf: int
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    view: View | None = None
    storage: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def tensor_entries(frag: Fragment) -> list[TensorEntry]:
    """Every leaf of ``frag``, then every distinct view of its storage leaves (by skeleton path)."""
    out = [TensorEntry(norm_path(leaf.spec.path), i, leaf.spec.dtype, leaf.spec.shape, leaf.spec.itemsize,
                       storage=leaf.spec.kind == "storage") for i, leaf in enumerate(frag.leaves)]
    for path, v in view_paths(frag.skeleton):
        if 0 <= v.storage < len(frag.leaves) and frag.leaves[v.storage].spec.kind == "storage":
            out.append(TensorEntry(norm_path(path), v.storage, v.dtype, v.shape, v.itemsize, view=v))
    return out


def entry_value(entry: TensorEntry, leaves: list[Any]) -> Any:
    """The entry's tensor from the decoded leaves (None when its leaf is damaged or does not hold it)."""
    obj = leaves[entry.leaf]
    if entry.view is None or obj is None:
        return obj
    try:
        return view_of(obj, entry.view)
    except (ValueError, RuntimeError):
        return None  # a view outside its storage: the skeleton check reports it


class _Leaf:
    """Stands in for a tensor in a state rebuilt from the manifest's skeleton alone."""

    def __repr__(self) -> str:
        return "<tensor>"


LEAF = _Leaf()


def skeleton_state(frag: Fragment) -> Any:
    """The part's state with every tensor replaced by ``LEAF``: scalars without reading a chunk."""
    return unflatten(frag.skeleton, [LEAF] * len(frag.leaves), [leaf.spec for leaf in frag.leaves])


def get(state: Any, *keys: str) -> Any:
    """``state[k1][k2]...``, or None where a key is missing or a level is not a dict."""
    for k in keys:
        if not isinstance(state, dict) or k not in state:
            return None
        state = state[k]
    return state


def scalar(v: Any) -> float | None:
    """A plain number from an int/float/0-d tensor/array; None otherwise."""
    if isinstance(v, bool) or v is None or v is LEAF:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
        try:
            n = v.numel() if isinstance(v, torch.Tensor) else np.asarray(v).size
            return float(v.item()) if n == 1 else None
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def integer(v: Any) -> int | None:
    f = scalar(v)
    return int(f) if f is not None and math.isfinite(f) else None


def optimizer_steps(state: Any) -> list[list[float | None]]:
    """Per optimizer state_dict found in ``state``: its per-parameter step counters."""
    found: list[list[float | None]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("state"), dict) and "param_groups" in node:
                found.append([scalar(s.get("step")) for s in node["state"].values()
                              if isinstance(s, dict) and "step" in s])
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(state)
    return found


def loss_of(state: Any, frag: Fragment) -> tuple[float | None, float | None]:
    """(loss, eval_loss) recorded in a part: ``metrics.loss``, ``loss``, then the fragment's meta."""
    loss = scalar(get(state, "metrics", "loss"))
    if loss is None:
        loss = scalar(get(state, "loss"))
    if loss is None:
        loss = scalar(frag.meta.get("loss"))
    ev = scalar(get(state, "metrics", "eval_loss"))
    if ev is None:
        ev = scalar(frag.meta.get("eval_loss"))
    return loss, ev


def manifest_loss(store: Store, m: Manifest, *, strict: bool = False) -> tuple[float | None, float | None]:
    """The loss of a checkpoint without reading a chunk: the manifest's ``meta``, else the mean of
    what its parts record (``loss_of``; one read per part whose fragment is not embedded). A part
    that cannot be read (or whose skeleton is not one save writes) records no loss; ``strict``: it
    raises (CorruptCheckpoint)."""
    loss, ev = scalar(m.meta.get("loss")), scalar(m.meta.get("eval_loss"))
    if loss is not None and not strict:
        return loss, ev
    found = []
    for name in m.parts:
        try:
            frag = commit.load_part(store, m, name)
            found.append(loss_of(skeleton_state(frag), frag))
        except CheckpointError:
            if strict:
                raise
            continue  # integrity checks report it
    if loss is not None:
        return loss, ev
    losses = [x for x, _ in found if x is not None]
    evals = [e for _, e in found if e is not None]
    if ev is None and evals:
        ev = evals[0]
    return (sum(losses) / len(losses) if losses else None), ev


def spec_ok(obj: Any, spec: Any) -> bool:
    """Whether a restored value has the dtype and shape its spec records (and the spec is consistent)."""
    shape_ok = spec.nbytes == math.prod(spec.shape) * spec.itemsize
    if isinstance(obj, torch.Tensor):
        return shape_ok and tuple(obj.shape) == tuple(spec.shape) and str(obj.dtype).removeprefix("torch.") == spec.dtype
    if isinstance(obj, (np.ndarray, np.generic)):
        a = np.asarray(obj)
        return shape_ok and tuple(a.shape) == tuple(spec.shape) and a.dtype.str == spec.dtype
    return shape_ok


def clean(v: Any) -> Any:
    """JSON-friendly numbers: NaN/Inf as strings, numpy scalars as Python."""
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) else repr(f)
    return v


def mode(values: list) -> Any:
    """The most common non-null value, or None."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return max(set(values), key=values.count)
