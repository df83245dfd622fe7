"""Checkpoint validation: restore a committed checkpoint, measure it, let Great Expectations judge it.

Who calls what
--------------
``validate_checkpoint(url, step)`` is the one entry point (the Prefect task ``tasks.validate``, the
``ckpt validate`` command and the ``validate-checkpoint`` flow call it). It

1. reads ``manifests/<step>.json`` and decodes every part once (``reader.inspect_part``): every
   chunk's checksum, every tensor's digest and the logical digest are checked in the same pass that
   yields the tensors; parts are processed one at a time, so memory holds one part (plus the model
   of the coordinator and of the previous healthy checkpoint) at a time;
2. builds two pandas DataFrames: ``tensors`` (one row per stored tensor of every part: integrity,
   dtype/shape, NaN/Inf counts, value range, norm, relative change against the previous healthy
   checkpoint, Adam second-moment minimum) and ``parts`` (one row per part of the cut, plus one per
   expected but missing shard: step, config hash, round, data position, RNG states, optimizer step
   counters, loss, each compared with the previous healthy checkpoint);
3. runs two Expectation Suites on them in an ephemeral GX context (progress bars off);
4. writes the report (``reports/<step>/``: GX HTML pages, an HTML overview, JSON summary, CSVs, a
   PNG of the run so far; ``reports/index.html``) and then the verdict
   ``validations/<step>.json``, both with ``Store.put``. The verdict is written last: it is what
   makes a checkpoint healthy (``Checkpointer.healthy_steps``).

Guarantees
----------
* Corruption never raises: a flipped bit, a truncated or missing object, an unreadable manifest,
  NaNs, a wrong shape all give a verdict with ``passed: false`` naming the expectation and where
  (part, tensor, chunk, object key). A bug in a check is reported as the failed expectation
  ``validation_error`` rather than raised. ``NoCheckpoint`` (the step is not committed) and
  ``StoreError`` other than a missing object (the store is unreachable: retry) do raise.
* Nothing under ``manifests/``, ``fragments/`` or ``chunks/`` is written: only ``validations/``
  and ``reports/``.
* Re-validating a step overwrites its verdict and report (same inputs, same verdict).
* Several validations may run at once (threads or processes). The GX part runs under a process-wide
  lock (GX contexts share module state); ``reports/index.html`` is last-writer-wins, so a refresh
  racing another may miss the other's newest step until the next refresh (``ckpt report``).

Great Expectations is imported lazily (about 2 s): importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

import numpy as np
import torch

from . import commit
from .errors import CheckpointError, CorruptCheckpoint, NoCheckpoint, ObjectNotFound, StoreError
from .manifest import Fragment, Manifest
from .reader import Problem, inspect_part
from .store import Store
from .tree import unflatten

log = logging.getLogger("ckptlib.validate")

VERDICT_FORMAT = 1
COORDINATOR = "coordinator"
_SHARD = re.compile(r"^shard-(\d+)$")
_MAX_WHERE = 50  # per failed expectation, in the verdict (the count is always complete)
_GX_LOCK = threading.Lock()


def report_prefix(step: int) -> str:
    return f"reports/{step}/"


# --- thresholds ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Thresholds:
    """Bounds of the numeric and progress checks. Defaults suit fp32/bf16 training of usual models.

    ``Thresholds.from_dict({"max_rel_change": 5})`` overrides some; unknown names are an error.
    """

    max_abs_value: float = 1e4  # largest |value| of a model tensor (parameters and buffers)
    max_norm: float = 1e6  # largest L2 norm of one model tensor
    # relative change of a model tensor against the previous healthy checkpoint:
    # ||x - x_prev|| / max(||x_prev||, rel_change_floor * sqrt(numel)); the floor keeps tensors that
    # start at zero (biases) from dividing by ~0. An exploding update fails this.
    max_rel_change: float = 10.0
    rel_change_floor: float = 0.05
    min_data_advance: int = 1  # batches each shard must have consumed since the previous healthy cut
    max_step_spread: int = 0  # max - min of an optimizer's per-parameter step counters

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"threshold {f.name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def from_dict(cls, d: "Mapping[str, Any] | Thresholds | None") -> "Thresholds":
        if d is None:
            return cls()
        if isinstance(d, Thresholds):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"thresholds must be a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown validation thresholds {unknown}; known: {sorted(known)}")
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- the expectations ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """One named expectation of a suite: the name is what verdicts, artifacts and the CLI show."""

    name: str
    table: str  # "tensors" | "parts"
    column: str | None
    what: str  # a sentence for people (also the GX description)


CHECKS: tuple[Check, ...] = (
    Check("checkpoint_integrity", "tensors", "intact",
          "every chunk is present, decodes and matches its checksum; tensor and logical digests match"),
    Check("dtype_shape_as_recorded", "tensors", "spec_ok",
          "every tensor restores with the dtype and shape its manifest records, and shape x itemsize = bytes"),
    Check("shape_matches_reference", "tensors", "shape_matches_reference",
          "every tensor has the shape it had in the previous healthy checkpoint, and shard models the "
          "coordinator's shapes"),
    Check("no_nan", "tensors", "nan_count", "no tensor holds a NaN"),
    Check("no_inf", "tensors", "inf_count", "no tensor holds an Inf"),
    Check("values_within_bounds", "tensors", "param_abs_max", "model tensors: max |value| <= max_abs_value"),
    Check("norms_within_bounds", "tensors", "param_norm", "model tensors: L2 norm <= max_norm"),
    Check("relative_change_within_bounds", "tensors", "rel_change",
          "model tensors: relative change against the previous healthy checkpoint <= max_rel_change"),
    Check("adam_second_moments_nonnegative", "tensors", "second_moment_min",
          "optimizer second moments (exp_avg_sq) are >= 0"),
    Check("all_shards_present", "parts", "present", "every shard of the cut (shard-0..N-1) is present"),
    Check("no_unexpected_parts", "parts", "expected", "no shard beyond the run's configured count"),
    Check("same_step", "parts", "fragment_step", "every part was written for this step"),
    Check("same_config_hash", "parts", "config_hash", "every part carries the coordinator's config hash"),
    Check("same_round", "parts", "round", "every part holds the same round counter"),
    Check("round_advanced", "parts", "round_advance", "the round counter advanced since the previous healthy checkpoint"),
    Check("data_position_advanced", "parts", "data_advance",
          "each shard's data position advanced (>= min_data_advance batches) since the previous healthy checkpoint"),
    Check("rng_states_present", "parts", "rng_present", "each shard holds its torch, numpy and python RNG states"),
    Check("optimizer_steps_consistent", "parts", "opt_step_spread",
          "an optimizer's per-parameter step counters agree (spread <= max_step_spread)"),
    Check("loss_finite", "parts", "loss_finite", "the recorded loss is a finite number"),
)
CHECK_NAMES = tuple(c.name for c in CHECKS)
VALIDATION_ERROR = "validation_error"  # a check itself broke: reported, never raised

_TENSOR_COLUMNS = ["part", "tensor", "role", "dtype", "shape", "numel", "intact", "problem", "spec_ok",
                   "shape_matches_reference", "nan_count", "inf_count", "min", "max", "abs_max", "norm",
                   "param_abs_max", "param_norm", "rel_change", "second_moment_min"]
_PART_COLUMNS = ["part", "role", "present", "expected", "generation", "fragment_step", "config_hash", "round",
                 "prev_round", "round_advance", "data_position", "prev_data_position", "data_advance",
                 "rng_present", "opt_step_min", "opt_step_max", "opt_step_spread", "loss", "loss_finite",
                 "tensors", "logical_bytes", "bytes_written"]


def _build_suite(gx, gxe, table: str, th: Thresholds, ref: dict[str, Any]):
    """The Expectation Suite for one table; each expectation carries its Check name in meta."""
    by = {c.name: c for c in CHECKS}

    def mk(cls, name: str, **kw):
        c = by[name]
        return cls(column=c.column, meta={"name": name}, description=f"{name}: {c.what}", **kw)

    if table == "tensors":
        exps = [
            mk(gxe.ExpectColumnValuesToBeInSet, "checkpoint_integrity", value_set=[True]),
            mk(gxe.ExpectColumnValuesToBeInSet, "dtype_shape_as_recorded", value_set=[True]),
            mk(gxe.ExpectColumnValuesToBeInSet, "shape_matches_reference", value_set=[True]),
            mk(gxe.ExpectColumnValuesToBeBetween, "no_nan", min_value=0, max_value=0),
            mk(gxe.ExpectColumnValuesToBeBetween, "no_inf", min_value=0, max_value=0),
            mk(gxe.ExpectColumnValuesToBeBetween, "values_within_bounds", min_value=0, max_value=th.max_abs_value),
            mk(gxe.ExpectColumnValuesToBeBetween, "norms_within_bounds", min_value=0, max_value=th.max_norm),
            mk(gxe.ExpectColumnValuesToBeBetween, "relative_change_within_bounds", min_value=0,
               max_value=th.max_rel_change),
            mk(gxe.ExpectColumnValuesToBeBetween, "adam_second_moments_nonnegative", min_value=0),
        ]
    else:
        exps = [
            mk(gxe.ExpectColumnValuesToBeInSet, "all_shards_present", value_set=[True]),
            mk(gxe.ExpectColumnValuesToBeInSet, "no_unexpected_parts", value_set=[True]),
            mk(gxe.ExpectColumnValuesToBeInSet, "same_step", value_set=[ref["step"]]),
            mk(gxe.ExpectColumnValuesToBeInSet, "same_config_hash", value_set=[ref["config_hash"]]),
            mk(gxe.ExpectColumnValuesToBeInSet, "same_round", value_set=[ref["round"]]),
            mk(gxe.ExpectColumnValuesToBeBetween, "round_advanced", min_value=1),
            mk(gxe.ExpectColumnValuesToBeBetween, "data_position_advanced", min_value=th.min_data_advance),
            mk(gxe.ExpectColumnValuesToBeInSet, "rng_states_present", value_set=[True]),
            mk(gxe.ExpectColumnValuesToBeBetween, "optimizer_steps_consistent", min_value=0,
               max_value=th.max_step_spread),
            mk(gxe.ExpectColumnValuesToBeInSet, "loss_finite", value_set=[True]),
        ]
    return gx.ExpectationSuite(name=f"checkpoint_{table}", expectations=exps)


def _run_gx(tables: dict[str, Any], th: Thresholds, ref: dict[str, Any], run_name: str) -> dict[str, Any]:
    """Validate each DataFrame with its suite; {table: ExpectationSuiteValidationResult}."""
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    results = {}
    with _GX_LOCK:
        ctx = gx.get_context(mode="ephemeral")
        ctx.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
        source = ctx.data_sources.add_pandas("checkpoint")
        for table, df in tables.items():
            batch = source.add_dataframe_asset(table).add_batch_definition_whole_dataframe("all")
            suite = ctx.suites.add(_build_suite(gx, gxe, table, th, ref))
            vd = ctx.validation_definitions.add(gx.ValidationDefinition(name=f"{table}-{run_name}", data=batch,
                                                                        suite=suite))
            index = ["part", "tensor"] if table == "tensors" else ["part"]
            results[table] = vd.run(batch_parameters={"dataframe": df}, result_format={
                "result_format": "COMPLETE", "unexpected_index_column_names": index,
                "partial_unexpected_count": 20})
    return results


def render_gx_html(result) -> str:
    """One self-contained GX Data Docs page for a validation result."""
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    with _GX_LOCK:
        return DefaultJinjaPageView().render(ValidationResultsPageRenderer().render(result))


# --- reading and measuring -----------------------------------------------------------------------

def _norm_path(path: str) -> str:
    return path.lstrip("/") or "/"


def _role(path: str, single: bool) -> str:
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
    """A float32/64 view of a floating or complex tensor for statistics; None for integers/bools."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        return None
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _stats(obj: Any) -> dict[str, Any]:
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
        lo, hi = (float(v) for v in torch.aminmax(finite)) if finite.numel() else (None, None)
    out["finite"] = finite is f
    if finite.numel():
        out["min"], out["max"] = lo, hi
        out["abs_max"] = max(abs(lo), abs(hi))
        # over the finite values: a NaN/Inf is no_nan's/no_inf's finding, not also a norm's
        out["norm"] = float(torch.linalg.vector_norm(finite))
    return out


