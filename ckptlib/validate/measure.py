"""Reading a committed checkpoint once and measuring it into the two tables GX judges.

``measure(store, step, thresholds, pool, extensions)`` decodes every part once with
``reader.inspect_part`` (every chunk's checksum, every tensor's digest, the logical digest, in the
same pass that yields the tensors), one part at a time (memory: one part, plus the models the parts
are compared with), and returns a ``Measurement``:

* ``tensors``: a row per stored tensor of every part (integrity, dtype/shape, NaN/Inf counts,
  range, norm, relative change against the previous healthy checkpoint, Adam second-moment minimum):
  a row per leaf and per view of a storage leaf; a storage leaf's own row (role ``storage``: the
  bytes its views share, gaps included) has integrity only, its views have the statistics;
* ``parts``: a row per part of the cut (step, config hash, optimizer step counters, loss), plus the
  columns and rows the extensions add (``checks.PartChecks``);
* the integrity problems, the errors of checks that could not run, and summary entries.

Comparisons are against the previous healthy checkpoint (the latest committed step below this one
whose verdict passed).
"""

from __future__ import annotations

import logging
import math
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import commit
from ..distributed.group import global_shape
from ..distributed.restoring import part_views
from ..errors import CheckpointError, CorruptCheckpoint, NoCheckpoint, ObjectNotFound, StoreError
from ..leaves import finish_leaf
from ..manifest import Fragment, Manifest
from ..restore import Problem, decode_leaves, inspect_part
from ..store import Store
from ..tree import unflatten
from .checks import CutView, Findings, PartChecks
from .stats import (
    TensorEntry,
    entry_value,
    loss_of,
    mode,
    model_filter,
    optimizer_steps,
    rel_change,
    role,
    skeleton_state,
    spec_ok,
    tensor_entries,
    tensor_stats,
)
from .thresholds import Thresholds
from .verdict import previous_healthy_step

log = logging.getLogger("ckptlib.validate")

TENSOR_COLUMNS = ["part", "tensor", "role", "dtype", "shape", "numel", "intact", "problem", "spec_ok",
                  "shape_matches_reference", "nan_count", "inf_count", "min", "max", "abs_max", "norm",
                  "param_abs_max", "param_norm", "rel_change", "second_moment_min"]
PART_COLUMNS = ["part", "role", "present", "generation", "fragment_step", "config_hash", "opt_step_min",
                "opt_step_max", "opt_step_spread", "loss", "loss_finite", "tensors", "logical_bytes", "bytes_written"]


@dataclass
class Reference:
    """The previous healthy checkpoint: its manifest, fragments, skeleton states, and the models
    compared with."""

    step: int
    manifest: Manifest
    fragments: dict[str, Fragment]
    models: dict[str, dict[str, Any]]  # part -> {tensor path: tensor} (model tensors only)
    states: dict[str, Any]  # part -> skeleton state (scalars)


@dataclass
class Measurement:
    step: int
    manifest: Manifest | None = None
    reference: Reference | None = None
    tensor_rows: list[dict[str, Any]] = field(default_factory=list)
    part_rows: list[dict[str, Any]] = field(default_factory=list)
    part_columns: list[str] = field(default_factory=lambda: list(PART_COLUMNS))
    problems: list[Problem] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # checks that could not run
    ref_values: dict[str, Any] = field(default_factory=dict)  # what the checks compare with
    summary: dict[str, Any] = field(default_factory=dict)  # the extensions' entries

    def tables(self) -> dict[str, Any]:
        """The two DataFrames GX judges (booleans as objects, so nulls stay nulls)."""
        import pandas as pd

        tensors = pd.DataFrame(self.tensor_rows, columns=TENSOR_COLUMNS)
        parts = pd.DataFrame(self.part_rows, columns=self.part_columns)
        for df, cols in ((tensors, ("intact", "spec_ok", "shape_matches_reference")),
                         (parts, [c for c in self.part_columns if c not in ("part", "role")])):
            for c in cols:
                if df[c].dtype == bool or df[c].dtype == object:
                    df[c] = df[c].astype(object).where(df[c].notna(), None)
        return {"tensors": tensors, "parts": parts}


