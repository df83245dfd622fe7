"""Keep one command running: start it again, with backoff, whenever it exits (the stack's worker).

    python -m deployments.supervisor --pid-file .stack/worker.pid --log .stack/logs/supervisor.log \\
        --output .stack/logs/worker.log --name worker -- prefect worker start --pool local-pool ...

Contract:

* The command runs as this process's child, in its process group, with this process's environment
  (its secrets stay out of the command line, which every local user can read). Its output is appended
  to ``--output``; its pid is written to ``--pid-file`` at each start.
* When it exits, for whatever reason (a crash, ``kill -9``), it is started again after a delay that
  starts at ``--backoff`` seconds and doubles with each exit that follows a short life (under
  ``--stable`` seconds), up to ``--max-backoff``; a life of ``--stable`` seconds or more resets it.
  So a command that cannot start is retried slowly, never in a tight loop, and one that dies once in
  a while comes back at once.
* Each start and each exit (with its exit code or signal, how long it lived, the next delay) is a
  line in ``--log``.
* SIGTERM or SIGINT stops it: nothing more is started, the child gets SIGTERM (a Prefect worker then
  shuts down gracefully), SIGKILL after ``--grace`` seconds, and this process exits 0 once the child
  is gone. SIGKILL of this process leaves the child running (the stack then stops it by its pid file).

Why not Prefect's own: Prefect has no supervisor for a worker (``prefect worker start`` exits when
its process dies, and no server-side part starts workers), and systemd or launchd are neither on
every machine nor the stack's user's to configure. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class Supervisor:
    """Runs ``cmd`` until told to stop (see the module docstring)."""

    def __init__(self, cmd: list[str], *, name: str, pid_file: Path, log: Path, output: Path,
                 backoff: float = 1.0, max_backoff: float = 60.0, stable: float = 60.0, grace: float = 10.0):
        self.cmd, self.name, self.pid_file, self.log, self.output = cmd, name, pid_file, log, output
        self.backoff, self.max_backoff, self.stable, self.grace = backoff, max_backoff, stable, grace
        self.stopping = threading.Event()
        self.child: subprocess.Popen | None = None

    def note(self, line: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")

    def stop(self, signum: int, _frame: object = None) -> None:
        """Signal handler: start nothing more, ask the child to end."""
        self.stopping.set()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def start(self) -> subprocess.Popen:
        with open(self.output, "ab") as out:
            out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.cmd)}\n".encode())
            out.flush()
            child = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        tmp = self.pid_file.with_suffix(".tmp")
        tmp.write_text(str(child.pid))
        tmp.replace(self.pid_file)  # whole, never half written: the stack reads it any time
        self.note(f"started {self.name} (pid {child.pid})")
        return child

    def run(self) -> int:
        delay = self.backoff
        restarts = 0
        while not self.stopping.is_set():
            began = time.monotonic()
            self.child = self.start()
            if self.stopping.is_set():  # a stop that came while it started: its handler saw no child
                self.child.send_signal(signal.SIGTERM)
            code = self._wait_child()
            lived = time.monotonic() - began
            if self.stopping.is_set():
                self.note(f"{self.name} (pid {self.child.pid}) stopped: {_how(code)}")
                break
            delay = self.backoff if lived >= self.stable else delay
            restarts += 1
            self.note(f"{self.name} (pid {self.child.pid}) exited: {_how(code)} after {lived:.1f} s; "
                      f"starting it again in {delay:.1f} s (restart {restarts})")
            self.stopping.wait(delay)  # a stop cuts the wait short
            delay = min(delay * 2, self.max_backoff)
        self.pid_file.unlink(missing_ok=True)
        return 0

    def _wait_child(self) -> int:
        """The child's exit code; once a stop is asked, SIGKILL it after the grace period."""
        assert self.child is not None
        killed_at = None
        while True:
            try:
                return self.child.wait(timeout=0.5)  # short: a stop asked meanwhile is seen within it
            except subprocess.TimeoutExpired:
                if self.stopping.is_set():
                    killed_at = killed_at or time.monotonic() + self.grace
                    if time.monotonic() >= killed_at:
                        self.child.kill()


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deployments.supervisor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", default="command", help="what the log calls the command")
    ap.add_argument("--pid-file", type=Path, required=True, help="the command's current pid, written at each start")
    ap.add_argument("--log", type=Path, required=True, help="one line per start and exit")
    ap.add_argument("--output", type=Path, required=True, help="the command's output (appended)")
    ap.add_argument("--backoff", type=float, default=1.0, help="first delay before a restart, seconds")
    ap.add_argument("--max-backoff", type=float, default=60.0, help="longest delay before a restart")
    ap.add_argument("--stable", type=float, default=60.0, help="a life this long resets the delay")
    ap.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL at a stop")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command to supervise: put it after --")
    sup = Supervisor(cmd, name=a.name, pid_file=a.pid_file, log=a.log, output=a.output, backoff=a.backoff,
                     max_backoff=a.max_backoff, stable=a.stable, grace=a.grace)
    signal.signal(signal.SIGTERM, sup.stop)
    signal.signal(signal.SIGINT, sup.stop)
    sup.note(f"supervisor (pid {os.getpid()}) of {a.name}: {' '.join(cmd)}")
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
