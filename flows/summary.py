"""Bookkeeping of a ``train-run``: what each round cost and where, every recovery, and the run's summary (plain Python).

Time is attributed along the critical path: a round lasts from submitting its shards until its cut
returns; inside it the slowest shard's task body and the cut's task body are work (training,
restore, save, combine), everything else is Prefect overhead (task submission, state tracking,
result passing). Setup (planning, step 0, starting runners) is accounted the same way. A round
in which a shard was fenced and rerun also waited for the watchdog (its detection, the fence and the
rerun): ``watchdog_wait``, how much longer the round's shards took than its live attempts alone.

Recoveries (``trainrun.recovery``): after each round's cut the rows the round's recovering attempts
wrote (``recoveries/<round>/``: whoever ran them, the flow's task runner or a watchdog); and for a
run resumed after it died mid-round, ``run-died`` rows from the beats the dead run left (read before
this session's shards beat): per shard, one for each round this session does again (the resume
starts from the last healthy step): the steps the dead run had done of it (all of an earlier round;
of the round it died in, those up to its last beat), less where this session's attempt continued.

A run with a step that failed validation has a ``failure``: one line naming the first such step, its
failed checks, its report and the last healthy step to resume from. Losses that are not finite (a
diverging run) are None in the summary (JSON has no NaN), as in the manifests.
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any

from trainrun.failures import FailureKind
from trainrun.metrics import finite_or_none

if TYPE_CHECKING:
    from ckptlib.heartbeat import Beat
    from ckptlib.store import Store
    from ckptlib.validate import Verdict
    from trainrun.recovery import Recovery
    from trainrun.results import CutResult, RunPlan, ShardResult

log = logging.getLogger("flows.summary")


class Ledger:
    def __init__(self, params: Any, run_id: str, url: str):
        import torch

        self.t0 = time.perf_counter()
        self.wall0 = time.time()
        self.params, self.run_id, self.url = params, run_id, url
        self.recoveries: dict[tuple, Recovery] = {}
        self.dead_session: dict[str, Beat] = {}  # part -> the dead run's last beat (a resumed run)
        self._store: Store | None = None
        self.marks: dict[str, float] = {}
        self.plan: RunPlan | None = None
        self.start = 0
        self.cuts: list[CutResult] = []  # committed ones, step 0 included
        self.rounds: list[dict[str, Any]] = []
        self.run_meta = {"run_id": run_id, "params": {**params.public_dict(), "run_id": run_id},
                         "torch": torch.__version__}
        self.predecessor: dict[str, Any] | None = None  # the session this one continues (flows/predecessor.py)
        self.stopped_after: int | None = None  # the last round trained when a failed validation stopped the run
        self.fences_counted: set[tuple[str, int]] = set()  # (part, generation): a recovery row counted
        self.cancelled: str | None = None  # a cancel (or a preemption) stopped the run: what it committed, where

    def set_params(self, params: Any) -> None:
        """The parameters as the run trains with them (a resume's trajectory is the run's own)."""
        self.params = params
        self.run_meta["params"] = {**params.public_dict(), "run_id": self.run_id}

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def add_cut(self, cut: CutResult) -> None:
        self.cuts.append(cut)

    def start_rounds(self, plan: RunPlan, start: int) -> None:
        self.plan, self.start = plan, start
        self.mark("rounds")
        self._note_dead_session(start)  # a new run has no beats; a resumed one (from any step) may

    @property
    def store(self) -> Store:
        if self._store is None:
            from ckptlib.store import Store
            from tasks.access import storage_options

            self._store = Store.from_url(self.url, storage_options(self.params.access()))
        return self._store

    def _note_dead_session(self, start: int) -> None:
        """The last beat of each shard of an earlier session (a resumed run) that got past ``start``
        (read before this session's shards beat; a report: a failure to read is logged)."""
        from ckptlib.heartbeat import read_heartbeats
        from trainrun.layout import shard_index

        try:
            beats = read_heartbeats(self.store)
        except Exception as e:  # noqa: BLE001
            log.warning("cannot read the beats the earlier session left: %s", e)
            return
        self.dead_session = {p: b for p, b in beats.items() if shard_index(p) is not None and b.round > start
                             and b.time < self.wall0}

    def stop_requested(self, last_round: int, checkpoints: list[int | None], why: str) -> None:
        """A cancel or a preemption (``why``) stopped the run after round ``last_round``; its shards
        checkpointed round ``last_round + 1`` at ``checkpoints`` (per shard; empty: between rounds)."""
        self.stopped_after = last_round
        committed = [c.step for c in self.cuts]
        what = f"committed steps {committed[0]}..{committed[-1]}" if committed else "committed nothing"
        where = ", ".join(f"shard-{i} at step {k}" if k is not None else f"shard-{i} from the cut"
                          for i, k in enumerate(checkpoints))
        how = "cancelled" if why == "cancel" else f"preempted ({why})"
        self.cancelled = (f"{how} after round {last_round}: this session {what}"
                          + (f"; round {last_round + 1} checkpointed ({where})" if checkpoints else "")
                          + f"; continue with: ckpt train --resume --run-id {self.run_id} --store {self.params.store}")

    def rounds_done(self) -> None:
        self.mark("rounds_done")

    def add_round(self, r: int, shards: list[ShardResult], cut: CutResult, t0: float, t1: float, t2: float, *,
                  replaced_at: float | None = None, left_out: list[int] | None = None) -> None:
        """Record round ``r``: shards submitted at t0, all returned at t1, the cut returned at t2; the
        last shard the watchdog replaced settled at ``replaced_at``. ``left_out`` (quorum mode, None:
        off): the shards its cut went ahead without; the row then names the cut's (``quorum``) too."""
        finished = [s for s in shards if s.finished]
        slowest = max(finished, key=lambda s: s.seconds["total"]).seconds if finished else {}
        cs = cut.seconds
        wall = t2 - t0
        # waiting for the watchdog: the fenced shard's round beyond what its live attempts took
        watchdog = max(0.0, replaced_at - t0 - slowest.get("total", 0.0)) if replaced_at is not None else 0.0
        self.rounds.append({
            "round": r, "committed": cut.committed, "loss": finite_or_none(cut.loss),
            "eval_loss": finite_or_none(cut.eval_loss),
            "digest": cut.digest,
            "shards": [{k: getattr(s, k) for k in ("shard", "status", "attempt", "generation",
                                                   "bytes_written", "logical_bytes", "resumed_at_step",
                                                   "start_source", "shard_checkpoints", "shard_checkpoint_bytes",
                                                   "training_at")}
                       | {"loss": finite_or_none(s.loss), "ckpt_blocked_s": s.seconds.get("ckpt_blocked", 0.0),
                          "ckpt_write_s": s.seconds.get("ckpt_write", 0.0), "train_s": s.seconds.get("train", 0.0)}
                       for s in shards],
            "bytes_written": sum(s.bytes_written or 0 for s in finished) + cut.bytes_written,
            "logical_bytes": cut.logical_bytes,
            "seconds": {
                "wall": wall, "shards_wall": t1 - t0, "cut_wall": t2 - t1,
                "train": slowest.get("train", 0.0), "build": slowest.get("build", 0.0),
                "restore": slowest.get("load", 0.0) + slowest.get("load_base", 0.0) + cs["load"] + cs["read"],
                "restore_parts": {"shard_load": slowest.get("load", 0.0), "cut_load": cs["load"], "cut_read": cs["read"]},
                "save": slowest.get("write", 0.0) + cs["write"] + cs["commit"],
                "combine_eval": cs["combine"], "cut_wait": cs["wait"], "watchdog_wait": watchdog,
                "prefect": max(0.0, wall - slowest.get("total", 0.0) - cs["total"] - watchdog),
            },
            **({"quorum": [s.shard for s in shards if s.shard not in left_out], "left_out": list(left_out)}
               if left_out is not None else {}),
        })
        if cut.committed:
            self.cuts.append(cut)
        self._add_recoveries(r)

    # --- recoveries ------------------------------------------------------------------------------

    def _add_recoveries(self, r: int) -> None:
        """The rows of round ``r``: those its attempts wrote, and the dead session's ``run-died`` rows."""
        from trainrun.recovery import fence_recoveries, read_recoveries

        try:
            for rec in read_recoveries(self.store, r):
                if rec.failed_at is None or rec.failed_at >= self.wall0 - 1.0:  # this session's
                    self.recoveries[(rec.round, rec.part, rec.generation, rec.attempt)] = rec
                    self.fences_counted.add((rec.part, rec.generation))
            # every fence is a recovery: one whose rerun found nothing to recognise counts from its fence
            for rec in fence_recoveries(self.store, r, self.fences_counted, since=self.wall0 - 1.0):
                self.recoveries[(rec.round, rec.part, rec.generation, "fence")] = rec
        except Exception as e:  # noqa: BLE001 - a report must never fail the run
            log.warning("recoveries of round %d not read: %s", r, e)
        for part, beat in self.dead_session.items():
            if self.start < r <= beat.round:
                self.recoveries[(r, part, FailureKind.RUN_DIED)] = self._run_died(part, beat, r)

    def _run_died(self, part: str, beat: Beat, r: int) -> Recovery:
        """The row of ``part``'s round ``r`` in a run resumed after it died in ``beat.round``: the
        steps the dead run had done of it (all of an earlier round; of the round it died in, those up
        to its last beat), less the step this session's attempt continued from."""
        from trainrun.layout import shard_index
        from trainrun.recovery import Recovery

        shard = shard_index(part) or 0
        mine = [s for x in self.rounds if x["round"] == r for s in x["shards"] if s["shard"] == shard]
        at = int(mine[0].get("resumed_at_step") or 0) if mine else 0
        failed_at = self.params.steps_per_round if r < beat.round or beat.status == "finished" else int(
            beat.round_step or 0)
        failed_at = max(failed_at, at)  # it checkpointed step ``at`` after its last beat: it got that far
        training_at = mine[0].get("training_at") if mine else None
        return Recovery(shard=shard, round=r, kind=FailureKind.RUN_DIED, failed_at_step=failed_at, resumed_at_step=at,
                        steps_recomputed=failed_at - at, detect_s=round(self.wall0 - beat.time, 3),
                        back_to_training_s=round(training_at - self.wall0, 3) if training_at else None, part=part,
                        generation=beat.generation, attempt=beat.attempt, failed_at=beat.time,
                        detected_at=self.wall0, training_at=training_at)

    def recovery_rows(self) -> list[dict[str, Any]]:
        return [rec.row() for rec in sorted(self.recoveries.values(), key=lambda x: (x.round, x.failed_at or 0.0))]

    def shard_checkpoint_totals(self) -> dict[str, Any]:
        """Every shard checkpoint of this session: how many, bytes, the seconds the loops waited for
        them and their background writes took, against the shards' training seconds."""
        shards = [s for x in self.rounds for s in x["shards"] if s["status"] == "finished"]
        blocked = sum(s["ckpt_blocked_s"] for s in shards)
        write = sum(s["ckpt_write_s"] for s in shards)
        train = sum(s["train_s"] for s in shards) or 1.0
        return {"count": sum(s["shard_checkpoints"] or 0 for s in shards),
                "bytes_written": sum(s["shard_checkpoint_bytes"] or 0 for s in shards),
                "blocked_s": round(blocked, 3), "write_s": round(write, 3),
                "blocked_share_of_train": round(blocked / train, 5), "write_share_of_train": round(write / train, 5),
                "every": self.params.shard_checkpoint_every}

    # --- the summary -----------------------------------------------------------------------------

    def summary(self, verdicts: dict[int, Verdict]) -> dict[str, Any]:
        t_end = time.perf_counter()
        p = self.params
        by_round = {x["round"]: x for x in self.rounds}
        checkpoints = []
        for c in self.cuts:
            v = verdicts.get(c.step)
            checkpoints.append({
                "step": c.step, "digest": c.digest, "created": c.created, "kind": c.kind,
                "bytes_written": by_round[c.step]["bytes_written"] if c.step in by_round else c.bytes_written,
                "logical_bytes": c.logical_bytes, "stored_bytes": c.stored_bytes,
                "loss": finite_or_none(c.loss), "eval_loss": finite_or_none(c.eval_loss),
                "validation": None if v is None else {"passed": v.passed, "failed": list(v.failed)},
            })
        final = checkpoints[-1] if checkpoints else self._existing_final()
        step0 = next((c for c in self.cuts if c.step == 0), None)
        sec = {k: sum(x["seconds"][k] for x in self.rounds)
               for k in ("wall", "train", "build", "restore", "save", "combine_eval", "cut_wait", "watchdog_wait",
                         "prefect")}
        rounds_at = self.marks.get("rounds", t_end)
        setup = rounds_at - self.t0
        setup_work = (self.plan.seconds if self.plan else 0.0) + (step0.seconds["total"] if step0 else 0.0)
        sec["setup"] = setup
        sec["save"] += step0.seconds["save"] if step0 else 0.0
        sec["prefect"] += max(0.0, setup - setup_work)
        sec["validation_wait"] = t_end - self.marks.get("rounds_done", t_end)
        sec["flow"] = t_end - self.t0
        flow_s = sec["flow"] or 1.0
        bytes_written = sum(x["bytes_written"] for x in self.rounds) + (step0.bytes_written if step0 else 0)
        return {
            "run_id": self.run_id, "run_url": self.url, "store": p.store, "workload": p.workload,
            "shards": p.shards, "rounds": p.rounds, "steps_per_round": p.steps_per_round,
            "task_runner": p.task_runner, "start_step": self.start, "rounds_done": len(self.rounds),
            "resumed": self.plan is not None and self.plan.start_step is not None,
            "note": self.plan.note if self.plan else "",
            "final_step": final["step"] if final else None, "final_digest": final["digest"] if final else None,
            "final_loss": final["loss"] if final else None, "final_eval_loss": final["eval_loss"] if final else None,
            "checkpoints": checkpoints, "rounds_log": self.rounds, "committed": [c["step"] for c in checkpoints],
            "validated": sorted(s for s, v in verdicts.items() if v.passed),
            "failed_validation": sorted(s for s, v in verdicts.items() if not v.passed),
            "failure": self.failure(verdicts), "stopped_after_round": self.stopped_after, "cancelled": self.cancelled,
            "lineage": self.run_meta.get("lineage") or self._stored_lineage(), "predecessor": self.predecessor,
            "bytes_written": bytes_written, "full_copy_bytes": sum(c["logical_bytes"] for c in checkpoints),
            "reports": f"{self.url}/reports/<step>/", "validations": f"{self.url}/validations/<step>.json",
            "seconds": {k: round(v, 3) for k, v in sec.items()},
            "recoveries": self.recovery_rows(), "shard_checkpoints": self.shard_checkpoint_totals(),
            "shares_of_flow": {"train": (sec["train"] + sec["build"]) / flow_s, "checkpoint_save": sec["save"] / flow_s,
                               "checkpoint_restore": sec["restore"] / flow_s, "prefect_overhead": sec["prefect"] / flow_s,
                               "validation_wait": sec["validation_wait"] / flow_s},
        }

    def failure(self, verdicts: dict[int, Verdict]) -> str | None:
        """One line for a run with a failed step (see the module docstring); None when every step passed."""
        failed = sorted(s for s, v in verdicts.items() if not v.passed)
        if not failed:
            return None
        from tasks.links import http_url

        first = verdicts[failed[0]]
        healthy = [s for s, v in verdicts.items() if v.passed and s < first.step] or self._stored_healthy(first.step)
        report = http_url(first.report.get("url")) or first.report.get("url")
        more = f" (and {len(failed) - 1} later step{'s' if len(failed) > 2 else ''})" if len(failed) > 1 else ""
        stop = (f"; training stopped after round {self.stopped_after} of {self.params.rounds}"
                if self.stopped_after is not None else "")
        how = f"`ckpt train --resume --run-id {self.run_id} --store {self.params.store}` (or resume: true in the form)"
        last = (f"the last healthy step is {max(healthy)}: resume from it with {how}" if healthy else
                "no step before it is healthy: start a new run")
        return (f"run {self.run_id}: step {first.step} failed validation{more}: {', '.join(first.failed)}"
                + (f" (report {report})" if report else "") + f"{stop}; {last}")

    def _stored_healthy(self, before: int) -> list[int]:
        from ckptlib import Checkpointer
        from tasks.access import storage_options

        try:
            with Checkpointer(self.url, storage_options(self.params.access())) as ck:
                return [s for s in ck.healthy_steps() if s < before]
        except Exception:  # noqa: BLE001 - the line still names the failed step
            return []

    def _stored_lineage(self) -> dict[str, Any] | None:
        """Where the run came from (a branch: the run and step), from its first checkpoint of this session."""
        from ckptlib import Checkpointer
        from tasks.access import storage_options

        try:
            with Checkpointer(self.url, storage_options(self.params.access())) as ck:
                steps = ck.steps()
                if not steps:
                    return None
                m = ck.manifest(steps[0])
                return m.lineage or m.meta.get("lineage")
        except Exception:  # noqa: BLE001 - lineage is for people; never fail a summary over it
            return None

    def _existing_final(self) -> dict[str, Any] | None:
        """Nothing committed in this session (the run was already complete): its latest step."""
        from ckptlib import Checkpointer
        from tasks.access import storage_options

        with Checkpointer(self.url, storage_options(self.params.access())) as ck:
            m = ck.manifest(self.start)
        return {"step": m.step, "digest": m.digest, "loss": m.meta.get("loss"), "eval_loss": m.meta.get("eval_loss")}


def publish_artifacts(summary: dict[str, Any]) -> None:
    """A table of the checkpoints and a markdown verdict, keyed by run, for the Prefect UI."""
    from prefect import get_run_logger
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

    from tasks.links import http_url, md_link

    key = ("train-" + re.sub(r"[^a-z0-9-]+", "-", summary["run_id"].lower())).strip("-")[:90]
    rows = [{"step": c["step"], "loss": c["loss"], "eval_loss": c["eval_loss"], "bytes_written": c["bytes_written"],
             "full_copy_bytes": c["logical_bytes"], "kind": c["kind"],
             "validated": None if c["validation"] is None else c["validation"]["passed"], "digest": c["digest"]}
            for c in summary["checkpoints"]]
    ratio = summary["full_copy_bytes"] / max(summary["bytes_written"], 1)
    try:
        create_table_artifact(rows, key=key, description=f"Checkpoints of run {summary['run_id']}")
        create_markdown_artifact(
            f"### Run `{summary['run_id']}`\n\n"
            f"* rounds this session: {summary['rounds_done']} (step {summary['start_step']} -> {summary['final_step']})\n"
            f"* final loss {summary['final_loss']}, eval loss {summary['final_eval_loss']}\n"
            f"* written {summary['bytes_written']:,} B against {summary['full_copy_bytes']:,} B of full copies "
            f"({ratio:.2f}x smaller)\n* final digest `{summary['final_digest']}`\n"
            f"* validated steps: {summary['validated']}; failed: {summary['failed_validation']}\n"
            f"* {recoveries_text(summary)}\n"
            + (f"* **{summary['failure']}**\n" if summary.get("failure") else "")
            + _lineage_lines(summary) +
            f"* checkpoints: `{summary['run_url']}`\n"
            f"* {md_link('validation reports of every checkpoint', summary['run_url'] + '/reports/index.html')}\n",
            key=key + "-summary", description="Training run summary")
        link = http_url(summary["run_url"] + "/reports/index.html")
        if link:
            create_link_artifact(link, link_text=f"Validation reports of run {summary['run_id']}",
                                 key=key + "-reports", description="Every checkpoint with its verdict and report")
        if summary.get("recoveries"):
            create_table_artifact(summary["recoveries"], key=key + "-recoveries",
                                  description=f"Recoveries of run {summary['run_id']}: what each cost")
    except Exception as e:  # noqa: BLE001 - artifacts are a convenience; never fail a finished run over them
        get_run_logger().warning("could not create artifacts: %s", e)


def recoveries_text(summary: dict[str, Any]) -> str:
    """One line: how many recoveries (one per failed attempt recovered: each fence, each retried crash,
    each shard of a dead session), the steps they recomputed, their times to detect and train again."""
    rows = summary.get("recoveries") or []
    if not rows:
        return "recoveries: none"
    steps = sum(r["steps_recomputed"] for r in rows)
    worst = max((r["detect_s"] or 0.0) + (r["back_to_training_s"] or 0.0) for r in rows)
    kinds = ", ".join(f"{k} {sum(r['kind'] == k for r in rows)}" for k in sorted({r["kind"] for r in rows}))
    return (f"recoveries: {len(rows)}, one per failed attempt ({kinds}), {steps} steps recomputed, "
            f"at most {worst:.1f} s from a failure to training again")


def _lineage_lines(summary: dict[str, Any]) -> str:
    """Where the run came from (a branch's source run and step) and the session it continues."""
    from tasks.links import flow_run_url

    out = ""
    lineage = summary.get("lineage")
    if lineage:
        out += f"* branched from step {lineage.get('step')} of run `{lineage.get('run')}`\n"
    pred = summary.get("predecessor")
    if pred:
        name = pred.get("name") or pred.get("flow_run_id") or "a session without a flow run"
        link = flow_run_url(pred.get("flow_run_id"))
        how = "died (its coordinator still said running)" if pred.get("status") == "running" else \
            f"ended {pred.get('status')}"
        out += (f"* continues flow run {f'[{name}]({link})' if link else name}, which {how}; "
                f"this session started from step {summary['start_step']}\n")
    return out
