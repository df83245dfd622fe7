"""Log levels that match what happened: a fenced shard attempt is the watchdog doing its job.

Prefect logs the end of every task run that is not Completed at ERROR ("Finished in state
Fenced(...)"). A ``Fenced`` attempt (``tasks/shard.py``: a Cancelled state) was replaced by the
watchdog's rerun, which is how recovery works: its own line says so at WARNING, and its end is
logged at INFO. ``install()`` adds the filter that does this to Prefect's task-run logger, once per
process; ``tasks/__init__.py`` calls it, so every process that runs one of our tasks (the flow's,
a Dask worker, the watchdog's) has it. Failed and crashed task runs stay at ERROR.
"""

from __future__ import annotations

import logging

TASK_RUN_LOGGER = "prefect.task_runs"
FENCED_END = "Finished in state Fenced("


class FencedIsInfo(logging.Filter):
    """A record saying a task run ended ``Fenced`` becomes INFO; every other record passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO and str(record.msg).startswith(FENCED_END):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def install() -> None:
    logger = logging.getLogger(TASK_RUN_LOGGER)
    if not any(isinstance(f, FencedIsInfo) for f in logger.filters):
        logger.addFilter(FencedIsInfo())
