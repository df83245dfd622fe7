"""What the benchmark reads of this process and of the disk (peak and current RSS, bytes under a
directory) and what it resets before a measurement (freed heap pages, cached file pages).

Peak RSS: on Linux, before each save the kernel's high-water mark is reset
(``echo 5 > /proc/self/clear_refs``) and ``VmHWM`` is read from ``/proc/self/status`` once the save
is durable: the exact peak of this process over the save, no sampling. Where the reset is not
available, a thread samples ``VmRSS`` every millisecond (``PeakRss.method`` says which).
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading


def _proc_status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    kib = _proc_status_kib("VmRSS")
    return None if kib is None else kib * 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_reset_works() -> bool:
    if not _reset_hwm():
        return False
    hwm, rss = _proc_status_kib("VmHWM"), _proc_status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 1024  # within 1 MiB of the current RSS


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS baselines mean something."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRss:
    """Peak RSS of this process over a ``with`` block (see the module docstring for the method)."""

    method: str = "unavailable"

    def __init__(self) -> None:
        if PeakRss.method == "unavailable" and os.path.exists("/proc/self/status"):
            PeakRss.method = "vmhwm-reset" if _hwm_reset_works() else "sampling-1ms"
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        if self.method == "vmhwm-reset":
            _reset_hwm()
        elif self.method == "sampling-1ms":
            self.peak = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            r = rss_bytes()
            if r is not None and (self.peak is None or r > self.peak):
                self.peak = r

    def __exit__(self, *exc) -> None:
        if self.method == "vmhwm-reset":
            kib = _proc_status_kib("VmHWM")
            self.peak = None if kib is None else kib * 1024
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            r = rss_bytes()
            if r is not None and (self.peak is None or r > self.peak):
                self.peak = r


def dir_bytes(root: str, skip: tuple[str, ...] = ()) -> int:
    """Bytes of every file under ``root`` (a file deleted meanwhile counts 0), but for the folders
    ``skip`` names directly under it."""
    total = 0
    for folder, dirs, files in os.walk(root):
        if folder == root:
            dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:
                pass
    return total


def evict_page_cache(root: str) -> None:
    """Drop the cached pages of every (fsynced, hence clean) file under ``root``: a cold restore."""
    if not hasattr(os, "posix_fadvise"):
        return
    for folder, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
