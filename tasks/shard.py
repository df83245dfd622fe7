"""Prefect task ``train-shard``: one shard's round (``trainrun.shard_round.train_shard_round``, or
with ``ranks_per_shard`` > 1 a group of rank processes, ``trainrun.rank_group.train_shard_group``).

Adds Prefect's retries (``loud_failure``: a crash or a lost worker is retried; the retry continues
from the shard's newest checkpoint of the round, else the cut, and, training being deterministic,
writes the same fragment), the attempt number (``run_count``), a progress artifact (the shard's step
within its round and its newest shard checkpoint, updated with the heartbeats), the local tier of
shard checkpoints on this host, and, optionally, heartbeats as Prefect events. An attempt that finds itself fenced ends in a ``Cancelled`` state named
``Fenced`` (its data: ``status: "fenced"``) whose message says who fenced it, why, and which rerun
took over, with a markdown artifact linking the watchdog's flow run: the training run's graph shows
what happened to the shard instead of a green Completed task. An attempt stopped by a preemption or a
cancel (``trainrun.preemption``: its state checkpointed) ends ``Completed`` named ``Preempted`` (data:
``status: "preempted"``, the step its checkpoint holds; Prefect would log any other final state as an
ERROR); on a SIGTERM it first waits for its process to end, so that the task counts as lost with it
and is rerun.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled, Completed, State

from ckptlib import Checkpointer, FencedError, commit
from ckptlib.documents import Document
from ckptlib.encoding import DEFAULT_KEYFRAME_EVERY
from ckptlib.errors import StoreError
from ckptlib.heartbeat import Beat, read_heartbeat
from ckptlib.store import Store
from trainrun import preemption
from trainrun.chaos import for_attempt
from trainrun.credentials import StoreAccess
from trainrun.documents import Cut
from trainrun.errors import Preempted
from trainrun.layout import COORDINATOR, run_name, shard_index, shard_part
from trainrun.recovery import Failure
from trainrun.results import ShardResult
from trainrun.spec import RunSettings, RunSpec
from trainrun.watchdog.decisions import read_fence

from .access import storage_options
from .links import flow_run_url
from .retry import loud_failure

EVENT_EVERY_S = 5.0  # at most one ckpt.shard.heartbeat event per shard attempt this often
PROGRESS_EVERY_S = 2.0  # at most one progress artifact update per shard attempt this often
_DEFAULTS = RunSettings()
FAILED, LEFT_OUT = "failed", "left-out"
_MARK_KEY = re.compile(r"^quorum/(\d+)/(shard-\d+)\.(failed|left-out)\.json$")


# --- quorum marks: what the train flow's quorum mode sees of a shard while its task is still pending ----

@dataclass(frozen=True)
class QuorumMark(Document):
    """``quorum/<round>/<part>.failed.json``: an attempt of the shard failed in the round (written by
    the task, put-if-absent, before Prefect retries it); ``.left-out.json``: the round was cut
    without the shard (written by the train flow before it fences the shard). Read as keys only:
    the flow lists them, the task asks whether one exists."""

    KIND = "quorum mark"
    MAX_BYTES = 16 << 10

    part: str
    round: int
    what: str
    generation: int
    reason: str
    time: float
    attempt: int | None = None


def mark_key(round_no: int, part: str, what: str) -> str:
    return f"quorum/{round_no}/{part}.{what}.json"


def mark(store: Store, part: str, round_no: int, what: str, *, generation: int, reason: str,
         attempt: int | None = None) -> None:
    """Write ``what`` (``FAILED`` | ``LEFT_OUT``) for ``part``'s round ``round_no`` (once: put-if-absent)."""
    doc = QuorumMark(part=part, round=round_no, what=what, generation=generation, reason=reason[:2000],
                     time=time.time(), attempt=attempt)
    store.put_if_absent(mark_key(round_no, part, what), doc.to_json())


def marked(store: Store, round_no: int, what: str) -> set[int]:
    """The shards with a ``what`` mark for round ``round_no`` (one listing)."""
    found = set()
    for key in store.list(f"quorum/{round_no}/"):
        m = _MARK_KEY.match(key)
        if m and int(m.group(1)) == round_no and m.group(3) == what and (i := shard_index(m.group(2))) is not None:
            found.add(i)
    return found