def _rel_change(cur: Any, ref: Any, floor: float, *, cur_finite: bool = False) -> float | None:
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


class _Leaf:
    """Stands in for a tensor in a state rebuilt from the manifest's skeleton alone."""

    def __repr__(self) -> str:
        return "<tensor>"


_LEAF = _Leaf()


def _skeleton_state(frag: Fragment) -> Any:
    """The part's state with every tensor replaced by a marker: scalars without reading a chunk."""
    return unflatten(frag.skeleton, [_LEAF] * len(frag.leaves))


def _get(state: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(state, dict) or k not in state:
            return None
        state = state[k]
    return state


def _scalar(v: Any) -> float | None:
    """A plain number from an int/float/0-d tensor/array; None otherwise."""
    if isinstance(v, bool) or v is None or v is _LEAF:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (torch.Tensor, np.ndarray, np.generic)):
        try:
            return float(v.item()) if getattr(v, "numel", lambda: v.size)() == 1 else None
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _int(v: Any) -> int | None:
    f = _scalar(v)
    return int(f) if f is not None and math.isfinite(f) else None


def _optimizer_steps(state: Any) -> list[list[float | None]]:
    """Per optimizer state_dict found in ``state``: its per-parameter step counters."""
    found: list[list[float | None]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("state"), dict) and "param_groups" in node:
                found.append([_scalar(s.get("step")) for s in node["state"].values()
                              if isinstance(s, dict) and "step" in s])
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(state)
    return found


