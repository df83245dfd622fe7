"""The training flow's validation queue: every committed step validated, the newest first when behind.

``Validations(runner, url, access, params)`` is made when the rounds start; the flow calls
``submit(step)`` after each commit, ``first_failure()`` between rounds (never waits) and
``wait_all()`` at the end (also after a cancel). Contract:

* at most ``bound`` validations are in flight on ``runner`` (its workers: one process by default,
  ``flows/runners.py``); the others wait here, not in the runner's FIFO queue;
* when a validation ends, the next one starts at once (from its done callback, not at the next
  round), and it is the **newest** committed step waiting: a run that commits faster than it
  validates has its latest step validated first, then goes back for the older ones; none is
  skipped, so ``wait_all`` returns a verdict for every step submitted;
* a killed run's unvalidated steps are the next session's: a resume validates its newest committed
  step first, before it decides where to start (``flows/resume.py``, ``trainrun/resume_point.py``);
* the validation worker is warmed when the queue is made (``warm``): the process start and the
  imports of GX (measured: 12 s and 5.3 s of a 0.5-0.9 s validation on a loaded 2-core machine)
  overlap the plan, step 0 and round 1 instead of holding up step 0's validation.

``order`` records the order validations started in (for the summary and tests).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any

from ckptlib.validate import Verdict, error_verdict
from tasks.validate import ValidationFailed, validate_step
from trainrun.credentials import StoreAccess

from .runners import submit

log = logging.getLogger("flows.validations")


class Validations:
    """Validation of committed steps beside training (see the module docstring)."""

    def __init__(self, runner: Any, url: str, access: StoreAccess, params: Any, *, bound: int = 1):
        self.runner, self.url, self.access, self.bound = runner, url, access, max(1, int(bound))
        self.enabled, self.thresholds = params.validate_checkpoints, params.thresholds.to_dict()
        self.futures: dict[int, Any] = {}
        self.verdicts: dict[int, Verdict] = {}
        self.order: list[int] = []
        self._waiting: set[int] = set()
        self._ended: set[int] = set()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._ctx = contextvars.copy_context()  # the flow run's: a done callback submits from another thread
        if self.enabled:
            warm(runner)

    def submit(self, step: int) -> None:
        """``step`` was committed: validate it now if a slot is free, else as soon as one is."""
        if self.enabled:
            with self._lock:
                self._waiting.add(step)
            self._pump()

    def _pump(self) -> None:
        """Start the newest waiting steps while fewer than ``bound`` are in flight."""
        with self._lock:
            while self._waiting and len(self.futures) - len(self._ended) < self.bound:
                step = max(self._waiting)
                self._waiting.discard(step)
                fut = submit(self.runner, validate_step, run_url=self.url, step=step, access=self.access,
                             thresholds=self.thresholds)
                self.futures[step] = fut
                self.order.append(step)
                fut.add_done_callback(lambda _f, step=step: self._done(step))

    def _done(self, step: int) -> None:
        with self._lock:
            self._ended.add(step)
            self._changed.notify_all()
        try:
            self._ctx.copy().run(self._pump)
        except Exception as e:  # noqa: BLE001 - the flow's next look (first_failure, wait_all) starts it
            log.warning("the next validation after step %d did not start from its callback: %s", step, e)

    def first_failure(self) -> Verdict | None:
        """The earliest failed verdict among the validations that have ended (none is waited for)."""
        self._pump()
        with self._lock:
            ended = [s for s in self._ended if s not in self.verdicts]
        for step in ended:
            self.verdicts[step] = self._verdict(step, self.futures[step])
        failed = [v for v in self.verdicts.values() if not v.passed]
        return min(failed, key=lambda v: v.step) if failed else None

    def wait_all(self) -> dict[int, Verdict]:
        """Every submitted step's verdict (waiting ones started newest first as slots free)."""
        while True:
            self._pump()
            with self._lock:
                if not self._waiting and len(self._ended) == len(self.futures):
                    break
                self._changed.wait(timeout=0.5)  # a callback that could not start the next: pumped here
        for step, fut in self.futures.items():
            if step not in self.verdicts:
                self.verdicts[step] = self._verdict(step, fut)
        return dict(sorted(self.verdicts.items()))

    def _verdict(self, step: int, fut: Any) -> Verdict:
        try:
            return fut.result()
        except ValidationFailed as e:  # the task run is Failed; its verdict is the exception's
            return e.verdict
        except Exception as e:  # noqa: BLE001 - the store stayed unreachable, or the validator crashed: not healthy
            return error_verdict(step, self.url, e)


def warm(runner: Any) -> None:
    """Start the validation worker process now, importing what a validation imports, so the first
    validation does not pay for it (a thread runner, None, shares the flow's process: nothing)."""
    executor = getattr(runner, "_executor", None)  # ProcessPoolTaskRunner's, once entered
    if executor is None:
        return
    try:
        executor.submit(warm_worker)
    except Exception as e:  # noqa: BLE001 - warming is an optimisation
        log.warning("the validation worker was not warmed: %s", e)


def warm_worker() -> float:
    """In the validation worker: the imports of a validation (GX, its expectations, the report's
    matplotlib); the seconds they took."""
    t0 = time.perf_counter()
    import great_expectations  # noqa: F401
    import great_expectations.expectations  # noqa: F401
    import matplotlib.pyplot  # noqa: F401

    import trainrun.checks  # noqa: F401

    return time.perf_counter() - t0
