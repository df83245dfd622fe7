"""Rank processes forked from a launcher that imported torch once (Linux).

A rank started as ``python -m trainrun.rank_round`` spends about 1.5 CPU-seconds importing torch
before its rendezvous, and a group of R ranks pays it R times at every fresh start (the first round,
a retry, a rerun after a fence). The launcher is one process per supervising process, started with
its first group: it imports torch, torch.distributed and the rank's code once, then forks each rank
from itself, so a rank starts in milliseconds on pages it shares with the launcher::

    supervisor ---- socketpair (SOCK_SEQPACKET: one JSON document a message) ----> launcher --fork--> rank
      {"path", "cwd", "env"} + fds [the rank's stdin, its stderr]   -->
                                        <--  {"pid"} + fd [the rank's pidfd]
                                        <--  {"exited": pid, "code": c}   (the launcher reaps its ranks)

Contracts:

* A launched rank is what ``python -m trainrun.rank_round`` would be: the same stdin (its jobs),
  stderr, environment, ``sys.path``, working directory, and exit code (a signal: minus its number,
  as ``Popen.returncode``). ``LaunchedRank`` has the part of ``Popen``'s interface a group uses.
* Nothing is pickled: requests and notices are JSON; the only other things that cross the socket,
  which no other process can reach, are file descriptors.
* Lifetimes: the launcher asks the kernel for SIGKILL when the thread that started it ends
  (``PR_SET_PDEATHSIG``; it is started from the group's long-lived spawner thread, as the ranks were),
  and each rank asks the same of the launcher: a supervisor killed outright takes the launcher and
  every rank with it. The launcher ignores SIGTERM and SIGINT (a preemption signalled to the whole
  process group must reach the ranks, which checkpoint, not end their launcher, which would kill
  them) and ends when its socket closes.
* The launcher starts no thread and runs no training code, so each fork copies one quiet thread; a
  rank gets a fresh ``random`` seed (Python reseeds it after a fork) and sets its torch threads from
  its spec, as before.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

from . import rank_round
from .errors import LauncherError

# what a rank imports before its first step: imported once here, shared by every fork (FSDP2's
# module alone is 0.4 s; a user's workload module is imported by the rank itself). torch._dynamo:
# torch imports it on the first call of an optimizer's constructor or of a meta-device init (its
# decorators import it lazily), 0.9 CPU-seconds and 70 MiB that every rank paid again
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp",
           "trainrun.rank_round", "trainrun.attempt", "trainrun.shard_attempt", "ckptlib.distributed",
           "workloads.tinylm", "workloads.denselm", "workloads.recsys", "workloads.finetune", "workloads.bf16",
           "workloads.fsdp")
MAX_MESSAGE = 1 << 20  # a request: the environment, sys.path and cwd of the supervisor
START_TIMEOUT_S = 120.0  # the launcher's imports, on a loaded machine
EXIT_NOTICE_S = 10.0  # a rank that exited has its code within this (the launcher reaps it at once)


def launcher_supported() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and hasattr(socket, "send_fds")


# --- the supervisor's side -----------------------------------------------------------------------------


class LaunchedRank:
    """A rank process the launcher forked: ``pid``, ``stdin`` (its jobs), ``poll``, ``wait``,
    ``send_signal``, ``kill`` and ``returncode`` as ``subprocess.Popen`` has them. Its exit code comes
    from the launcher, which reaps it; signals go through its pidfd, so never to a recycled pid."""

    def __init__(self, launcher: RankLauncher, pid: int, pidfd: int, stdin: IO[bytes]):
        self.pid, self.stdin = pid, stdin
        self.returncode: int | None = None
        self.exit_order: int | None = None  # its place among the launcher's ranks' exits, as reaped
        self._launcher, self._pidfd = launcher, pidfd

    def poll(self) -> int | None:
        """None while it runs; once it has exited, its exit code (as ``Popen.poll``: a rank whose exit
        woke the supervisor has its code, waited for here the few milliseconds the launcher takes)."""
        if self.returncode is None:
            with self._launcher.changed:  # (held: ``wait`` closes the pidfd under it)
                if self._pidfd >= 0 and select.select([self._pidfd], [], [], 0)[0]:
                    self._launcher.changed.wait_for(lambda: self.returncode is not None, EXIT_NOTICE_S)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, once the process is gone (a rank of a launcher that died reads as killed the
        moment the launcher is gone, and is waited for here until the kernel's SIGKILL ended it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._launcher.changed:
            if not self._launcher.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
            pidfd = self._pidfd
        if pidfd >= 0:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([pidfd], [], [], left)[0]:  # readable once it exited
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
            with self._launcher.changed:
                if self._pidfd == pidfd:
                    os.close(pidfd)
                    self._pidfd = -1
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._launcher.changed:
            if self.returncode is not None or self._pidfd < 0:
                return
            signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class RankLauncher:
    """The supervisor's end of one launcher process. ``spawn`` is called from one thread (the group's
    spawner); a reader thread takes the launcher's notices. If the launcher dies, every rank it had
    is dead too (each dies with it) and reads as killed; the next ``spawn`` needs a new launcher."""

    def __init__(self, env: dict[str, str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.changed = threading.Condition()
        self.ranks: dict[int, LaunchedRank] = {}
        self.alive = True
        self._exited_early: dict[int, tuple[int, int]] = {}  # exits noticed before their spawn's reply was taken
        self.exits = 0
        self._replies: list[tuple[dict[str, Any], list[int]]] = []
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "trainrun.rank_launcher", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
        self.sock = ours
        self._reader = threading.Thread(target=self._read, name="rank-launcher-notices", daemon=True)
        self._reader.start()
        try:
            ready = self._reply(START_TIMEOUT_S)
            if "ready" not in ready[0]:
                raise LauncherError(f"the rank launcher answered {ready[0]} instead of ready")
        except BaseException:
            self.close()  # nothing of a launcher that did not start lives on
            raise

    def spawn(self, env: dict[str, str], stdin_fd: int, stderr_fd: int) -> tuple[int, int]:
        """Fork a rank with ``stdin_fd`` and ``stderr_fd`` (this process keeps its own copies); its pid
        and pidfd."""
        request = {"path": [p for p in sys.path if p], "cwd": os.getcwd(), "env": env}
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], [stdin_fd, stderr_fd])
        except OSError as e:
            raise LauncherError(f"the rank launcher (pid {self.process.pid}) is gone: {e}") from e
        doc, fds = self._reply(30.0)
        if "pid" not in doc or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise LauncherError(f"the rank launcher could not start a rank: {doc.get('error', doc)}")
        return int(doc["pid"]), fds[0]

    def launch(self, env: dict[str, str], stderr_fd: int) -> LaunchedRank:
        """A rank with a fresh pipe on its stdin (its write end: ``LaunchedRank.stdin``)."""
        r, w = os.pipe()
        try:
            pid, pidfd = self.spawn(env, r, stderr_fd)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        rank = LaunchedRank(self, pid, pidfd, open(w, "wb"))  # noqa: SIM115 - the rank's stdin, open while it lives
        with self.changed:
            if pid in self._exited_early:
                rank.returncode, rank.exit_order = self._exited_early.pop(pid)
            else:
                self.ranks[pid] = rank
        return rank

    def _reply(self, timeout: float) -> tuple[dict[str, Any], list[int]]:
        with self.changed:
            if not self.changed.wait_for(lambda: self._replies or not self.alive, timeout):
                raise LauncherError(f"the rank launcher (pid {self.process.pid}) did not answer within {timeout:.0f} s")
            if not self._replies:
                raise LauncherError(f"the rank launcher (pid {self.process.pid}) ended "
                                    f"(exit code {self.process.poll()}); its stderr says why")
            return self._replies.pop(0)

    def _read(self) -> None:
        try:
            while True:
                msg, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
                if not msg:
                    return
                doc = json.loads(msg)
                with self.changed:
                    if "exited" in doc:
                        pid, code = int(doc["exited"]), int(doc["code"])
                        self.exits += 1
                        rank = self.ranks.pop(pid, None)
                        if rank is not None:
                            rank.returncode, rank.exit_order = code, self.exits
                        else:
                            self._exited_early[pid] = (code, self.exits)
                    else:
                        self._replies.append((doc, fds))
                    self.changed.notify_all()
        except OSError:
            return
        finally:
            with self.changed:
                self.alive = False
                for rank in self.ranks.values():  # each died with the launcher (PR_SET_PDEATHSIG)
                    rank.returncode = -signal.SIGKILL
                self.ranks.clear()
                self.changed.notify_all()

    def close(self) -> None:
        """End the launcher (its ranks die with it) and wait for it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(5)
        self.sock.close()