def _rng_present(state: Any) -> bool | None:
    rng = _get(state, "rng")
    if rng is None:
        return None
    return isinstance(rng, dict) and all(rng.get(k) is not None for k in ("torch", "numpy", "python"))


def _parse_config(v: Any) -> dict:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return {}
    return v if isinstance(v, dict) else {}


def _configured_shards(config: dict) -> int | None:
    """The shard count in a run's config: the first of these keys found (top level, then nested)."""
    keys = ("num_shards", "shards", "n_shards", "world_size")
    todo = [config]
    for _ in range(3):
        nxt = []
        for d in todo:
            for k in keys:
                v = d.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
                    return v
            nxt += [v for v in d.values() if isinstance(v, dict)]
        todo = nxt
    return None


def _loss_of(part: str, state: Any, frag: Fragment) -> tuple[float | None, float | None]:
    """(loss, eval_loss) recorded in a part: metrics of the coordinator, a shard's loss, or meta."""
    loss = _scalar(_get(state, "metrics", "loss"))
    if loss is None:
        loss = _scalar(_get(state, "loss"))
    if loss is None:
        loss = _scalar(frag.meta.get("loss"))
    ev = _scalar(_get(state, "metrics", "eval_loss"))
    if ev is None:
        ev = _scalar(frag.meta.get("eval_loss"))
    return loss, ev


def manifest_loss(m: Manifest) -> tuple[float | None, float | None]:
    """The loss of a checkpoint without reading a chunk: coordinator metrics, else the mean of the
    shards' losses, else the manifest's meta."""
    if COORDINATOR in m.parts:
        frag = m.parts[COORDINATOR]
        loss, ev = _loss_of(COORDINATOR, _skeleton_state(frag), frag)
        if loss is not None:
            return loss, ev
    losses = []
    for name, frag in m.parts.items():
        if name != COORDINATOR:
            l, _ = _loss_of(name, _skeleton_state(frag), frag)
            if l is not None:
                losses.append(l)
    if losses:
        return sum(losses) / len(losses), None
    return _scalar(m.meta.get("loss")), _scalar(m.meta.get("eval_loss"))


