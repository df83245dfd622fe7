"""Every error trainrun raises on purpose, in ckptlib's tree (``ckptlib.errors.CheckpointError``).

The stdlib mixins say how a caller may treat them: a refusal is a ``ValueError`` (deterministic:
``tasks/retry.py`` never retries it; the CLI prints it as one line), a drill's crash a ``RuntimeError``
(a loud failure that Prefect retries). Each message names the cause and the fix.
"""

from __future__ import annotations

from ckptlib.errors import CheckpointError


class RunRefused(CheckpointError, ValueError):
    """A run cannot start or continue as asked (existing checkpoints, changed configuration)."""


class RerunRefused(CheckpointError, ValueError):
    """A dead shard cannot (or must not) be rerun here; the message says why and what would allow it."""


class ChaosCrash(CheckpointError, RuntimeError):
    """Raised on purpose by a ``crash`` chaos spec (and by a hang/zombie nobody fenced)."""


class RankGroupFailed(CheckpointError, RuntimeError):
    """A rank of a shard's group died, hung, failed or could not join: the whole group's attempt
    failed (its other ranks were ended); a retry starts a fresh group from the same cut."""


class LauncherError(CheckpointError, RuntimeError):
    """The rank launcher (``trainrun.rank_launcher``) could not be started or could not fork a rank;
    the group's ranks then start as their own processes."""


class RankGroupRefused(CheckpointError, ValueError):
    """A rank of a shard's group refused its work (a workload or batch that cannot be split over the
    ranks): a retry would fail the same way; the message names the fix."""


class Preempted(CheckpointError, RuntimeError):
    """A shard attempt stopped on purpose: its process got SIGTERM (a preemption) or its run was
    cancelled. Its state is in a shard checkpoint at ``round_step``: a rerun, here or elsewhere,
    continues from there and recomputes nothing."""

    def __init__(self, message: str, *, part: str = "", round_no: int = 0, round_step: int = 0, reason: str = ""):
        super().__init__(message)
        self.part, self.round_no, self.round_step, self.reason = part, round_no, round_step, reason

