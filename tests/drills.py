"""Chaos drills in real training runs, with the watchdog beside them: the settings and the checks
that the watchdog, recovery and rank drills share (so that no test module imports another).

The drills' watchdog timeout is 4 s. The beats' measured jitter allows 2 s for a shard's beats
(docs/watchdog.md, "Which timeout the beats allow"), and the soak uses it, but the watchdog judges
the coordinator by the same timeout, and a CI run at 2 s saw the coordinator's beat 2.1 s old at
round 1 on S3 under load: a false "run-dead". The drills assert that the watchdog decided nothing
but each struck part's fence and rerun, so they keep the margin."""

from __future__ import annotations

from ckptlib import Checkpointer
from tests.runs import EXTRA, digests

DRILL = {"workload": "tinylm", "workload_extra": EXTRA, "shards": 2, "rounds": 3, "steps_per_round": 40, "seed": 0,
         "heartbeat_every_s": 0.5, "retry_delay_s": 0.2, "validation_runner": "threads"}
TIMEOUT = 4.0
POLL = TIMEOUT / 8  # BesideWatchdog's look: timeout / 8, at least 0.2 s
# A look at the store takes time too (more on a loaded machine, more on S3): the bound is timeout +
# one poll interval + this much.
SLACK = 4.0


def params(**kw):
    """TrainParams of ``DRILL`` (tinylm of width 32, 2 shards, 3 rounds of 40 steps), overridden by ``kw``."""
    from flows.params import TrainParams

    return TrainParams(**{**DRILL, **kw})


def train_with_watchdog(p, *, timeout_s: float = TIMEOUT):
    """``train_run(p)`` with the watchdog beside it, exactly as ``ckpt train`` runs it (``BesideWatchdog``:
    the run's own spec, the start timeout of its task runner, a poll of timeout / 8; credentials, if
    any, from this process's environment). Returns (summary, the watchdog's decisions)."""
    from ckpt.beside import BesideWatchdog
    from flows.train import train_run

    wd = BesideWatchdog(p, timeout_s).start()
    try:
        summary = train_run(p)
    finally:
        wd.stop(120)
    if wd.error is not None:
        raise wd.error
    return summary, wd.decisions()


def check_run(url: str, so: dict | None, clean: dict[int, str], struck: dict[str, int] | None = None) -> None:
    """Same digests as the clean run at every step, every committed step intact, and for each struck
    (part -> round) the manifest holds the live generation's fragment, not the fenced attempt's."""
    assert digests(url, so) == clean
    with Checkpointer(url, so) as ck:
        for step in ck.steps():
            assert ck.verify(step) == [], f"step {step} does not verify"
            for part, frag in ck.manifest(step).parts.items():
                assert frag.generation <= ck.live_generation(part)
        for part, rnd in (struck or {}).items():
            live = ck.live_generation(part)
            assert live >= 1, f"{part} was never fenced"
            assert ck.manifest(rnd).parts[part].generation == live


def fenced(decisions: list[dict], part: str) -> dict:
    ds = [d for d in decisions if d["kind"] == "fenced" and d["part"] == part]
    assert len(ds) == 1, f"expected one fence of {part}, got {decisions}"
    return ds[0]


def again(decisions: list[dict], part: str) -> dict:
    ds = [d for d in decisions if d["kind"] == "running-again" and d["part"] == part]
    assert len(ds) == 1, f"expected {part} running again, got {decisions}"
    return ds[0]


def only_recoveries(decisions: list[dict], parts: set[str]) -> None:
    """No false alarm: the watchdog decided nothing but each struck part's fence and its rerun."""
    assert sorted((d["kind"], d["part"]) for d in decisions) == \
        sorted((kind, part) for part in parts for kind in ("fenced", "running-again")), decisions


def check_latency(d: dict, timeout_s: float = TIMEOUT, poll_s: float = POLL) -> None:
    assert timeout_s <= d["detection_latency_s"] <= timeout_s + poll_s + SLACK, d
    if d.get("strike_latency_s") is not None:  # measured from the true moment of the failure
        assert d["strike_latency_s"] <= timeout_s + poll_s + SLACK, d