@dataclass
class _Reference:
    """The previous healthy checkpoint: its manifest and the model tensors rel_change needs."""

    step: int
    manifest: Manifest
    models: dict[str, dict[str, Any]]  # part -> {tensor path: tensor} (model tensors only)
    states: dict[str, Any]  # part -> skeleton state (scalars)


def previous_healthy_step(store: Store, step: int) -> int | None:
    """The latest committed step below ``step`` whose validation passed."""
    for s in reversed([s for s in commit.committed_steps(store) if s < step]):
        v = read_verdict(store, s)
        if v is not None and v.get("passed") is True:
            return s
    return None


def _restore_leaves(frag: Fragment, store: Store, pool, wanted) -> dict[str, Any]:
    """The intact leaves of ``frag`` whose path satisfies ``wanted``, by normalised path."""
    idx = [i for i, leaf in enumerate(frag.leaves) if wanted(_norm_path(leaf.spec.path))]
    if not idx:
        return {}
    sub = dataclasses.replace(frag, leaves=tuple(frag.leaves[i] for i in idx),
                              skeleton=[{"__leaf__": j} for j in range(len(idx))])
    leaves, _ = inspect_part(sub, store, pool)
    return {_norm_path(frag.leaves[i].spec.path): obj for i, obj in zip(idx, leaves) if obj is not None}


def _model_filter(single: bool):
    if single:
        return lambda p: _role(p, True) == "param"
    return lambda p: p.startswith("model/")


def _load_reference(store: Store, step: int, pool, single: bool) -> _Reference | None:
    prev = previous_healthy_step(store, step)
    if prev is None:
        return None
    try:
        m = commit.read_manifest(store, prev)
    except CheckpointError as e:
        log.warning("previous healthy checkpoint %d of %s is unreadable (%s): no reference", prev, store.url, e)
        return None
    models, states = {}, {}
    for name, frag in m.parts.items():
        states[name] = _skeleton_state(frag)
        # the coordinator's model is every shard's starting point; a single part is its own
        if name == COORDINATOR or m.single or COORDINATOR not in m.parts:
            try:
                models[name] = _restore_leaves(frag, store, pool, _model_filter(m.single))
            except CheckpointError as e:
                log.warning("cannot read the model of step %d part %s (%s): no relative change", prev, name, e)
    return _Reference(prev, m, models, states)


def _spec_problem(spec) -> str | None:
    """Why a recorded tensor spec cannot be decoded, or None."""
    from .tree import _TORCH_DTYPES

    if spec.kind == "torch":
        if spec.dtype not in _TORCH_DTYPES:
            return f"the manifest records unknown torch dtype {spec.dtype!r}"
        size = torch.empty(0, dtype=_TORCH_DTYPES[spec.dtype]).element_size()
    else:
        try:
            size = np.dtype(spec.dtype).itemsize
        except TypeError:
            return f"the manifest records unknown numpy dtype {spec.dtype!r}"
    if spec.itemsize != size:
        return f"the manifest records itemsize {spec.itemsize} for dtype {spec.dtype} ({size} bytes)"
    if any((not isinstance(d, int)) or d < 0 for d in spec.shape):
        return f"the manifest records an invalid shape {list(spec.shape)}"
    if spec.nbytes != math.prod(spec.shape) * spec.itemsize:
        return (f"the manifest records shape {list(spec.shape)} x {spec.itemsize} bytes = "
                f"{math.prod(spec.shape) * spec.itemsize} bytes, but {spec.nbytes} bytes of data")
    return None


def _spec_ok(obj: Any, spec) -> bool:
    shape_ok = spec.nbytes == math.prod(spec.shape) * spec.itemsize
    if isinstance(obj, torch.Tensor):
        return shape_ok and tuple(obj.shape) == tuple(spec.shape) and str(obj.dtype).removeprefix("torch.") == spec.dtype
    if isinstance(obj, (np.ndarray, np.generic)):
        a = np.asarray(obj)
        return shape_ok and tuple(a.shape) == tuple(spec.shape) and a.dtype.str == spec.dtype
    return shape_ok


# --- the validation ------------------------------------------------------------------------------

def read_verdict(store: Store, step: int) -> dict | None:
    try:
        return json.loads(store.get(commit.validation_key(step)))
    except ObjectNotFound:
        return None
    except ValueError:
        return {"step": step, "passed": False, "failed": ["unreadable_verdict"]}


def list_verdicts(store: Store) -> dict[int, dict]:
    out = {}
    for key in store.list("validations/"):
        m = re.match(r"^validations/(\d+)\.json$", key)
        if m:
            v = read_verdict(store, int(m.group(1)))
            if v is not None:
                out[int(m.group(1))] = v
    return out


