"""The figures of a peer's run, from its event log (``workload.event_log``), against its clean run.

Events: ``begin`` (a process starts training, at ``step``), ``step`` (a step applied: ``step``,
``loss``, torchft's ``participants``), ``error`` (a step failed on a live rank: the peer's loss
seen), ``quorum`` (torchft formed a new quorum), ``operator_kill`` (torchft's harness killed
replicas that were all frozen), ``strike``, ``final`` (the last step's ``loss``
and parameter ``digest``).

- ``goodput``: the clean run's wall time over this run's, from the first ``begin`` to the first
  ``final`` (the same number of steps);
- ``detect_s`` (measured): strike -> the first sign on another rank (a failed collective, or a new
  quorum: torchft's lighthouse acted on the replica's heartbeats stopping or its replacement);
- ``resume_s`` (measured): strike -> the next step applied by any process;
- ``rejoin_s`` (measured): strike -> the struck rank's first step in a new process (None: it never
  came back);
- ``steps_recomputed``: steps applied again, of numbers some process had already reached (the
  most of any rank); ``samples_dropped``: samples of the final trajectory's steps that a missing
  replica did not contribute (torchft trains on without it).
"""

from __future__ import annotations

from typing import Any

from .schedule import Strike


def wall_s(events: list[dict[str, Any]]) -> float | None:
    begins = [e["t"] for e in events if e["kind"] == "begin"]
    finals = [e["t"] for e in events if e["kind"] == "final"]
    return round(min(finals) - min(begins), 3) if begins and finals else None


def _recomputed(events: list[dict[str, Any]]) -> int:
    """Steps a rank applied again: at or below its own furthest, or below the furthest of any rank
    (ranks in step apply the same number within a step of each other); the most of any rank."""
    furthest, own, again = 0, dict[int, int](), dict[int, int]()
    for e in events:
        if e["kind"] != "step":
            continue
        r = e["rank"]
        if e["step"] <= own.get(r, 0) or e["step"] < furthest:
            again[r] = again.get(r, 0) + 1
        own[r], furthest = max(own.get(r, 0), e["step"]), max(furthest, e["step"])
    return max(again.values(), default=0)


def _dropped(events: list[dict[str, Any]], ranks: int, batch_size: int) -> int:
    last: dict[int, int] = {}  # step -> the participants of its latest application
    for e in events:
        if e["kind"] == "step":
            last[e["step"]] = int(e.get("participants", ranks))
    return sum(ranks - p for p in last.values()) * batch_size


def _recovery(events: list[dict[str, Any]], s: dict[str, Any]) -> dict[str, Any]:
    t, rank, pid = s["t"], s["rank"], s["pid"]
    after = [e for e in events if e["t"] > t]
    sign = next((e for e in after if e["rank"] != rank and e["kind"] in ("error", "quorum")), None)
    resumed = next((e for e in after if e["kind"] == "step" and e["pid"] != pid
                    and (sign is None or e["t"] > sign["t"])), None)
    back = next((e for e in after if e["kind"] == "step" and e["rank"] == rank and e["pid"] != pid), None)
    return {"kind": s["what"], "rank": rank, "step": s["step"],
            "detect_s": round(sign["t"] - t, 3) if sign else None,
            "resume_s": round(resumed["t"] - t, 3) if resumed else None,
            "rejoin_s": round(back["t"] - t, 3) if back else None}


def figures(clean: list[dict[str, Any]], drilled: list[dict[str, Any]], strikes: list[Strike], *, ranks: int,
            batch_size: int) -> dict[str, Any]:
    """One system's figures: goodput, failures struck, each recovery, work lost, the final loss and digest."""
    c, d = wall_s(clean), wall_s(drilled)
    # each rank's loss is of its own batch: the losses of the same rank (the lowest that finished)
    final_d = min((e for e in drilled if e["kind"] == "final"), key=lambda e: e["rank"], default={})
    final_c = next((e for e in clean if e["kind"] == "final" and e["rank"] == final_d.get("rank", 0)), {})
    rows = [_recovery(drilled, s) for s in drilled if s["kind"] == "strike"]
    return {
        "clean_s": c, "drilled_s": d, "goodput": round(c / d, 4) if c and d else None,
        "failures_scheduled": len(strikes), "failures_struck": len(rows),
        "recoveries": rows, "steps_recomputed": _recomputed(drilled),
        "steps_discarded": sum(1 for e in drilled if e["kind"] == "error"),
        "operator_kills": sum(1 for e in drilled if e["kind"] == "operator_kill"),
        "samples_dropped": _dropped(drilled, ranks, batch_size),
        "clean_loss": final_c.get("loss"), "drilled_loss": final_d.get("loss"),
        "clean_digest": final_c.get("digest"), "drilled_digest": final_d.get("digest"),
        "same_digest": bool(final_c) and final_c.get("digest") == final_d.get("digest"),
    }
