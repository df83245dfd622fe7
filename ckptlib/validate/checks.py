"""The expectations a validation judges (``Check``), the generic ones (``CHECKS``), and the extension
point for checks of a layout ckptlib does not know (``PartChecks``).

A ``Check`` names one column of one table (``tensors``: a row per stored tensor; ``parts``: a row
per part of the cut) and what its values must be: in a set, or between bounds, computed from the
``Thresholds`` and the reference values of the checkpoint (``ref``: its step, the config hash every
part must carry, and what extensions add).

Extensions
----------
ckptlib knows manifests, parts, tensors and optimizer state dicts, nothing of who wrote the parts.
A caller who does (a training run: ``trainrun.checks``) passes ``PartChecks`` objects to
``validate_checkpoint(..., extensions=[...])``. For each validation the library calls:

* ``model_base(part)``: the part whose model a part's model is compared with: its relative
  change against the previous healthy checkpoint, and its shapes against that part in this cut
  (a training run's shards start each round from the coordinator's model). Default: itself; a
  base the checkpoint does not hold falls back to the part itself.
* ``inspect(cut)``: ``Findings``: per part, values of the extension's columns (a part absent from
  the cut gets a row of its own), reference values for its checks, the part whose config hash the
  others must carry, and entries for the verdict's summary.

Their ``checks`` join the ``parts`` suite. Every check runs on every checkpoint; a column that does
not apply is null, and null values are not judged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .thresholds import Thresholds

if TYPE_CHECKING:
    from ...manifest import Manifest

Ref = Mapping[str, Any]
VALIDATION_ERROR = "validation_error"  # a check itself broke: reported, never raised


@dataclass(frozen=True)
class Check:
    """One named expectation of a suite: the name is what verdicts, artifacts and the CLI show."""

    name: str
    table: Literal["tensors", "parts"]
    column: str
    what: str  # a sentence for people (also the GX description)
    in_set: Callable[[Thresholds, Ref], list[Any]] | None = None
    between: Callable[[Thresholds, Ref], tuple[float | None, float | None]] | None = None


def _true(th: Thresholds, ref: Ref) -> list[Any]:
    return [True]


CHECKS: tuple[Check, ...] = (
    Check("checkpoint_integrity", "tensors", "intact",
          "every chunk is present, decodes and matches its checksum; tensor and logical digests match", in_set=_true),
    Check("dtype_shape_as_recorded", "tensors", "spec_ok",
          "every tensor restores with the dtype and shape its manifest records, and shape x itemsize = bytes",
          in_set=_true),
    Check("shape_matches_reference", "tensors", "shape_matches_reference",
          "every tensor has the shape it had in the previous healthy checkpoint, and a model the shapes of "
          "the model it starts from", in_set=_true),
    Check("no_nan", "tensors", "nan_count", "no tensor holds a NaN", between=lambda th, ref: (0, 0)),
    Check("no_inf", "tensors", "inf_count", "no tensor holds an Inf", between=lambda th, ref: (0, 0)),
    Check("values_within_bounds", "tensors", "param_abs_max", "model tensors: max |value| <= max_abs_value",
          between=lambda th, ref: (0, th.max_abs_value)),
    Check("norms_within_bounds", "tensors", "param_norm", "model tensors: L2 norm <= max_norm",
          between=lambda th, ref: (0, th.max_norm)),
    Check("relative_change_within_bounds", "tensors", "rel_change",
          "model tensors: relative change against the previous healthy checkpoint <= max_rel_change",
          between=lambda th, ref: (0, th.max_rel_change)),
    Check("adam_second_moments_nonnegative", "tensors", "second_moment_min",
          "optimizer second moments (exp_avg_sq) are >= 0", between=lambda th, ref: (0, None)),
    Check("same_step", "parts", "fragment_step", "every part was written for this step",
          in_set=lambda th, ref: [ref["step"]]),
    Check("same_config_hash", "parts", "config_hash", "every part carries the same config hash",
          in_set=lambda th, ref: [ref["config_hash"]]),
    Check("optimizer_steps_consistent", "parts", "opt_step_spread",
          "an optimizer's per-parameter step counters agree (spread <= max_step_spread)",
          between=lambda th, ref: (0, th.max_step_spread)),
    Check("loss_finite", "parts", "loss_finite", "the recorded loss is a finite number", in_set=_true),
)
CHECK_NAMES = tuple(c.name for c in CHECKS)


@dataclass(frozen=True)
class CutView:
    """What an extension sees of the checkpoint being validated: skeletons, no tensor read."""

    step: int
    manifest: Manifest
    states: Mapping[str, Any]  # part -> its state, every tensor a marker (scalars are readable)
    previous: Manifest | None  # the previous healthy checkpoint
    previous_states: Mapping[str, Any]
    thresholds: Thresholds


@dataclass
class Findings:
    """What an extension found in one checkpoint (see the module docstring)."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    reference: dict[str, Any] = field(default_factory=dict)
    leader: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)


class PartChecks(Protocol):
    """Checks of a layout of parts ckptlib does not know (see the module docstring)."""

    @property
    def checks(self) -> Sequence[Check]: ...

    def model_base(self, part: str) -> str: ...

    def inspect(self, cut: CutView) -> Findings: ...


def all_checks(extensions: Sequence[PartChecks] = ()) -> tuple[Check, ...]:
    """The generic checks, then each extension's, in the order verdicts list failures."""
    return CHECKS + tuple(c for ext in extensions for c in ext.checks)