def _mark_failed(store: Store, part: str, round_no: int, attempt: int, generation: int, reason: str) -> None:
    """A failed attempt says so at once (the quorum flow stops waiting for the shard); a mark that
    cannot be written is logged: the flow then sees the failure by the retry's attempt number."""
    try:
        mark(store, part, round_no, FAILED, generation=generation, reason=reason, attempt=attempt)
    except StoreError as e:
        get_run_logger().warning("%s round %d: failed attempt %d not marked: %s", part, round_no, attempt, e)


def _left_out(store: Store, part: str, round_no: int) -> bool:
    return store.exists(mark_key(round_no, part, LEFT_OUT))


def _mark_earlier_failure(store: Store, part: str, round_no: int, cut: Cut) -> None:
    """Mark the failure of an earlier attempt of this round, as the attempt will recognise it
    (``trainrun.recovery``: it raised, its process died, a watchdog fenced it), read before its
    first beat: how a crash seen only at exit (a killed Dask worker) reaches the marks."""
    try:
        prior = read_heartbeat(store, part)
        if prior is None or prior.round != round_no or prior.status == "finished":
            return
        live = commit.live_generation(store, part)
        fence = commit.read_fence(store, part, live) if live > 0 else None
        failure = Failure.recognise(store, prior, read_heartbeat(store, COORDINATOR), round_no=round_no,
                                    cut_step=cut.step, generation=live, fence=fence)
    except Exception as e:  # noqa: BLE001 - a report for the quorum flow: never a reason not to train
        get_run_logger().warning("%s round %d: cannot tell whether an earlier attempt failed: %s", part, round_no, e)
        return
    if failure is not None:
        _mark_failed(store, part, round_no, prior.attempt or 0, prior.generation, failure.kind)


def left_out_state(shard: int, round_no: int, attempt: int) -> State:
    """``Cancelled(name="Left out")``: the round was cut without this shard (quorum mode); it rejoins
    at the next round, from the new global model."""
    part = shard_part(shard)
    return Cancelled(name="Left out", message=f"{part} round {round_no}: left out of the round's quorum cut (an "
                     f"attempt failed); it rejoins at round {round_no + 1}",
                     data={"shard": shard, "round": round_no, "part": part, "status": "fenced", "attempt": attempt})