def validate_checkpoint(url: str | Store, step: int | None = None, *, storage_options: dict | None = None,
                        thresholds: "Mapping[str, Any] | Thresholds | None" = None, report: bool = True,
                        threads: int | None = None) -> dict:
    """Validate committed checkpoint ``step`` (None = the latest committed) of the run at ``url``.

    Writes ``validations/<step>.json`` (and with ``report`` the report under ``reports/<step>/``)
    and returns the verdict dict (format in docs/validation.md). Raises NoCheckpoint when the step
    is not committed, StoreError when the store cannot be reached; never raises for corruption.
    """
    t_start = time.perf_counter()
    store = url if isinstance(url, Store) else Store.from_url(url, storage_options)
    th = Thresholds.from_dict(thresholds)
    if step is None:
        steps = commit.committed_steps(store)
        if not steps:
            raise NoCheckpoint(f"no committed checkpoint in {store.url}")
        step = steps[-1]
    commit.check_step(step)
    if not store.exists(commit.manifest_key(step)):
        raise NoCheckpoint(f"step {step} is not committed in {store.url} (no {commit.manifest_key(step)})")
    with ThreadPoolExecutor(max_workers=threads or 8, thread_name_prefix="ckpt-validate") as pool:
        v = _Validation(store, step, th, pool)
        v.run()
    verdict = v.verdict
    history = None
    if report:
        t0 = time.perf_counter()
        try:
            from . import report as _report

            history = _report.write_step_report(store, verdict, v.tables, v.gx_results)
        except StoreError:
            raise
        except Exception as e:  # a broken report must not hide the verdict
            log.exception("writing the report of step %d of %s failed", step, store.url)
            verdict["report"] = {"error": f"{type(e).__name__}: {e}"}
        verdict["seconds"]["report"] = round(time.perf_counter() - t0, 3)
    verdict["seconds"]["total"] = round(time.perf_counter() - t_start, 3)
    store.put(commit.validation_key(step), json.dumps(verdict, indent=1, default=_json_default).encode())
    if report and "error" not in verdict.get("report", {}):
        try:
            from . import report as _report

            _report.write_run_index(store, history)
        except StoreError:
            raise
        except Exception:
            log.exception("refreshing reports/index.html of %s failed", store.url)
    level = logging.INFO if verdict["passed"] else logging.WARNING
    log.log(level, "validation of step %d of %s: %s%s (%.2f s)", step, store.url,
            "PASSED" if verdict["passed"] else "FAILED",
            "" if verdict["passed"] else " (" + ", ".join(verdict["failed"]) + ")", verdict["seconds"]["total"])
    return verdict


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (np.bool_,)):
        return bool(o)
    return str(o)


def _clean(v: Any) -> Any:
    """JSON-friendly numbers: NaN/Inf as strings, numpy scalars as Python."""
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if math.isfinite(f) else repr(f)
    return v


