"""The failures the peers are struck by: ``ckpt soak``'s schedule, as a rank and a global step.

A soak spec strikes shard ``s`` after round-local step ``k`` of round ``r``; a peer trains the
same shards' batches as ranks, so it is struck on rank ``s % ranks`` after global step
``(r - 1) * steps_per_round + k``. Kinds, as far as each system can be struck the same way:

- ``crash``, ``kill`` -> ``crash``: the process exits non-zero at once (``os._exit(1)``);
- ``hang``, ``stall``, ``stop`` -> ``hang``: the process freezes (``SIGSTOP`` of itself, every
  thread: a frozen host). Not a loop stuck while its threads live on: torchft's heartbeat thread
  would beat on, and with two replicas its lighthouse then never forms a quorum again (fewer than
  half of the heartbeating replicas joined: docs/recovery.md), which measures nothing;
- ``preempt`` -> ``preempt``: the process gets ``SIGTERM`` (sent to itself, as a spot reclaim, a
  Kubernetes eviction or a worker shut down sends it). Neither peer's script handles it (the
  baseline users run: no handler that checkpoints on SIGTERM), so its default disposition ends the
  process and the peer recovers as from a crash;
- ``zombie``: not mapped (no counterpart that strikes a peer the same way).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass
from typing import Any

from trainrun.chaos import parse_chaos

KIND_MAP = {"crash": "crash", "kill": "crash", "hang": "hang", "stall": "hang", "stop": "hang", "preempt": "preempt"}


@dataclass(frozen=True)
class Strike:
    kind: str  # crash | hang | preempt
    rank: int
    step: int  # the global step after which it strikes
    source: str  # the soak spec it maps


def from_soak(specs: list[str], steps_per_round: int, ranks: int) -> tuple[list[Strike], list[str]]:
    """The strikes of ``ckpt soak`` specs, and the specs that have no counterpart (unmapped kinds)."""
    strikes, unmapped = [], []
    for text in specs:
        c = parse_chaos(text)
        if c.kind not in KIND_MAP:
            unmapped.append(text)
            continue
        step = (c.round - 1) * steps_per_round + (c.step if c.step is not None else steps_per_round // 2)
        strikes.append(Strike(KIND_MAP[c.kind], c.shard % ranks, step, text))
    return sorted(strikes, key=lambda s: (s.step, s.rank)), unmapped


def dumps(strikes: list[Strike]) -> str:
    return json.dumps([asdict(s) for s in strikes])


def loads(text: str) -> list[Strike]:
    """Strikes from ``dumps`` (a worker's argument): only the four known fields, of their types."""
    out = []
    for d in json.loads(text):
        if set(d) != {"kind", "rank", "step", "source"} or d["kind"] not in ("crash", "hang", "preempt") \
                or not isinstance(d["rank"], int) or not isinstance(d["step"], int):
            raise ValueError(f"not a strike: {d!r}: pass what bench.compare.schedule.dumps wrote")
        out.append(Strike(**d))
    return out


def strike_if_due(strikes: list[Strike], rank: int, step: int, run_dir: str, log: Any) -> None:
    """Strike ``rank`` after ``step`` if a strike is due there and has not struck yet (a marker file,
    created exclusively, makes each strike once per run: a restarted process replays the step)."""
    for i, s in enumerate(strikes):
        if (s.rank, s.step) != (rank, step):
            continue
        try:
            os.close(os.open(os.path.join(run_dir, f"strike-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        log("strike", rank=rank, step=step, what=s.kind, source=s.source)
        if s.kind == "crash":
            os._exit(1)
        if s.kind == "preempt":
            os.kill(os.getpid(), signal.SIGTERM)  # its default disposition ends the process here
            return
        os.kill(os.getpid(), signal.SIGSTOP)  # hang: frozen until the system (or the harness) kills it
