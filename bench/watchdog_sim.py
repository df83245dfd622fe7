"""The watchdog at 1,000 shards: a simulator of a run's heartbeats, and the watchdog's looks at it.

    python -m bench.watchdog_sim                         # 1,000 shards, S3 (SeaweedFS) then local
    python -m bench.watchdog_sim --shards 200 --store local --json bench-results/watchdog.json

``BeatSimulator`` writes what a training run of N shards writes for a watchdog, with the very
classes a run uses: each shard's beat is a ``ckptlib.heartbeat.Heartbeat`` (its fence check
included: one listing and one PUT per written beat), written by a pool of threads, one beat per
shard every ``every_s`` with an advancing step; the coordinator's is a ``trainrun.beats.CoordinatorBeat``
whose spec says N shards, in phase ``shards`` of the current round. ``silence(i)`` stops shard i's
beats (a hung shard); ``next_round()`` moves every shard and the coordinator on.

The measurements (``main``), each with the real ``trainrun.watchdog.Watchdog`` (fencing only):

* one look (``Watchdog.poll``): seconds and store requests (a ``RecordingStore``), at 1,000 shards;
* the same look after the run has a history: many committed steps and old rounds' fragments (the
  cost must not grow with them), and the watchdog's memory after many rounds;
* detection jitter: shards silenced one at a time; the time from their last beat to the watchdog's
  decision, minus the timeout (it must stay within 1 s: one poll interval plus one look).
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptlib.heartbeat import Heartbeat
from ckptlib.store import Store
from trainrun.beats import CoordinatorBeat
from trainrun.documents import CoordinatorInfo, Cut, ShardInfo
from trainrun.layout import shard_part
from trainrun.spec import RunSettings, RunSpec

from .common import machine, save_json, store_root, table, workdir
from .requests import RecordingStore


class BeatSimulator:
    """The heartbeats of a run of ``shards`` shards (see the module docstring). A context manager."""

    def __init__(self, store: Store, shards: int, *, every_s: float = 2.0, steps_per_round: int = 1000,
                 threads: int = 32, round: int = 1):
        self.store, self.shards, self.every_s = store, shards, every_s
        self.steps_per_round = steps_per_round
        self.spec = RunSpec(shards=shards, steps_per_round=steps_per_round)
        self.round = round
        self.silenced: dict[int, float] = {}  # shard -> wall time of its last written beat
        self.last: dict[int, float] = {}
        self.written = 0
        self._steps = [0] * shards
        self._hbs = [self._heartbeat(i) for i in range(shards)]
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sim-beat")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="sim-beats", daemon=True)
        info = CoordinatorInfo(run_id="sim", spec=self.spec, settings=RunSettings(heartbeat_every_s=every_s))
        self.coordinator = CoordinatorBeat(store, info, every_s=every_s, round_no=round)

    def _heartbeat(self, i: int) -> Heartbeat:
        meta = ShardInfo(cut=Cut.of_step(self.round - 1), config_hash=self.spec.config_hash()).to_dict()
        return Heartbeat(self.store, shard_part(i), generation=0, round=self.round,
                         steps_per_round=self.steps_per_round, every_s=self.every_s, attempt=1, meta=meta)

    def start(self) -> BeatSimulator:
        self.coordinator.start()
        self.coordinator.update(round_no=self.round, phase="shards", cut=Cut.of_step(self.round - 1))
        list(self._pool.map(self._beat, range(self.shards)))  # every shard has beaten once
        self._thread.start()
        return self

    def _beat(self, i: int) -> None:
        if i in self.silenced:
            return
        with self._lock:
            self._steps[i] += 1
            step = (self.round - 1) * self.steps_per_round + self._steps[i] % self.steps_per_round
        hb = self._hbs[i]
        written = hb.start(step=step) if hb._first_step is None else hb.beat(step=step, force=True)
        with self._lock:
            # the beat's own time, which the watchdog judges by (the write returns later: on a busy
            # machine its latency made a detection look earlier than the timeout)
            self.last[i] = written.time if written is not None else time.time()
            self.written += 1

    def _run(self) -> None:
        """Each shard beats every ``every_s``, spread evenly over the interval."""
        start = time.monotonic()
        due = [(start + self.every_s * (1 + i / self.shards), i) for i in range(self.shards)]
        heapq.heapify(due)
        while not self._stop.is_set():
            t, i = heapq.heappop(due)
            wait = t - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return
            self._pool.submit(self._beat, i)
            heapq.heappush(due, (max(t + self.every_s, time.monotonic()), i))

    def silence(self, i: int) -> float:
        """Shard ``i`` stops beating (a hang) once it has beaten in the current round (a shard that
        never beat in its round is "missing", judged by the start timeout); returns the wall time of
        its last written beat."""
        deadline = time.monotonic() + 10 * self.every_s + 10
        while self._hbs[i]._first_step is None or self._hbs[i]._beats < 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"shard {i} has not beaten twice in round {self.round}")
            time.sleep(0.01)
        with self._lock:
            self.silenced[i] = self.last.get(i, time.time())
        time.sleep(0.05)  # a beat of it already in flight lands
        with self._lock:
            self.silenced[i] = self.last.get(i, self.silenced[i])
            return self.silenced[i]

    def next_round(self) -> None:
        """Every shard starts the next round (new attempts, step 0 of the round)."""
        with self._lock:
            self.round += 1
            self._steps = [0] * self.shards
            self._hbs = [self._heartbeat(i) for i in range(self.shards)]
        self.coordinator.update(round_no=self.round, phase="shards", cut=Cut.of_step(self.round - 1))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._pool.shutdown(wait=True)
        self.coordinator.finish("finished")

    def __enter__(self) -> BeatSimulator:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def add_history(store: Store, steps: int, shards: int = 2, threads: int = 16) -> None:
    """Objects of an old run history for a watchdog to ignore: committed manifests of steps
    ``0..steps-1`` and their rounds' fragments (``shards`` per round; the simulated run must be in a
    later round). Their content does not matter: a look never reads them."""
    keys = [f"manifests/{s}.json" for s in range(steps)]
    keys += [f"fragments/{s}/{shard_part(i)}.g0.json" for s in range(steps) for i in range(shards)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda k: store.put(k, b"{}"), keys))


def watchdog(url: str, storage_options: dict | None, timeout_s: float) -> Any:
    """A ``Watchdog`` that fences only (no reruns), its store wrapped in a ``RecordingStore``."""
    from trainrun.watchdog import Watchdog

    wd = Watchdog(url, storage_options, timeout_s=timeout_s, by="watchdog-sim")
    wd.root = RecordingStore(wd.root)
    return wd


def look(wd: Any) -> dict[str, Any]:
    """One look: its seconds, requests, and the decisions it made."""
    wd.root.reset()
    t0 = time.perf_counter()
    decisions = wd.poll()
    seconds = time.perf_counter() - t0
    req = wd.root.reset()
    return {"seconds": round(seconds, 3), "requests": req.total, "by_verb": dict(req.by_verb),
            "by_folder": dict(req.by_folder), "decisions": decisions}


def detection_jitter(sim: BeatSimulator, wd: Any, *, trials: int, poll_s: float, timeout_s: float,
                     first_shard: int = 0) -> list[dict[str, Any]]:
    """Silence shards one at a time while the watchdog looks every ``poll_s``; per trial, the
    decision's latency from the last beat and its jitter (latency - timeout)."""
    out = []
    for t in range(trials):
        shard = first_shard + t
        last = sim.silence(shard)
        deadline = time.time() + timeout_s + 30
        found = None
        while found is None and time.time() < deadline:
            t0 = time.monotonic()
            for d in wd.poll():
                if d.part == shard_part(shard) and d.kind == "fenced":
                    found = d
            time.sleep(max(0.0, poll_s - (time.monotonic() - t0)))
        if found is None:
            raise AssertionError(f"shard {shard} was not fenced within {timeout_s + 30:.0f} s of its last beat")
        latency = found.detected - last
        out.append({"shard": shard, "latency_s": round(latency, 3), "jitter_s": round(latency - timeout_s, 3)})
    return out


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def run_one(kind: str, shards: int, *, every_s: float, timeout_s: float, poll_s: float, history: int,
            trials: int, rounds: int) -> dict[str, Any]:
    here = workdir(f"watchdog-{kind}")
    with store_root(kind, here) as (root, so):
        url = f"{root}/sim"
        store = Store.from_url(url, so)
        rec: dict[str, Any] = {"store": kind, "shards": shards, "beat_every_s": every_s, "timeout_s": timeout_s,
                               "poll_s": poll_s}
        t0 = time.perf_counter()
        with BeatSimulator(store, shards, every_s=every_s, round=history + 1) as sim:
            progress(f"{kind}: {shards} shards beating (first beats in {time.perf_counter() - t0:.1f} s)")
            wd = watchdog(url, so, timeout_s)
            look(wd)  # discovery (find_runs) and a first look
            looks = [look(wd) for _ in range(3)]
            rec["look_s"] = statistics.median(x["seconds"] for x in looks)
            rec["look_requests"] = looks[-1]["requests"]
            rec["look_by_verb"] = looks[-1]["by_verb"]
            rec["look_by_folder"] = looks[-1]["by_folder"]
            progress(f"{kind}: one look {rec['look_s']} s, {rec['look_requests']} requests; writing the history")
            t0 = time.perf_counter()
            add_history(store, history)
            rec["history_steps"] = history
            rec["history_write_s"] = round(time.perf_counter() - t0, 1)
            later = [look(wd) for _ in range(3)]
            rec["look_s_with_history"] = statistics.median(x["seconds"] for x in later)
            rec["look_requests_with_history"] = later[-1]["requests"]
            for _ in range(rounds):  # many rounds seen by one watchdog: its memory stays per part
                sim.next_round()
                look(wd)
            rec["memory_entries_after_rounds"] = len(wd.memory)
            rec["rounds_seen"] = rounds + 1
            rec["fenced_healthy"] = sum(1 for d in wd.decisions if d.kind == "fenced")
            progress(f"{kind}: with history {rec['look_s_with_history']} s, {rec['look_requests_with_history']} "
                     f"requests; {rec['fenced_healthy']} healthy shards fenced (beats late); detection trials")
            jit = detection_jitter(sim, wd, trials=trials, poll_s=poll_s, timeout_s=timeout_s)
            rec["jitter"] = jit
            rec["jitter_max_s"] = max(j["jitter_s"] for j in jit)
            rec["jitter_median_s"] = statistics.median(j["jitter_s"] for j in jit)
            rec["beats_written"] = sim.written
    print(f"{kind}: look {rec['look_s']} s, {rec['look_requests']} requests ({rec['look_by_verb']}); with "
          f"{history} old steps {rec['look_s_with_history']} s, {rec['look_requests_with_history']} requests; "
          f"jitter max {rec['jitter_max_s']} s", flush=True)
    return rec


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--store", choices=["s3", "local"], nargs="+", default=["s3", "local"])
    ap.add_argument("--beat-every", type=float, default=5.0, help="seconds between a shard's beats")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--poll", type=float, default=0.5)
    ap.add_argument("--history", type=int, default=2000, help="old committed steps added before the second looks")
    ap.add_argument("--rounds", type=int, default=20, help="rounds the watchdog sees go by")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    records = [run_one(kind, args.shards, every_s=args.beat_every, timeout_s=args.timeout, poll_s=args.poll,
                       history=args.history, trials=args.trials, rounds=args.rounds) for kind in args.store]
    print(f"\nmachine: {machine()}\n")
    print(table(records, [("store", "store"), ("shards", "shards"), ("look_s", "one look s"),
                          ("look_requests", "requests/look"), ("look_s_with_history", "look s, with history"),
                          ("look_requests_with_history", "requests/look, with history"),
                          ("memory_entries_after_rounds", "watchdog memory entries"),
                          ("jitter_median_s", "jitter median s"), ("jitter_max_s", "jitter max s")]))
    save_json(args.json, {"machine": machine(), "records": records})
    return records


if __name__ == "__main__":
    main()