class _Validation:
    def __init__(self, store: Store, step: int, th: Thresholds, pool):
        self.store, self.step, self.th, self.pool = store, step, th, pool
        self.problems: list[Problem] = []
        self.errors: list[str] = []
        self.tensor_rows: list[dict] = []
        self.part_rows: list[dict] = []
        self.manifest: Manifest | None = None
        self.ref: _Reference | None = None
        self.tables: dict[str, Any] = {}
        self.gx_results: dict[str, Any] = {}
        self.seconds: dict[str, float] = {}
        self.verdict: dict = {}
        self.ref_values: dict[str, Any] = {"step": step, "config_hash": None, "round": None}

    # -- orchestration --
    def run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.manifest = commit.read_manifest(self.store, self.step)
        except NoCheckpoint:
            raise
        except CheckpointError as e:  # unreadable manifest: integrity fails, nothing else can run
            self.problems.append(Problem(self.step, "*", "/", None, commit.manifest_key(self.step), str(e)))
            self.tensor_rows.append({"part": "*", "tensor": commit.manifest_key(self.step), "role": "manifest",
                                     "intact": False, "problem": str(e)})
        if self.manifest is not None:
            try:
                self._measure()
            except StoreError as e:
                if not isinstance(e, ObjectNotFound):
                    raise
                self.errors.append(f"{type(e).__name__}: {e}")
            except Exception as e:  # a check broke: say so in the verdict, never crash the pipeline
                log.exception("validation of step %d of %s: a check failed to run", self.step, self.store.url)
                self.errors.append(f"{type(e).__name__}: {e} ({traceback.format_exc(limit=3).splitlines()[-2].strip()})")
        self.seconds["read_and_measure"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        self._judge()
        self.seconds["gx"] = round(time.perf_counter() - t0, 3)
        self._make_verdict()

    # -- measuring --
    def _measure(self) -> None:
        m = self.manifest
        assert m is not None
        self.ref = _load_reference(self.store, self.step, self.pool, m.single)
        names = sorted(m.parts, key=lambda n: (n != COORDINATOR, _shard_index(n) or 0, n))
        coord_model: dict[str, Any] = {}
        coord_config: dict = {}
        for name in names:
            frag = m.parts[name]
            leaves, problems = self._inspect(frag)
            self.problems += problems
            state = None
            try:
                state = unflatten(frag.skeleton, leaves)
            except CorruptCheckpoint as e:
                self.problems.append(Problem(self.step, name, "/", None, None, str(e)))
            if name == COORDINATOR:
                coord_config = _parse_config(_get(state, "config"))
                coord_model = {_norm_path(l.spec.path): o for l, o in zip(frag.leaves, leaves)
                               if o is not None and _norm_path(l.spec.path).startswith("model/")}
            self._tensor_rows(name, frag, leaves, problems, coord_model if name != COORDINATOR else {})
            self._part_row(name, frag, state, leaves)
            del leaves, state
        self._missing_shards(coord_config)

    def _inspect(self, frag: Fragment) -> tuple[list[Any], list[Problem]]:
        """Decode a part once: (leaves, problems). A leaf whose recorded spec cannot be decoded
        (unknown dtype; shape x itemsize != bytes) is reported and skipped, the rest decoded."""
        bad = {i: why for i, leaf in enumerate(frag.leaves) if (why := _spec_problem(leaf.spec))}
        problems = [Problem(self.step, frag.part, frag.leaves[i].spec.path, None, None, why) for i, why in bad.items()]
        if not bad:
            try:
                leaves, found = inspect_part(frag, self.store, self.pool)
            except CorruptCheckpoint as e:
                return [None] * len(frag.leaves), [Problem(self.step, frag.part, "/", None, None, str(e))]
            return leaves, found
        keep = [i for i in range(len(frag.leaves)) if i not in bad]
        sub = dataclasses.replace(frag, leaves=tuple(frag.leaves[i] for i in keep),
                                  skeleton=[{"__leaf__": j} for j in range(len(keep))])
        sub_leaves, found = inspect_part(sub, self.store, self.pool)
        # the sub-part's logical digest cannot match: the part-wide digest is wrong by definition here
        problems += [p for p in found if p.tensor != "/"]
        problems.append(Problem(self.step, frag.part, "/", None, None,
                                "logical digest not checked: the manifest records undecodable tensors"))
        leaves: list[Any] = [None] * len(frag.leaves)
        for i, obj in zip(keep, sub_leaves):
            leaves[i] = obj
        return leaves, problems

    def _reference_tensor(self, part: str, path: str) -> Any:
        ref = self.ref
        if ref is None or ref.manifest.single != self.manifest.single:
            return None
        if COORDINATOR in ref.models:  # shards start each round from the coordinator's model
            return ref.models[COORDINATOR].get(path)
        return ref.models.get(part, {}).get(path)

    def _reference_shape(self, part: str, path: str) -> tuple | None:
        ref = self.ref
        if ref is None:
            return None
        name = part if part in ref.manifest.parts else None
        if name is None and self.manifest.single and ref.manifest.single:
            name = next(iter(ref.manifest.parts))
        if name is None:
            return None
        cache = self.__dict__.setdefault("_ref_shapes", {})
        if name not in cache:
            cache[name] = {_norm_path(leaf.spec.path): tuple(leaf.spec.shape)
                           for leaf in ref.manifest.parts[name].leaves}
        return cache[name].get(path)

    def _tensor_rows(self, part: str, frag: Fragment, leaves: list[Any], problems: list[Problem],
                     coord_model: dict[str, Any]) -> None:
        single = self.manifest.single
        why = {}
        for p in problems:
            why.setdefault(p.tensor, str(p))
        if "/" in why:  # a part-wide problem (logical digest, skeleton): one row for the part itself
            self.tensor_rows.append({"part": part, "tensor": "/", "role": "part", "intact": False,
                                     "problem": why["/"]})
        for leaf, obj in zip(frag.leaves, leaves):
            path = _norm_path(leaf.spec.path)
            role = _role(path, single)
            spec = leaf.spec
            row: dict[str, Any] = {"part": part, "tensor": path, "role": role, "dtype": spec.dtype,
                                   "shape": "x".join(map(str, spec.shape)) or "scalar",
                                   "numel": math.prod(spec.shape)}
            problem = why.get(leaf.spec.path)
            row["intact"] = problem is None
            row["problem"] = problem
            row["spec_ok"] = _spec_ok(obj, spec) if obj is not None else (
                spec.nbytes == math.prod(spec.shape) * spec.itemsize)
            # shape references: the previous healthy checkpoint, and for a shard model the coordinator's
            refs = [self._reference_shape(part, path)]
            if part != COORDINATOR and path in coord_model:
                refs.append(tuple(coord_model[path].shape))
            refs = [r for r in refs if r is not None]
            row["shape_matches_reference"] = all(r == tuple(spec.shape) for r in refs) if refs else None
            if obj is not None:
                s = _stats(obj)
                cur_finite = s.pop("finite", False)
                row.update(s)
                if role == "param" and "norm" in s:
                    row["param_abs_max"] = s.get("abs_max")
                    row["param_norm"] = s["norm"]
                    ref = self._reference_tensor(part, path)
                    if ref is not None:
                        row["rel_change"] = _rel_change(obj, ref, self.th.rel_change_floor, cur_finite=cur_finite)
                if role == "second_moment" and "min" in s:
                    row["second_moment_min"] = s["min"]
            self.tensor_rows.append(row)

    def _part_row(self, name: str, frag: Fragment, state: Any, leaves: list[Any]) -> None:
        single = self.manifest.single
        sk = _skeleton_state(frag)
        idx = _shard_index(name)
        role = COORDINATOR if name == COORDINATOR else "shard" if idx is not None else "part"
        prev = self.ref.states.get(name) if self.ref is not None else None
        if prev is None and self.ref is not None and single and self.ref.manifest.single:
            prev = next(iter(self.ref.states.values()))
        rnd, prev_rnd = _int(_get(sk, "round")), _int(_get(prev, "round"))
        pos, prev_pos = _int(_get(sk, "data_position")), _int(_get(prev, "data_position"))
        groups = [[s for s in group if s is not None] for group in _optimizer_steps(state)] if state is not None else []
        steps = [s for g in groups for s in g]
        spreads = [max(g) - min(g) for g in groups if g]
        loss, _ = _loss_of(name, sk, frag)
        row = {
            "part": name, "role": role, "present": True,
            "expected": True, "generation": frag.generation, "fragment_step": frag.step,
            "config_hash": frag.config_hash, "round": rnd, "prev_round": prev_rnd,
            "round_advance": rnd - prev_rnd if rnd is not None and prev_rnd is not None else None,
            "data_position": pos, "prev_data_position": prev_pos,
            "data_advance": pos - prev_pos if pos is not None and prev_pos is not None else None,
            "rng_present": (_rng_present(sk) if role != "shard" else bool(_rng_present(sk))),
            "opt_step_min": min(steps) if steps else None, "opt_step_max": max(steps) if steps else None,
            "opt_step_spread": max(spreads) if spreads else None,
            "loss": loss, "loss_finite": None if loss is None else math.isfinite(loss),
            "tensors": len(frag.leaves), "logical_bytes": frag.logical_bytes, "bytes_written": frag.bytes_written,
        }
        if single:
            row["fragment_step"] = self.step if frag.step == self.step else frag.step
        self.part_rows.append(row)

    def _missing_shards(self, config: dict) -> None:
        present = {_shard_index(r["part"]): r for r in self.part_rows if _shard_index(r["part"]) is not None}
        if self.manifest.single or (not present and COORDINATOR not in self.manifest.parts):
            return
        n = _configured_shards(config)
        if n is None and self.ref is not None:
            prev = [i for i in map(_shard_index, self.ref.manifest.parts) if i is not None]
            n = max(prev) + 1 if prev else None
        if n is None:
            n = max(present) + 1 if present else 0
        for i in range(n):
            if i not in present:
                self.part_rows.append({"part": f"shard-{i}", "role": "shard", "present": False, "expected": True})
        for i, row in present.items():
            row["expected"] = i < n
        coord = next((r for r in self.part_rows if r["part"] == COORDINATOR), None)
        hashes = [r.get("config_hash") for r in self.part_rows if r.get("present")]
        rounds = [r.get("round") for r in self.part_rows if r.get("present") and r.get("round") is not None]
        self.ref_values["config_hash"] = (coord["config_hash"] if coord and coord["config_hash"] is not None
                                          else _mode(hashes))
        self.ref_values["round"] = coord["round"] if coord and coord.get("round") is not None else _mode(rounds)
        self.config_shards = n

    # -- judging --
    def _tables(self):
        import pandas as pd

        tensors = pd.DataFrame(self.tensor_rows, columns=_TENSOR_COLUMNS)
        parts = pd.DataFrame(self.part_rows, columns=_PART_COLUMNS)
        for df, cols in ((tensors, ("intact", "spec_ok", "shape_matches_reference")),
                         (parts, ("present", "expected", "rng_present", "loss_finite"))):
            for c in cols:
                df[c] = df[c].astype(object).where(df[c].notna(), None)
        for c in ("config_hash",):
            parts[c] = parts[c].astype(object).where(parts[c].notna(), None)
        return {"tensors": tensors, "parts": parts}

    def _judge(self) -> None:
        self.tables = self._tables()
        ref = dict(self.ref_values)
        if ref["config_hash"] is None:
            ref["config_hash"] = _mode([h for h in self.tables["parts"]["config_hash"] if h is not None])
        # a value no row holds, for a column that is all null (a single-part save): nothing to compare
        ref["config_hash"] = "" if ref["config_hash"] is None else ref["config_hash"]
        ref["round"] = -1 if ref["round"] is None else ref["round"]
        try:
            self.gx_results = _run_gx(self.tables, self.th, ref, f"step-{self.step}")
        except Exception as e:
            log.exception("Great Expectations failed on step %d of %s", self.step, self.store.url)
            self.errors.append(f"Great Expectations: {type(e).__name__}: {e}")
            self.gx_results = {}

    def _failures(self) -> list[dict]:
        out = []
        problem_text = [str(p) for p in self.problems]
        for table, res in self.gx_results.items():
            for r in res.results:
                if r.success:
                    continue
                cfg = r.expectation_config
                name = (cfg.meta or {}).get("name", cfg.type)
                res_d = r.result or {}
                rows = res_d.get("unexpected_index_list") or []
                col = cfg.kwargs.get("column")
                where = []
                for row in rows:
                    if not isinstance(row, dict):
                        continue
                    label = f"part '{row.get('part')}'"
                    if "tensor" in row:
                        label += f", tensor '{row.get('tensor')}'"
                    if col in row:
                        val = _clean(row[col])
                        if isinstance(val, float) and val.is_integer():
                            val = int(val)  # an int column with nulls became float in pandas
                        label += f" ({col}={val})"
                    where.append(label)
                if name == "checkpoint_integrity" and problem_text:
                    where = problem_text
                if r.exception_info and r.exception_info.get("raised_exception"):
                    where.append(f"expectation raised: {r.exception_info.get('exception_message')}")
                count = res_d.get("unexpected_count", len(where))
                out.append({"expectation": name, "gx_type": cfg.type, "table": table, "column": col,
                            "count": int(count) if count is not None else None, "where": where[:_MAX_WHERE],
                            "what": next((c.what for c in CHECKS if c.name == name), "")})
        if self.errors:
            out.append({"expectation": VALIDATION_ERROR, "gx_type": None, "table": None, "column": None,
                        "count": len(self.errors), "where": self.errors, "what": "a check could not run"})
        order = {n: i for i, n in enumerate(CHECK_NAMES + (VALIDATION_ERROR,))}
        out.sort(key=lambda f: order.get(f["expectation"], 99))
        return out

    def _summary(self) -> dict:
        m = self.manifest
        t, p = self.tables["tensors"], self.tables["parts"]

        def agg(col, fn):
            s = t[col].dropna() if col in t else []
            return _clean(fn(s)) if len(s) else None

        loss, eval_loss = manifest_loss(m) if m is not None else (None, None)
        shards = [r for r in self.part_rows if r.get("role") == "shard"]
        return {
            "single": m.single if m else None,
            "kind": m.kind if m else None,
            "parent": m.parent if m else None,
            "created": m.created if m else None,
            "digest": m.digest if m else None,
            "parts": sorted(m.parts) if m else [],
            "shards_present": sum(1 for r in shards if r.get("present")),
            "shards_expected": getattr(self, "config_shards", None),
            "tensors": int(len(t)),
            "logical_bytes": m.logical_bytes if m else None,
            "bytes_written": m.bytes_written if m else None,
            "stored_bytes": m.stored_bytes if m else None,
            "ratio": round(m.logical_bytes / max(m.bytes_written, 1), 2) if m else None,
            "loss": _clean(loss) if loss is not None else None,
            "eval_loss": _clean(eval_loss) if eval_loss is not None else None,
            "previous_healthy_step": self.ref.step if self.ref else None,
            "nan_count": agg("nan_count", lambda s: int(s.sum())),
            "inf_count": agg("inf_count", lambda s: int(s.sum())),
            "max_abs_value": agg("param_abs_max", max),
            "max_norm": agg("param_norm", max),
            "max_rel_change": agg("rel_change", max),
            "min_second_moment": agg("second_moment_min", min),
            "data_positions": {r["part"]: r.get("data_position") for r in shards if r.get("present")},
            "round": _clean(self.ref_values.get("round")) if self.ref_values.get("round") is not None else None,
            "integrity_problems": len(self.problems),
        }

    def _make_verdict(self) -> None:
        failures = self._failures()
        stats = {"evaluated": 0, "successful": 0}
        for res in self.gx_results.values():
            stats["evaluated"] += int(res.statistics["evaluated_expectations"])
            stats["successful"] += int(res.statistics["successful_expectations"])
        failed = [f["expectation"] for f in failures]
        passed = bool(self.gx_results) and not failures and not self.problems
        if not passed and not failed and self.problems:  # integrity problems never slip through
            failed = ["checkpoint_integrity"]
        key = report_prefix(self.step)
        self.verdict = {
            "format": VERDICT_FORMAT,
            "step": self.step,
            "run": self.store.url,
            "passed": passed,
            "failed": failed,
            "failures": failures,
            "problems": [str(p) for p in self.problems],
            "integrity": [dataclasses.asdict(p) for p in self.problems],
            "expectations": stats,
            "summary": self._summary(),
            "thresholds": self.th.to_dict(),
            "report": {"html": key + "index.html", "gx_tensors_html": key + "tensors.html",
                       "gx_parts_html": key + "parts.html", "summary": key + "summary.json",
                       "plot": key + "run.png", "url": f"{self.store.url}/{key}index.html"},
            "validated_at": datetime.now(timezone.utc).isoformat(),
            "seconds": dict(self.seconds),
        }


def _shard_index(name: str) -> int | None:
    m = _SHARD.match(name)
    return int(m.group(1)) if m else None


def _mode(values: list) -> Any:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return max(set(values), key=values.count)


def format_verdict(verdict: dict) -> str:
    """A few lines for a terminal or a log: the verdict and, when failed, what and where."""
    s = verdict.get("summary", {})
    head = (f"step {verdict['step']}: {'PASSED' if verdict['passed'] else 'FAILED'} "
            f"({verdict.get('expectations', {}).get('successful', 0)}/"
            f"{verdict.get('expectations', {}).get('evaluated', 0)} expectations; "
            f"{s.get('tensors', 0)} tensors in {len(s.get('parts', []))} parts; "
            f"{verdict.get('seconds', {}).get('total', 0):.2f} s)")
    lines = [head]
    for f in verdict.get("failures", []):
        lines.append(f"  FAILED {f['expectation']}: {f.get('what', '')} [{f.get('count')}]")
        for w in f.get("where", [])[:10]:
            lines.append(f"    - {w}")
        if len(f.get("where", [])) > 10:
            lines.append(f"    ... and {len(f['where']) - 10} more")
    rep = verdict.get("report", {})
    if rep.get("url"):
        lines.append(f"  report: {rep['url']}")
    return "\n".join(lines)
