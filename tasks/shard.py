"""Prefect task: one shard's round (load the last cut, train H steps, heartbeat, write its fragment).

Thin: the work is ``tasks.rounds.train_shard_round``; this adds Prefect's retries, the attempt
number (``run_count``) and, optionally, heartbeats as Prefect events. Inputs and result are small
JSON values; the state travels through the store only.

A retry (after an exception, e.g. ``--chaos crash:...``) starts again from the same cut and, training
being deterministic, writes the same fragment. An attempt that finds itself fenced (the watchdog
declared it dead and started a newer generation) stops and returns ``status: "fenced"`` instead of
failing: the live generation owns the shard and the coordinator takes only its fragment.
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

DEFAULT_RETRIES = 2
DEFAULT_RETRY_DELAY_S = 1.0


EVENT_EVERY_S = 5.0  # at most one ckpt.shard.heartbeat event per shard attempt this often


def _event_forwarder(run_url: str, part: str, every_s: float = EVENT_EVERY_S):
    """Heartbeats as Prefect events (resource ``ckpt.shard.<run>.<part>``): the first beat and then
    at most one ``ckpt.shard.heartbeat`` every ``every_s`` seconds; every final status
    (``ckpt.shard.finished`` / ``failed`` / ``fenced``) at once. A proactive automation
    (``deployments/deploy.py``) starts the watchdog deployment when they stop."""
    import time

    from prefect.events import emit_event

    run = run_url.rstrip("/").rsplit("/", 1)[-1]
    last = [float("-inf")]

    def forward(doc: dict) -> None:
        running = doc["status"] == "running"
        now = time.monotonic()
        if running and now - last[0] < every_s:
            return
        last[0] = now
        emit_event(event="ckpt.shard.heartbeat" if running else f"ckpt.shard.{doc['status']}",
                   resource={"prefect.resource.id": f"ckpt.shard.{run}.{part}", "ckpt.run-id": run,
                             "ckpt.part": part},
                   payload={k: doc.get(k) for k in ("round", "step", "round_step", "generation", "attempt", "loss")})

    return forward


@task(name="train-shard", task_run_name="shard-{shard}-round-{round}", retries=DEFAULT_RETRIES,
      retry_delay_seconds=DEFAULT_RETRY_DELAY_S, cache_policy=NO_CACHE)
def train_shard(run_url: str, spec: dict, shard: int, round: int, source: dict,
                storage_options: dict | None = None, keyframe_every: int = 32, chaos: list[str] | None = None,
                heartbeat_every_s: float = 2.0, heartbeat_events: bool = False, attempt_offset: int = 0) -> dict:
    """Train shard ``shard`` for round ``round`` from the cut ``source``; write fragment ``round``.

    ``attempt_offset``: attempts made before this task run (the watchdog's rerun of a dead attempt
    passes that attempt's number, so the rerun is attempt n+1 and chaos aimed at attempt n does
    not strike again)."""
    from prefect.runtime import task_run

    from ckptlib import Checkpointer, FencedError

    from .chaos import for_attempt
    from .rounds import RunSpec, shard_part, train_shard_round

    logger = get_run_logger()
    attempt = int(attempt_offset) + max(1, int(task_run.run_count or 1))
    run_spec = RunSpec.from_dict(spec)
    part = shard_part(shard)
    ck = Checkpointer(run_url, storage_options, keyframe_every=keyframe_every)
    try:
        result = train_shard_round(
            ck, run_spec, shard, round, source, attempt=attempt,
            chaos=for_attempt(chaos, shard, round, attempt), heartbeat_every_s=heartbeat_every_s,
            on_beat=_event_forwarder(run_url, part, max(EVENT_EVERY_S, heartbeat_every_s)) if heartbeat_events else None)
    except FencedError as e:
        logger.warning("%s round %d: %s", part, round, e)
        return {"shard": shard, "round": round, "part": part, "status": "fenced", "attempt": attempt,
                "error": str(e)}
    finally:
        ck.close()
    logger.info("%s round %d: loss %.4f, fragment %d B written of %d B (%.1fx), %.1f s",
                part, round, result["loss"], result["bytes_written"], result["logical_bytes"],
                result["logical_bytes"] / max(result["bytes_written"], 1), result["seconds"]["total"])
    return result