_LAUNCHER: RankLauncher | None = None


def launch_rank(env: dict[str, str], stderr_fd: int) -> LaunchedRank:
    """A rank from this process's launcher (started at the first call, or again if it died). Call
    from one long-lived thread: the launcher dies with the thread that started it."""
    global _LAUNCHER
    if _LAUNCHER is not None and not _LAUNCHER.alive:
        _LAUNCHER.close()
        _LAUNCHER = None
    if _LAUNCHER is None:
        _LAUNCHER = RankLauncher(env)
    return _LAUNCHER.launch(env, stderr_fd)


# --- the launcher's side -------------------------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """Answer each request with a forked rank; report each rank's exit; return at EOF."""
    watched: dict[int, int] = {}  # pidfd -> pid
    while True:
        readable, _, _ = select.select([sock.fileno(), *watched], [], [])
        for fd in readable:
            if fd == sock.fileno():
                msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
                if not msg:
                    return
                try:
                    pid, pidfd = fork_rank(sock, watched, json.loads(msg), fds)
                except Exception as e:  # noqa: BLE001 - said to the supervisor, which raises it
                    sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
                    continue
                finally:
                    for f in fds:
                        os.close(f)
                watched[pidfd] = pid
                socket.send_fds(sock, [json.dumps({"pid": pid}).encode()], [pidfd])
            else:
                pid = watched.pop(fd)
                _, status = os.waitpid(pid, 0)
                os.close(fd)
                sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def fork_rank(sock: socket.socket, watched: dict[int, int], request: dict[str, Any], fds: list[int]) -> tuple[int, int]:
    if len(fds) != 2:
        raise ValueError(f"a request carries the rank's stdin and stderr, not {len(fds)} descriptors")
    launcher_pid = os.getpid()
    pid = os.fork()
    if pid == 0:  # the rank: nothing of the launcher's but its imports
        code = 1
        try:
            code = become_rank(launcher_pid, sock, watched, request, fds)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - as an uncaught exception ends a process
            import traceback

            traceback.print_exc()
        finally:
            rank_round.leave_at_once(code)  # never back into the launcher's loop
    return pid, os.pidfd_open(pid)


def become_rank(launcher_pid: int, sock: socket.socket, watched: dict[int, int], request: dict[str, Any],
                fds: list[int]) -> int:
    """In the forked child: the rank's standard streams, environment, path and signals, then its main.
    It keeps none of the launcher's descriptors (its socket, its other ranks' pidfds)."""
    rank_round.die_with(launcher_pid)
    os.close(sock.detach())
    for pidfd in watched:
        os.close(pidfd)
    stdin_fd, stderr_fd = fds
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd, std in ((stdin_fd, 0), (devnull, 1), (stderr_fd, 2)):
        os.dup2(fd, std)
        os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = list(request["path"])
    importlib.invalidate_caches()  # files written since the launcher started (a user's workload)
    sys.argv = [rank_round.__file__]
    return int(rank_round.main(parent_pid=launcher_pid))


def main() -> int:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    rank_round.die_with(parent_pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a signal to the process group is the ranks'
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        importlib.import_module(name)
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