def progress_reporter(part: str, round_no: int) -> Callable[[Beat], None]:
    """A Prefect progress artifact of this task run: the shard's step within its round (as a
    percentage and in its description, with its newest shard checkpoint), updated from the
    heartbeats (at most every ``PROGRESS_EVERY_S``; the UI's Artifacts tab shows it live)."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    artifact_id = create_progress_artifact(0.0, description=f"{part}: round {round_no}, loading")
    last = [float("-inf")]

    def report(beat: Beat) -> None:
        now = time.monotonic()
        if beat.round_step is None or not beat.steps_per_round or (now - last[0] < PROGRESS_EVERY_S
                                                                    and beat.status == "running"):
            return
        last[0] = now
        update_progress_artifact(artifact_id, 100.0 * beat.round_step / beat.steps_per_round,
                                 description=progress_text(beat))

    return report


def progress_text(beat: Beat) -> str:
    """``shard-1: round 3, step 120/150 (checkpoint at 100), attempt 2, generation 1``."""
    ckpt = beat.meta.get("checkpoint_step") if isinstance(beat.meta, dict) else None
    text = f"{beat.part}: round {beat.round}, step {beat.round_step}/{beat.steps_per_round}"
    text += f" (checkpoint at {ckpt})" if ckpt is not None else ""
    text += f", attempt {beat.attempt}" if beat.attempt and beat.attempt > 1 else ""
    text += f", generation {beat.generation}" if beat.generation else ""
    return text + ("" if beat.status == "running" else f": {beat.status}")


def _both(*callbacks: Callable[[Beat], None] | None) -> Callable[[Beat], None]:
    live = [c for c in callbacks if c is not None]

    def call(beat: Beat) -> None:
        for c in live:
            try:
                c(beat)
            except Exception as e:  # noqa: BLE001 - what the UI shows must never stop training
                get_run_logger().debug("heartbeat callback failed: %s", e)

    return call


def rerun_name(shard: int, round_no: int, generation: int) -> str:
    """The task run name of the watchdog's rerun of ``shard``'s round as ``generation``."""
    return f"rerun-shard-{shard}-round-{round_no}-g{generation}"


def fenced_state(ck: Checkpointer, shard: int, round_no: int, attempt: int, error: FencedError) -> State:
    """``Cancelled(name="Fenced")``: this attempt was fenced; the message says by whom and why, and a
    markdown artifact links the watchdog's flow run and names the rerun that took over."""
    from prefect.artifacts import create_markdown_artifact

    from ckptlib.commit import live_generation

    part = shard_part(shard)
    live = live_generation(ck.store, part)
    fence = read_fence(ck.store, part, live)
    rerun = rerun_name(shard, round_no, live)
    why = fence.reason if fence is not None and fence.reason else str(error)
    by = fence.by if fence is not None and fence.by else "a watchdog"
    link = flow_run_url(fence.by_flow_run_id) if fence is not None else None
    message = f"fenced by {by}: {why}; generation {live} reruns the round ({rerun})"
    rows = [("what", f"{part} round {round_no}, attempt {attempt}: **fenced**, stopped"), ("why", why),
            ("by", f"[{by}]({link})" if link else by), ("rerun", f"`{rerun}` (generation {live}), a task run "
                                                               "of the watchdog's flow run"),
            ("fence", f"`{ck.url}/fences/{part}/{live}`")]
    try:
        create_markdown_artifact("## Fenced by the watchdog\n\n| | |\n|---|---|\n" +
                                 "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows) + "\n",
                                 description=f"{part} round {round_no} fenced and rerun")
    except Exception as e:  # noqa: BLE001 - the state says it anyway
        get_run_logger().debug("fence artifact not created: %s", e)
    return Cancelled(name="Fenced", message=message,
                     data={"shard": shard, "round": round_no, "part": part, "status": "fenced",
                           "attempt": attempt, "live_generation": live, "error": str(error)})


def wait_for_the_end() -> None:
    """A preempted process ends once its last loop stopped (``trainrun.preemption``): the task
    reports nothing meanwhile, so that whoever runs it (Dask, a runner, ``ckpt train --resume``)
    treats it as lost with its process and runs it again, from its checkpoint."""
    from trainrun import preemption

    time.sleep(preemption.grace_s() + 5.0)


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


@task(name="train-shard", task_run_name="shard-{shard}-round-{round_no}", retries=_DEFAULTS.shard_retries,
      retry_delay_seconds=_DEFAULTS.retry_delay_s, retry_condition_fn=loud_failure, cache_policy=NO_CACHE)
