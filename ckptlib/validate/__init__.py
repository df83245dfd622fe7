"""Checkpoint validation: restore a committed checkpoint, measure it, let Great Expectations judge it.

Who calls what
--------------
``validate_checkpoint(url, step)`` is the one entry point (``ckpt validate``, the Prefect task
``tasks.validate`` and the ``validate-checkpoint`` flow call it, with a training run's checks from
``trainrun.checks``). It

1. measures the checkpoint into two pandas DataFrames (``measure``): ``tensors`` (a row per stored
   tensor of every part) and ``parts`` (a row per part of the cut, plus what extensions add);
2. runs two Expectation Suites on them (``gx``), built from the ``Check``s (``checks``: the generic
   ones, and those of ``PartChecks`` extensions);
3. writes the report (``report``: ``reports/<step>/`` and ``reports/index.html``) and then the
   verdict ``validations/<step>.json`` (``verdict``), both through the ``Store``.

Modules, one idea each (no cycle: thresholds <- checks <- gx; stats <- measure; verdict <- report <- run)::

    thresholds  Thresholds: the numeric bounds
    checks      Check, the generic CHECKS, the PartChecks extension point
    stats       per-tensor statistics, a part's readable scalars
    measure     reading a checkpoint once into the two tables
    gx          the suites, running GX, Data Docs pages
    verdict     Verdict and Failure documents, reading verdicts back
    report      the HTML report, the run's plot and index
    run         validate_checkpoint

Importing this package is cheap: Great Expectations, pandas and matplotlib load on first use.
"""

from .checks import CHECK_NAMES, CHECKS, VALIDATION_ERROR, Check, CutView, Findings, PartChecks
from .run import validate_checkpoint
from .stats import manifest_loss
from .thresholds import Thresholds
from .verdict import (
                      VERDICT_FORMAT,
                      Failure,
                      Verdict,
                      error_verdict,
                      format_verdict,
                      list_verdicts,
                      previous_healthy_step,
                      read_verdict,
)

__all__ = [
    "CHECKS", "CHECK_NAMES", "VALIDATION_ERROR", "VERDICT_FORMAT", "Check", "CutView", "Failure", "Findings",
    "PartChecks", "Thresholds", "Verdict", "error_verdict", "format_verdict", "list_verdicts", "manifest_loss",
    "previous_healthy_step", "read_verdict", "validate_checkpoint",
]
