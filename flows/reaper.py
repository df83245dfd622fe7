"""A process of ours that ends another one when our process dies: ``python -m flows.reaper PARENT CHILD``.

``ckpt train`` starts a temporary Prefect server (``flows/api.py``) as a child process. When ``ckpt
train`` is killed (SIGKILL, out of memory), nothing stops that server: it would serve on, an orphan,
until someone finds it. The reaper is a small child process (the standard library and ``psutil``)
that waits until ``PARENT`` is no longer its parent, then terminates ``CHILD`` (SIGTERM, SIGKILL after
5 s), only if ``CHILD`` is still the very process it was given (same creation time: a recycled pid is
never signalled), and exits. When the parent stops the server itself, the reaper finds it gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

POLL_S = 0.5


def start(child_pid: int) -> subprocess.Popen:
    """A reaper of ``child_pid`` for this process (its own process group: a Ctrl-C is ours, not its)."""
    return subprocess.Popen([sys.executable, "-m", "flows.reaper", str(os.getpid()), str(child_pid)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def main(parent: int, child: int) -> int:
    import psutil

    try:
        target = psutil.Process(child)
        created = target.create_time()
    except psutil.Error:
        return 0
    while os.getppid() == parent:
        time.sleep(POLL_S)
        if not target.is_running():
            return 0  # the parent stopped it
    try:
        if target.create_time() == created:
            target.terminate()
            try:
                target.wait(5)
            except psutil.TimeoutExpired:
                target.kill()
    except psutil.Error:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