def measure(store: Store, step: int, th: Thresholds, pool: Any, extensions: Sequence[PartChecks]) -> Measurement:
    """Measure committed ``step`` (see the module docstring). Raises NoCheckpoint, and StoreError
    when the store cannot be read (other than a missing object, which is a finding)."""
    out = Measurement(step, ref_values={"step": step, "config_hash": None})
    for ext in extensions:  # every check's column exists, even when nothing could be measured
        out.part_columns += [c.column for c in ext.checks if c.table == "parts" and c.column not in out.part_columns]
    try:
        out.manifest = commit.read_manifest(store, step)
    except NoCheckpoint:
        raise
    except CheckpointError as e:  # unreadable manifest: integrity fails, nothing else can run
        out.problems.append(Problem(step, "*", "/", None, commit.manifest_key(step), str(e)))
        out.tensor_rows.append({"part": "*", "tensor": commit.manifest_key(step), "role": "manifest",
                                "intact": False, "problem": str(e)})
        return out
    try:
        _Measure(store, out, th, pool, extensions).run()
    except StoreError as e:
        if not isinstance(e, ObjectNotFound):
            raise
        out.errors.append(f"{type(e).__name__}: {e}")
    except Exception as e:  # a check broke: say so in the verdict, never crash the pipeline
        log.exception("validation of step %d of %s: a check failed to run", step, store.url)
        out.errors.append(f"{type(e).__name__}: {e} ({traceback.format_exc(limit=3).splitlines()[-2].strip()})")
    return out


