"""Leases live as long as their holder (ckptlib/leases.py): renewed by the holder's own thread, so a
killed save blocks GC for one time to live (30 s by default), not an hour, and a live save that
takes longer than its time to live keeps what it needs. A lease whose renewals came late may have
been seen expired: the save then checks what it needs before it publishes.

Before, a lease lived an hour from its last renewal (renewed only as uploads progressed): under one
failure a minute, GC never swept an object."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from ckptlib import Checkpointer, RetentionPolicy
from ckptlib.leases import DEFAULT_LEASE_TTL_S, Lease, live_leases
from ckptlib.store import Store
from ckptlib.testing.faulty import FaultyStore

ORPHAN = "chunks/ab/" + "ab" * 16  # an object no committed step names: GC sweeps it when nothing stops it


def test_the_default_lease_lets_gc_sweep_within_a_minute_of_a_kill():
    assert DEFAULT_LEASE_TTL_S <= 30


def _holder(url: str, ttl_s: float) -> subprocess.Popen:
    """A process holding a save lease (as a save in flight does) and an object it wrote, forever."""
    code = textwrap.dedent(f"""
        import time
        from ckptlib import leases
        from ckptlib.store import Store
        leases.DEFAULT_LEASE_TTL_S = {ttl_s}
        store = Store.from_url({url!r})
        lease = leases.Lease(store, "save", None).acquire()
        store.put({ORPHAN!r}, b"a chunk of a save in flight")
        print("ready", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_live_save_keeps_its_lease_past_its_ttl_and_a_killed_one_lets_gc_sweep(tmp_path):
    url = str(tmp_path / "run")
    with Checkpointer(url, chunk_bytes=4096) as ck:
        ck.save(1, {"w": list(range(10))})
        store = Store.from_url(url)
        proc = _holder(url, ttl_s=1.0)
        try:
            time.sleep(3.0)  # three times its time to live: alive, so renewed
            assert len(live_leases(store)) == 1
            report = ck.gc(RetentionPolicy(keep_last=1), grace_s=0, wait_s=0)
            assert report.deferred and "a save is in flight" in report.deferred
            assert store.exists(ORPHAN)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        killed = time.monotonic()
        while store.exists(ORPHAN) and time.monotonic() - killed < 10:
            report = ck.gc(RetentionPolicy(keep_last=1), grace_s=0, wait_s=0)
            time.sleep(0.2)
        assert not store.exists(ORPHAN), "GC never swept the object of a killed save"
        assert time.monotonic() - killed < 1.0 + 3.0  # its time to live, and the GC's own passes
        assert ck.restore(1) == {"w": list(range(10))}


def test_a_lease_whose_renewals_came_late_checks_what_it_needs_before_publishing(tmp_path):
    url = str(tmp_path / "run")
    with Checkpointer(url, chunk_bytes=4096) as ck:
        ck.save(1, {"w": list(range(10))})
    store = Store.from_url(url)
    faulty = FaultyStore(store)
    saved = b"a chunk this save found stored already"
    store.put(ORPHAN, saved)
    lease = Lease(faulty, "save", 1, ttl_s=0.3).acquire()
    try:
        faulty.fail_on("put", "leases/*")  # the store refuses its renewals for a while: it expires
        time.sleep(0.6)
        assert live_leases(store) == []
        report = Checkpointer(url).gc(RetentionPolicy(keep_last=1), grace_s=0, wait_s=0)
        assert ORPHAN in report.deleted_objects  # swept: no live lease protected it
        faulty.reset()
        missing = lease.before_publish([ORPHAN], {ORPHAN: saved})
        assert missing == []
        assert store.get(ORPHAN) == saved  # written back before the save publishes
        assert len(live_leases(store)) == 1
    finally:
        lease.release()
    assert live_leases(store) == []
