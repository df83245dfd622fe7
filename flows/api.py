"""The Prefect API a local run talks to: the configured server, or a temporary one started here.

Prefect starts an ephemeral server by itself when ``PREFECT_API_URL`` is unset, but only for the
process that asks: a Dask worker or a process-pool worker would each start another one. So a local
run (``ckpt train``, ``python -m flows.train``) starts the temporary server once, up front, and
exports its URL (environment and settings), which every child process inherits.

    api = PrefectAPI()          # starts the server in the background (if one is needed)
    ...                         # other start-up work meanwhile
    with api.use():             # waits until it answers; flows run against it inside
        train_run(params)
    api.stop()                  # (also done by use() on exit)

Should this process be killed, a reaper (``flows/reaper.py``) stops the temporary server.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class PrefectAPI:
    def __init__(self, startup_timeout_s: int = 120):
        from prefect.settings import PREFECT_API_URL

        self.url: str | None = PREFECT_API_URL.value() or None
        self.server = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._reaper: Any = None
        if self.url is None:
            from prefect.server.api.server import SubprocessASGIServer

            self.server = SubprocessASGIServer()
            self._thread = threading.Thread(target=self._start, args=(startup_timeout_s,), daemon=True,
                                            name="prefect-api-start")
            self._thread.start()

    def _start(self, timeout_s: int) -> None:
        try:
            self.server.start(timeout=timeout_s)
            process = getattr(self.server, "server_process", None)
            if process is not None:  # killed, this process could not stop it: a reaper does (flows/reaper.py)
                from . import reaper

                self._reaper = reaper.start(process.pid)
        except BaseException as e:  # noqa: BLE001 - re-raised by use()
            self._error = e

    @contextmanager
    def use(self) -> Iterator[str]:
        """Wait for the API and make it this process's (and its children's) Prefect API."""
        if self.server is None:
            yield self.url
            return
        from prefect.settings import PREFECT_API_URL, temporary_settings

        self._thread.join()
        if self._error is not None:
            self.stop()
            raise RuntimeError(f"the temporary Prefect server did not start ({self._error}); start one with "
                               "`prefect server start` and export PREFECT_API_URL=http://127.0.0.1:4200/api") \
                from self._error
        previous = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = self.server.api_url
        try:
            with temporary_settings({PREFECT_API_URL: self.server.api_url}):
                try:
                    yield self.server.api_url
                finally:
                    _drain_prefect_workers()  # queued logs and events go out while the server is up
        finally:
            if previous is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = previous
            self.stop()

    def stop(self) -> None:
        if self.server is not None:
            if self._thread is not None:
                self._thread.join()
            self.server.stop()
            self.server = None
        if self._reaper is not None:
            self._reaper.wait(10)  # it sees the server gone within its poll
            self._reaper = None


@contextmanager
def prefect_api(startup_timeout_s: int = 120) -> Iterator[str]:
    """Yield the API URL: ``PREFECT_API_URL`` if set, else a temporary local server (stopped on exit)."""
    api = PrefectAPI(startup_timeout_s)
    try:
        with api.use() as url:
            yield url
    finally:
        api.stop()


def _drain_prefect_workers(timeout_s: float = 10.0) -> None:
    """Send what Prefect's background workers still hold (otherwise they retry a stopped server at exit)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - best effort: a lost log line must not fail a finished run
            pass
