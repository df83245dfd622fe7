"""The watchdog of training runs, without Prefect (``flows/watchdog.py`` is the flow around it).

    judge      the rules: each part's state from its beats and fences (silent, stalled, lost, ...)
    memory     what a watchdog remembers between looks (progress, generations seen, decisions made)
    decisions  Decision and Fence documents, one line of text per decision
    rerun      what a rerun needs, and what the watchdog refuses to run
    watchdog   the state machine: find runs, judge, fence, rerun, report dead runs
"""

from ..errors import RerunRefused
from .decisions import Decision, Fence, describe, read_fences
from .judge import DEFAULT_POLL_S, DEFAULT_TIMEOUT_S, PartView, RunView, assess_run, superseded
from .memory import Memory
from .rerun import RerunRequest
from .watchdog import Watchdog, watchdog_name

__all__ = [
    "DEFAULT_POLL_S", "DEFAULT_TIMEOUT_S", "Decision", "Fence", "Memory", "PartView", "RerunRefused", "RerunRequest",
    "RunView", "Watchdog", "assess_run", "describe", "read_fences", "superseded", "watchdog_name",
]