def _global_shape(frag: Fragment, entry: TensorEntry) -> tuple[int, ...]:
    """The shape of the tensor ``entry`` is: a view's own; a leaf's global one (a rank's shard of a
    group's part is compared as the whole tensor it is a piece of: ``group.local_view``)."""
    if entry.view is not None:
        return tuple(entry.shape)
    return global_shape(frag, frag.leaves[entry.leaf].spec.path, tuple(entry.shape))


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class _Measure:
    def __init__(self, store: Store, out: Measurement, th: Thresholds, pool: Any, extensions: Sequence[PartChecks]):
        self.store, self.out, self.th, self.pool, self.extensions = store, out, th, pool, extensions
        assert out.manifest is not None
        self.m: Manifest = out.manifest
        self.step = out.step
        self.frags: dict[str, Fragment] = {}  # the parts that could be read
        self._ref_shapes: dict[str, dict[str, tuple]] = {}

    def base(self, part: str) -> str:
        """The part whose model ``part``'s model is compared with (the first extension that says)."""
        for ext in self.extensions:
            b = ext.model_base(part)
            if b != part:
                return b
        return part

    def run(self) -> None:
        m = self.m
        bases = {self.base(n) for n in m.parts}
        self.out.reference = self._load_reference(set(m.parts))
        # bases first: a part's shapes are compared with its base's in this cut
        names = sorted(m.parts, key=lambda n: (n not in bases, _natural(n)))
        models: dict[str, dict[str, Any]] = {}
        views: list[tuple[str, Fragment]] = []  # a group's part is measured rank by rank (docs/validation.md)
        for name in names:
            try:
                views += part_views(self.store, self.pool, m, name).items()
            except CorruptCheckpoint as e:  # its fragment is missing, damaged or malformed
                self.out.problems.append(Problem(self.step, name, "/", None, m.parts[name].key, str(e)))
                self.out.tensor_rows.append({"part": name, "tensor": "/", "role": "part", "intact": False,
                                             "problem": str(e)})
        for name, frag in views:
            self.frags[name] = frag
            leaves, problems = self._inspect(frag)
            self.out.problems += problems
            state = None
            try:
                state = unflatten(frag.skeleton, leaves, [leaf.spec for leaf in frag.leaves])
            except CorruptCheckpoint as e:
                self.out.problems.append(Problem(self.step, name, "/", None, None, str(e)))
            entries = tensor_entries(frag)
            if name in bases:
                keep = model_filter(m.single)
                values = {e.path: entry_value(e, leaves) for e in entries if not e.storage and keep(e.path)}
                models[name] = {p: o for p, o in values.items() if o is not None}
            base = self.base(name)
            self._tensor_rows(name, frag, entries, leaves, problems, models.get(base, {}) if base != name else {})
            self._part_row(name, frag, state)
            del leaves, state
        self._extensions()

    # -- reading --
    def _load_reference(self, parts: set[str]) -> Reference | None:
        prev = previous_healthy_step(self.store, self.step)
        if prev is None:
            return None
        try:
            m = commit.read_manifest(self.store, prev)
        except CheckpointError as e:
            log.warning("previous healthy checkpoint %d of %s is unreadable (%s): no reference", prev,
                        self.store.url, e)
            return None
        # the models compared with: each part's base, or the part itself where the base is not there
        wanted = {b if b in m.parts else p for p in parts for b in [self.base(p)]}
        frags, models, states = {}, {}, {}
        for part in m.parts:
            try:
                for name, frag in part_views(self.store, self.pool, m, part).items():
                    frags[name] = frag
                    states[name] = skeleton_state(frag)
                    if name in wanted or m.single:
                        models[name] = self._restore_leaves(frag, model_filter(m.single))
            except CheckpointError as e:
                log.warning("cannot read part %s of step %d (%s): no reference for it", part, prev, e)
        return Reference(prev, m, frags, models, states)

    def _restore_leaves(self, frag: Fragment, wanted: Callable[[str], bool]) -> dict[str, Any]:
        """The intact tensors of ``frag`` (leaves and views) whose path satisfies ``wanted``, by
        normalised path."""
        entries = [e for e in tensor_entries(frag) if not e.storage and wanted(e.path)]
        idx = sorted({e.leaf for e in entries})
        if not idx:
            return {}
        objects, _, _ = decode_leaves(frag, self.store, self.pool, idx)
        leaves = [None] * len(frag.leaves)
        for i, obj in objects.items():
            leaves[i] = finish_leaf(obj, frag.leaves[i].spec, "cpu")
        values = {e.path: entry_value(e, leaves) for e in entries}
        return {p: o for p, o in values.items() if o is not None}

    def _inspect(self, frag: Fragment) -> tuple[list[Any], list[Problem]]:
        """Decode a part once: (leaves, problems); a damaged leaf is None, the rest are measured."""
        try:
            return inspect_part(frag, self.store, self.pool)
        except CorruptCheckpoint as e:
            return [None] * len(frag.leaves), [Problem(self.step, frag.part, "/", None, None, str(e))]

    # -- references --
    def _reference_tensor(self, part: str, path: str) -> Any:
        ref = self.out.reference
        if ref is None or ref.manifest.single != self.m.single:
            return None
        base = self.base(part)
        models = ref.models.get(base) if base in ref.models else ref.models.get(part)
        return (models or {}).get(path)

    def _reference_shape(self, part: str, path: str) -> tuple | None:
        ref = self.out.reference
        if ref is None:
            return None
        name = part if part in ref.manifest.parts else None
        if name is None and self.m.single and ref.manifest.single:
            name = next(iter(ref.manifest.parts))
        if name is None:
            return None
        if name not in self._ref_shapes:
            frag = ref.fragments.get(name)
            self._ref_shapes[name] = {} if frag is None else {e.path: _global_shape(frag, e) for e in
                                                              tensor_entries(frag) if not e.storage}
        return self._ref_shapes[name].get(path)

    # -- rows --
    def _tensor_rows(self, part: str, frag: Fragment, entries: list[TensorEntry], leaves: list[Any],
                     problems: list[Problem], base_model: dict[str, Any]) -> None:
        single = self.m.single
        why: dict[str, str] = {}
        for p in problems:
            why.setdefault(p.tensor, str(p))
        if "/" in why:  # a part-wide problem (logical digest, skeleton): one row for the part itself
            self.out.tensor_rows.append({"part": part, "tensor": "/", "role": "part", "intact": False,
                                         "problem": why["/"]})
        for entry in entries:
            spec = entry if entry.view is not None else frag.leaves[entry.leaf].spec
            path, obj = entry.path, entry_value(entry, leaves)
            kind = "storage" if entry.storage else role(path, single)
            row: dict[str, Any] = {"part": part, "tensor": path, "role": kind, "dtype": spec.dtype,
                                   "shape": "x".join(map(str, spec.shape)) or "scalar",
                                   "numel": math.prod(spec.shape)}
            problem = why.get(frag.leaves[entry.leaf].spec.path)
            row["intact"] = problem is None
            row["problem"] = problem
            row["spec_ok"] = spec_ok(obj, spec) if obj is not None else (
                spec.nbytes == math.prod(spec.shape) * spec.itemsize)
            if entry.storage:  # bytes that views share (gaps included): its views are measured
                self.out.tensor_rows.append(row)
                continue
            # shape references: the previous healthy checkpoint, and the model this part starts from
            refs = [self._reference_shape(part, path)]
            if path in base_model:
                refs.append(tuple(base_model[path].shape))
            known = [r for r in refs if r is not None]
            row["shape_matches_reference"] = all(r == _global_shape(frag, entry) for r in known) if known else None
            if obj is not None:
                s = tensor_stats(obj)
                cur_finite = s.pop("finite", False)
                row.update(s)
                if kind == "param" and "norm" in s:
                    row["param_abs_max"] = s.get("abs_max")
                    row["param_norm"] = s["norm"]
                    ref = self._reference_tensor(part, path)
                    if ref is not None:
                        row["rel_change"] = rel_change(obj, ref, self.th.rel_change_floor, cur_finite=cur_finite)
                if kind == "second_moment" and "min" in s:
                    row["second_moment_min"] = s["min"]
            self.out.tensor_rows.append(row)

    def _part_row(self, name: str, frag: Fragment, state: Any) -> None:
        sk = skeleton_state(frag)
        groups = [[s for s in group if s is not None] for group in optimizer_steps(state)] if state is not None else []
        steps = [s for g in groups for s in g]
        spreads = [max(g) - min(g) for g in groups if g]
        loss, _ = loss_of(sk, frag)
        self.out.part_rows.append({
            "part": name, "role": "part", "present": True, "generation": frag.generation,
            "fragment_step": self.step if self.m.single and frag.step == self.step else frag.step,
            "config_hash": frag.config_hash,
            "opt_step_min": min(steps) if steps else None, "opt_step_max": max(steps) if steps else None,
            "opt_step_spread": max(spreads) if spreads else None,
            "loss": loss, "loss_finite": None if loss is None else math.isfinite(loss),
            "tensors": len(frag.leaves), "logical_bytes": frag.logical_bytes, "bytes_written": frag.bytes_written,
        })

    def _extensions(self) -> None:
        ref = self.out.reference
        cut = CutView(step=self.step, manifest=self.m,
                      states={n: skeleton_state(f) for n, f in self.frags.items()},
                      previous=ref.manifest if ref else None, previous_states=ref.states if ref else {},
                      thresholds=self.th)
        leader = None
        rows = {r["part"]: r for r in self.out.part_rows}
        for ext in self.extensions:
            found: Findings = ext.inspect(cut)
            for part, values in found.rows.items():
                for col in values:
                    if col not in self.out.part_columns:
                        self.out.part_columns.append(col)
                if part in rows:
                    rows[part].update(values)
                else:
                    rows[part] = {"part": part, **values}
                    self.out.part_rows.append(rows[part])
            self.out.ref_values.update(found.reference)
            self.out.summary.update(found.summary)
            leader = leader or found.leader
        hashes = [r.get("config_hash") for r in self.out.part_rows if r.get("present")]
        lead = rows.get(leader) if leader else None
        self.out.ref_values["config_hash"] = (lead["config_hash"] if lead and lead.get("config_hash") is not None
                                              else mode(hashes))