def train_shard(run_url: str, spec: RunSpec, shard: int, round_no: int, cut: Cut, access: StoreAccess | None = None,
                keyframe_every: int = DEFAULT_KEYFRAME_EVERY, chaos: list[str] | None = None,
                heartbeat_every_s: float = _DEFAULTS.heartbeat_every_s, heartbeat_events: bool = False,
                attempt_offset: int = 0, shard_checkpoint_every: int | str = _DEFAULTS.shard_checkpoint_every,
                local_tier: bool = _DEFAULTS.local_tier, quorum: bool = False) -> ShardResult:
    """Train shard ``shard`` for round ``round_no`` from ``cut`` (or from its newest shard checkpoint
    of the round); write its fragment of step ``round_no``.

    ``attempt_offset``: attempts made before this task run (the watchdog's rerun of a dead attempt
    passes that attempt's number, so the rerun is attempt n+1 and chaos aimed at attempt n does
    not strike again). ``shard_checkpoint_every``, ``local_tier``: the run's settings
    (``trainrun.spec.RunSettings``)."""
    from prefect.runtime import task_run

    # torch is imported where a shard trains, not with this module: the watchdog flow imports it to
    # rerun shards and most of its looks rerun nothing (flows.watchdog then loads no torch)
    from trainrun.local_tier import LocalTier
    from trainrun.shard_round import train_shard_round

    logger = get_run_logger()
    attempt = int(attempt_offset) + max(1, int(task_run.run_count or 1))
    part = shard_part(shard)
    forward = event_forwarder(run_url, part, max(EVENT_EVERY_S, heartbeat_every_s)) if heartbeat_events else None
    options = storage_options(access)
    ck = Checkpointer(run_url, options, keyframe_every=keyframe_every)
    # a stop of the run reaches this attempt wherever it runs: its beats read the run's stop document
    on_beat = _both(forward, progress_reporter(part, round_no), preemption.StopWatch(ck.store))
    try:
        generation = None
        if quorum:  # (the marks cost store requests: only a quorum run's flow reads them)
            # the generation first: a flow that marks and fences the shard after the check below
            # stops this attempt at its first beat, instead of letting it train as the new generation
            generation = ck.live_generation(part)
            if _left_out(ck.store, part, round_no):  # a retry that starts after the flow cut the round without it
                return left_out_state(shard, round_no, attempt)  # type: ignore[return-value]
            _mark_earlier_failure(ck.store, part, round_no, cut)
        if spec.ranks_per_shard > 1:  # a group of rank processes (trainrun.rank_group)
            from trainrun.rank_group import train_shard_group

            result = train_shard_group(ck, options, spec, shard, round_no, cut, attempt=attempt, chaos=chaos or [],
                                       heartbeat_every_s=heartbeat_every_s, on_beat=on_beat,
                                       checkpoint_every=RunSettings(shard_checkpoint_every=shard_checkpoint_every)
                                       .shard_checkpoint_every,
                                       local_tier=LocalTier(run_url) if local_tier else None,
                                       warm=True)  # for the next round; the train flow ends it
        else:
            result = train_shard_round(ck, spec, shard, round_no, cut, attempt=attempt,
                                       chaos=for_attempt(chaos, shard, round_no, attempt),
                                       heartbeat_every_s=heartbeat_every_s, on_beat=on_beat,
                                       checkpoint_every=RunSettings(shard_checkpoint_every=shard_checkpoint_every)
                                       .shard_checkpoint_every,
                                       local_tier=LocalTier(run_url) if local_tier else None, generation=generation)
    except Preempted as e:  # a stop is no failure: its rerun continues from its checkpoint
        logger.warning("%s", e)
        if preemption.ending():  # this process's SIGTERM: it ends in a moment; its task is rerun elsewhere
            wait_for_the_end()
        # Completed, named: Prefect logs every other final state of a task run as an ERROR, and a stop is none
        return Completed(name="Preempted", message=str(e),  # type: ignore[return-value]
                         data={"shard": shard, "round": round_no, "part": part, "status": "preempted",
                               "attempt": attempt, "round_step": e.round_step, "reason": e.reason})
    except Exception as e:
        if quorum:
            _mark_failed(ck.store, part, round_no, attempt, ck.live_generation(part), f"{type(e).__name__}: {e}")
            if _left_out(ck.store, part, round_no):  # the flow's fence, or a write against the part it carried
                return left_out_state(shard, round_no, attempt)  # type: ignore[return-value]
        if not isinstance(e, FencedError):
            raise
        state = fenced_state(ck, shard, round_no, attempt, e)
        logger.warning("%s round %d: %s", part, round_no, state.message)
        return state  # type: ignore[return-value]  # Prefect: a returned state is the task run's final state
    finally:
        preemption.forget_stop_document()  # the process (a Dask worker) outlives the run
        ck.close()
    written, full = result.bytes_written or 0, result.logical_bytes or 0
    # nothing written: an earlier attempt (before a kill, a retry) had stored this very fragment
    size = f"{written} B written of {full} B ({full / written:.1f}x)" if written else f"already stored ({full} B)"
    logger.info("%s round %d: loss %.4f, fragment %s, %.1f s", part, round_no, result.loss, size,
                result.seconds["total"])
    return result
