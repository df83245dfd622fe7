"""Prefect task ``train-shard``: one shard's round (``trainrun.rounds.train_shard_round``).

Adds Prefect's retries (``loud_failure``: a crash or a lost worker is retried from the same cut and,
training being deterministic, writes the same fragment), the attempt number (``run_count``) and,
optionally, heartbeats as Prefect events. An attempt that finds itself fenced returns
``status: "fenced"`` instead of failing: the live generation owns the shard.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptlib import Checkpointer, FencedError
from ckptlib.heartbeat import Beat
from ckptlib.writer import DEFAULT_KEYFRAME_EVERY
from trainrun.chaos import for_attempt
from trainrun.credentials import StoreAccess
from trainrun.layout import run_name, shard_part
from trainrun.rounds import Cut, train_shard_round
from trainrun.spec import RunSettings, RunSpec

from .access import storage_options
from .retry import loud_failure

EVENT_EVERY_S = 5.0  # at most one ckpt.shard.heartbeat event per shard attempt this often
_DEFAULTS = RunSettings()


def event_forwarder(run_url: str, part: str, every_s: float = EVENT_EVERY_S) -> Callable[[Beat], None]:
    """Heartbeats as Prefect events (resource ``ckpt.shard.<run>.<part>``): the first beat and then
    at most one ``ckpt.shard.heartbeat`` every ``every_s`` seconds; every final status at once. A
    proactive automation (``deployments/deploy.py``) starts the watchdog deployment when they stop."""
    from prefect.events import emit_event

    run = run_name(run_url)
    last = [float("-inf")]

    def forward(beat: Beat) -> None:
        running = beat.status == "running"
        now = time.monotonic()
        if running and now - last[0] < every_s:
            return
        last[0] = now
        emit_event(event="ckpt.shard.heartbeat" if running else f"ckpt.shard.{beat.status}",
                   resource={"prefect.resource.id": f"ckpt.shard.{run}.{part}", "ckpt.run-id": run, "ckpt.part": part},
                   payload={"round": beat.round, "step": beat.step, "round_step": beat.round_step,
                            "generation": beat.generation, "attempt": beat.attempt, "loss": beat.loss})

    return forward


@task(name="train-shard", task_run_name="shard-{shard}-round-{round}", retries=_DEFAULTS.shard_retries,
      retry_delay_seconds=_DEFAULTS.retry_delay_s, retry_condition_fn=loud_failure, cache_policy=NO_CACHE)
def train_shard(run_url: str, spec: RunSpec, shard: int, round: int, cut: Cut, access: StoreAccess | None = None,
                keyframe_every: int = DEFAULT_KEYFRAME_EVERY, chaos: list[str] | None = None,
                heartbeat_every_s: float = _DEFAULTS.heartbeat_every_s, heartbeat_events: bool = False,
                attempt_offset: int = 0) -> dict:
    """Train shard ``shard`` for round ``round`` from ``cut``; write fragment ``round``.

    ``attempt_offset``: attempts made before this task run (the watchdog's rerun of a dead attempt
    passes that attempt's number, so the rerun is attempt n+1 and chaos aimed at attempt n does
    not strike again)."""
    from prefect.runtime import task_run

    logger = get_run_logger()
    attempt = int(attempt_offset) + max(1, int(task_run.run_count or 1))
    part = shard_part(shard)
    forward = event_forwarder(run_url, part, max(EVENT_EVERY_S, heartbeat_every_s)) if heartbeat_events else None
    ck = Checkpointer(run_url, storage_options(access), keyframe_every=keyframe_every)
    try:
        result = train_shard_round(ck, spec, shard, round, cut, attempt=attempt,
                                   chaos=for_attempt(chaos, shard, round, attempt),
                                   heartbeat_every_s=heartbeat_every_s, on_beat=forward)
    except FencedError as e:
        logger.warning("%s round %d: %s", part, round, e)
        return {"shard": shard, "round": round, "part": part, "status": "fenced", "attempt": attempt, "error": str(e)}
    finally:
        ck.close()
    logger.info("%s round %d: loss %.4f, fragment %d B written of %d B (%.1fx), %.1f s", part, round, result["loss"],
                result["bytes_written"], result["logical_bytes"],
                result["logical_bytes"] / max(result["bytes_written"], 1), result["seconds"]["total"])
    return result
