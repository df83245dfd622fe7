"""Which failures a task retries: only those a second attempt can fix.

Prefect calls ``retry_condition_fn(task, task_run, state)`` with the failed state; its data is the
exception. A deterministic failure (a conflicting commit, corrupt or refused state, a bad config or
workload) fails the same way again, so it fails at once, naming its cause.
"""

from __future__ import annotations

from typing import Any

from ckptlib.errors import (
    CommitConflict,
    CorruptCheckpoint,
    FormatVersionError,
    NoCheckpoint,
    ObjectNotFound,
    StoreError,
    UnsupportedState,
)

DETERMINISTIC = (CommitConflict, CorruptCheckpoint, FormatVersionError, UnsupportedState, NoCheckpoint,
                 ValueError, TypeError, ImportError)


def _exception(state: Any) -> BaseException | None:
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):
        return data
    try:
        result = state.result(raise_on_failure=False)
    except Exception as e:  # noqa: BLE001 - the state's result cannot be read: judge by that error
        return e
    return result if isinstance(result, BaseException) else None


def transient_store_error(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a store that could not be reached (``StoreError``), nothing else."""
    exc = _exception(state)
    return isinstance(exc, StoreError) and not isinstance(exc, ObjectNotFound)


def loud_failure(task: Any, task_run: Any, state: Any) -> bool:
    """Retry what a second attempt may survive: a crash, a lost worker, a store error; not a
    deterministic failure (``DETERMINISTIC``)."""
    exc = _exception(state)
    if isinstance(exc, StoreError) and not isinstance(exc, ObjectNotFound):
        return True
    return not isinstance(exc, DETERMINISTIC)
