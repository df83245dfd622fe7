"""One rank of a shard's group: its part of the shard's rounds (``--ranks-per-shard`` R > 1).

``trainrun.rank_group`` starts R of these processes (``python -m trainrun.rank_round``, the jobs on
stdin, one JSON line each: credentials never show in a process listing) and keeps them warm from
round to round. Each job is an attempt run by ``trainrun.attempt.run_attempt``, hosted as this rank
(``rank_host``: the group agrees on its start, its checkpoint steps and its stop). Each rank::

    init_process_group("gloo", store=FileStore(<the group's rendezvous>), rank, R)   # once, gloo on loopback
    for each job (a round's attempt), until stdin closes or stays idle:
        ck    = Checkpointer(run, process_group=WORLD)      # collective: the fragment is the group's
        hb    = Heartbeat(part, rank)                       # rank 0: heartbeats/<part>.json; r: heartbeats/ranks/<part>/<r>.json
        state = the cut (the coordinator's model, the shard's own part)
        wl    = the shard's workload, ``train_as_rank(rank, R)`` (DDP: rank r trains rows r/R of each batch)
        loss  = steps_per_round steps, a beat after each, chaos aimed at this rank striking
        frag  = ck.write_fragment(round, part, state)       # collective: every rank's part, committed by rank 0
        the done file (rank 0: the result first)

A job holds nothing over to the next but the process and its gloo group: each builds its own
Checkpointer, heartbeat and workload from the job, so a warm group's round ends on the bits a fresh
group's would.

Every rank holds the same replica (DDP), so the group fragment stores the model and optimizer once
and the cut reads it as it reads one process's fragment. The round's loss is the mean over the
ranks of their local means (one all_reduce at the end of the round: the same on every rank).

What a rank's exit says to the supervisor is a ``trainrun.failures.RankExit``: 0 its stdin closed or
stayed idle (every job done), 3 fenced (a newer generation owns the shard), 4 preempted (below), 1
anything else (its traceback on stderr).

A preemption stops the group together. A rank that gets SIGTERM (from outside, or forwarded by its
supervisor when the supervisor's own process got one) sets its process's flag
(``trainrun.preemption``); before each step every rank votes with one all_reduce(MAX) of an int64
(``stop_code``), so they all stop after the same step, write the group's shard checkpoint of that
state collectively, and exit 4 (rank 0 first says where it stopped); the supervisor raises
``Preempted``. The vote costs one small collective a step (docs/training.md, Preemption). A rank that dies or
hangs fails the others at their next collective (gloo: a closed connection at once, a hang after the
group timeout) or is ended by the supervisor, which watches them all.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptlib import Checkpointer, FencedError
from ckptlib.heartbeat import Heartbeat
from ckptlib.store import Store

from . import preemption
from .beats import start_meta, starting
from .chaos import for_attempt
from .documents import Cut
from .errors import Preempted
from .failures import RankExit
from .layout import COORDINATOR, shard_part
from .local_tier import LocalTier, copy_name
from .recovery import Failure
from .results import ShardResult
from .spec import RunSpec
from .timing import Stopwatch

if TYPE_CHECKING:
    from .attempt import Host
    from .shard_attempt import ShardAttempt
    from .shard_checkpoint import Every, Start

# a preemption's reason as one integer, so that the ranks agree on it with one all_reduce(MAX) a step
STOP_CODES = {"SIGTERM": 1, "cancel": 2}
STOP_REASONS = {code: reason for reason, code in STOP_CODES.items()}
LOOPBACK = "lo"  # the interface every gloo group of a rank binds (Linux's loopback: 127.0.0.1 only)


@dataclass(frozen=True)
class RankJob:
    """What one rank process is told (JSON on its stdin): the attempt, its rank, the rendezvous (the
    path of the group's FileStore, in a 0700 folder: ``trainrun.rank_group``)."""

    url: str
    storage_options: dict[str, Any] | None
    spec: dict[str, Any]
    shard: int
    round_no: int
    cut: dict[str, Any]
    generation: int
    attempt: int
    chaos: list[str]
    heartbeat_every_s: float
    rank: int
    ranks: int
    rendezvous: str
    group_timeout_s: float
    result_path: str
    supervisor_pid: int = 0  # the shard task's process: the rank dies with it (Linux)
    checkpoint_every: int | str = 0  # the group's shard checkpoints: every N round steps, "auto" (agreed by the ranks), 0 none
    resume: dict[str, Any] | None = None  # the shard checkpoint every rank continues from (a ShardCheckpointRef)
    local_tier: str | None = None  # the local tier's root (trainrun.local_tier; None: no local copies)
    local_tier_max_bytes: int | None = None
    idle_s: float = 300.0  # a warm group's rank ends after this long without its next job
    failure: dict[str, Any] | None = None  # what the attempt recovers from (the supervisor recognised it)

    @property
    def preempted_path(self) -> str:
        """Where rank 0 says where the group stopped, when it was preempted (``RankExit.PREEMPTED``)."""
        return f"{self.result_path}.preempted"

    @property
    def done_path(self) -> str:
        """The file this rank writes once its part of the job is done (rank 0: after the result)."""
        return f"{self.result_path}.r{self.rank}.done"

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> RankJob:
        return cls(**json.loads(text))


def read_part(ck: Checkpointer, cut: Cut, part: str, *, adopt: bool) -> Any:
    """``part``'s state in ``cut``, read by this rank alone (no collective call). ``adopt``: it becomes
    this rank's delta base (a group's part: this rank's own fragment of it)."""
    if cut.committed:
        frag = ck.fragment(cut.step, part)
        return ck.read_fragment(cut.step, part, generation=frag.generation, fragment=frag, adopt=adopt)
    return ck.read_fragment(cut.step, part, generation=cut.generations.get(part), adopt=adopt)


def load_cut_in_group(ck: Checkpointer, reader: Checkpointer, spec: RunSpec, shard: int, cut: Cut) -> dict[str, Any]:
    """The state the rank starts from: the shard's part of the cut with the coordinator's model (a cut
    of another shard count merged or split by ``trainrun.reshard``, read by ``reader``, a plain
    Checkpointer: the parts it averages may be one process's or a group's)."""
    from .reshard import cut_shards, reshard_state

    coord = read_part(ck, cut, COORDINATOR, adopt=False)
    if cut_shards(ck, cut) == spec.shards:
        mine = read_part(ck, cut, shard_part(shard), adopt=True)
    else:
        mine = reshard_state(reader, cut, shard, spec.shards)
    return {**mine, "model": coord["model"]}


def group_mean(value: float) -> float:
    """The mean of ``value`` over the group's ranks (float64, the same on every rank)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def group_max(value: int) -> int:
    """The largest of every rank's ``value`` (one all_reduce: the same on every rank)."""
    return _reduced(value, "MAX")


def group_all(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of the group (one all_reduce: the same answer on every rank)."""
    return bool(_reduced(1 if ok else 0, "MIN"))


def _reduced(value: int, op: str) -> int:
    """``value`` reduced over the group's ranks by ``torch.distributed.ReduceOp.<op>`` (as int64)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return int(t.item())


def start_in_group(a: ShardAttempt, job: RankJob, reader: Checkpointer, signature: dict[str, Any],
                   tier: LocalTier | None) -> Start:
    """Where every rank of the group starts: the shard checkpoint the supervisor named (``job.resume``)
    if every rank could read and check it (from the ranks' local copies where they check out), else
    the round's cut (the same start on every rank)."""
    from .resume_point import ShardCheckpointRef
    from .shard_checkpoint import Start, load_checkpoint

    start = None
    if job.resume is not None:
        start = load_checkpoint(a, ShardCheckpointRef.from_dict(job.resume, "the rank's job"), signature, tier,
                                ranks=job.ranks)
        if not group_all(start is not None):
            start = None  # logged where it did not check out
    return start or Start(load_cut_in_group(a.ck, reader, a.spec, a.shard, a.cut))


def train_rank_round(job: RankJob) -> ShardResult:
    """This rank's part of the round (torch.distributed initialised): the attempt run by
    ``trainrun.attempt.run_attempt`` as this rank of the group (``rank_host``); the group's result."""
    import torch.distributed as dist

    from .attempt import run_attempt
    from .shard_attempt import ShardAttempt, apply_threads

    clock = Stopwatch()
    started_at = time.time()
    spec, cut = RunSpec.from_dict(job.spec), Cut.from_dict(job.cut)
    apply_threads(spec)
    ck = Checkpointer(job.url, job.storage_options, process_group=dist.group.WORLD, group_timeout_s=job.group_timeout_s)
    reader = Checkpointer(ck.store)
    a = ShardAttempt(ck, spec, job.shard, job.round_no, cut, job.generation, job.attempt,
                     for_attempt(job.chaos, job.shard, job.round_no, job.attempt, job.rank))
    tier = LocalTier(job.url, job.local_tier, job.local_tier_max_bytes) if job.local_tier else None
    # the supervisor recognised it before the group's first beat (its spawn beat)
    failure = Failure.from_dict(job.failure) if job.rank == 0 and job.failure is not None else None
    hb = job_heartbeat(job, ck.store)
    starting(hb, "load")
    clock.lap("setup")  # the checkpointer's own gloo group, the first beat
    every: Every = "auto" if job.checkpoint_every == "auto" else int(job.checkpoint_every)
    try:
        result = run_attempt(a, rank_host(job, a, reader, tier), hb, failure=failure, every=every, tier=tier,
                             clock=clock, started_at=started_at)
    finally:
        reader.close()
    ck.close()
    return result


def rank_host(job: RankJob, a: ShardAttempt, reader: Checkpointer, tier: LocalTier | None) -> Host:
    """The attempt as this rank of its group runs it: the group agrees on its start, its checkpoint
    steps and its stop; it builds its workload as this rank, beats its start phases, keeps its own
    copy in the local tier, and its loss is the group's mean."""
    from .attempt import Host
    from .reshard import cut_shards

    def read_base() -> None:  # this rank's own fragment of the cut's part: no collective call
        if cut_shards(reader, a.cut) == a.spec.shards:
            read_part(a.ck, a.cut, a.part, adopt=True)

    return Host(start=lambda signature: start_in_group(a, job, reader, signature, tier),
                build=lambda state: build_rank_workload(a.spec, job, state),
                stop_vote=lambda: STOP_REASONS.get(group_max(stop_code())), read_base=read_base,
                loss=group_mean, phase=starting, copy=copy_name(a.part, job.rank), agree=group_max,
                meta=lambda clock: {"ranks": job.ranks, "setup_s": clock.spent("setup")},
                kept_in=f"its group of {job.ranks} ranks checkpointed it")


def job_heartbeat(job: RankJob, store: Store) -> Heartbeat:
    """This rank's heartbeat of ``job``'s attempt (rank 0's is the shard's)."""
    spec = RunSpec.from_dict(job.spec)
    return Heartbeat(store, shard_part(job.shard), generation=job.generation, round=job.round_no,
                     steps_per_round=spec.steps_per_round, every_s=job.heartbeat_every_s, attempt=job.attempt,
                     rank=job.rank, meta=start_meta(Cut.from_dict(job.cut), spec))


def build_rank_workload(spec: RunSpec, job: RankJob, state: dict[str, Any]) -> Any:
    """The shard's workload holding ``state`` (full tensors), trained as this rank of the group
    (``spec.parallelism``: DDP replicas, or FSDP2 shards cut from that full state)."""
    from workloads import build_workload

    wl = build_workload(spec.workload_config(), job.shard, spec.shards)
    wl.load_state_dict(state)
    train_as_rank = getattr(wl, "train_as_rank", None)
    if not callable(train_as_rank):
        raise ValueError(f"workload {spec.workload!r} cannot be trained by a group of ranks: it has no "
                         "train_as_rank(rank, ranks) (docs/workloads.md, Ranks per shard); use --ranks-per-shard 1")
    if spec.parallelism not in getattr(wl, "parallelisms", ("ddp",)):
        raise ValueError(f"workload {spec.workload!r} cannot be trained with --parallelism {spec.parallelism} (it "
                         f"supports {list(getattr(wl, 'parallelisms', ())) or 'none'}): choose one of those")
    # (the protocol's train_as_rank(rank, ranks) is DDP's: a workload's own may not take a third argument)
    train_as_rank(job.rank, job.ranks, *([] if spec.parallelism == "ddp" else [spec.parallelism]))
    return wl


def stop_code() -> int:
    """This rank's vote on stopping now: 0 go on, else why it was asked to (``STOP_CODES``)."""
    why = preemption.requested()
    return 0 if why is None else STOP_CODES.get(why, 1)


def die_with(supervisor_pid: int) -> None:
    """Have the kernel SIGKILL this rank when its supervisor's thread ends (Linux ``PR_SET_PDEATHSIG``):
    a shard task killed with ``kill -9`` leaves no rank training on; elsewhere a no-op."""
    if not supervisor_pid or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != supervisor_pid:  # it died before the call: nobody would end this rank
        os._exit(1)


class JobReader:
    """The supervisor's jobs on this rank's stdin, one JSON line each (credentials never on a
    command line). ``next`` returns None when the supervisor closed stdin (the group ends) or sent
    nothing for ``idle_s`` (its supervisor forgot the group: it ends on its own)."""

    def __init__(self, fd: int = 0):
        self.fd, self.buffer = fd, b""

    def next(self, idle_s: float | None = None) -> RankJob | None:
        deadline = None if idle_s is None else time.monotonic() + idle_s
        while b"\n" not in self.buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], wait)[0]:
                return None
            data = os.read(self.fd, 1 << 16)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return RankJob.from_json(line.decode())


def run_job(job: RankJob) -> RankExit:
    """One round's job in the live group; the exit code it would end the process with (0: done,
    the done file written, the result first on rank 0)."""
    try:
        with preemption.training():
            result = train_rank_round(job)
        if job.rank == 0:  # read once its done file exists, so written whole by then
            with open(job.result_path, "w", encoding="utf-8") as f:
                f.write(result.to_json().decode())
        with open(job.done_path, "w", encoding="utf-8"):
            pass
        return RankExit.DONE
    except FencedError as e:
        print(f"fenced: {e}", file=sys.stderr)
        return RankExit.FENCED
    except Preempted as e:
        if job.rank == 0:  # what the supervisor raises: its own Preempted (trainrun.rank_group.preempted)
            Path(job.preempted_path).write_text(json.dumps({"message": str(e), "round_step": e.round_step,
                                                            "reason": e.reason}), encoding="utf-8")
        return RankExit.PREEMPTED
    except BaseException:  # noqa: BLE001 - the supervisor reports the traceback's last line
        traceback.print_exc()
        return RankExit.FAILED


def main(parent_pid: int | None = None) -> int:
    """The rank process: the first job's rendezvous, then job after job in the same group (a warm
    group: ``trainrun.rank_group``) until stdin closes or stays idle; the first job that fails
    ends the process, and its exit code says how (module docstring). It dies with ``parent_pid``
    (the rank launcher that forked it: ``trainrun.rank_launcher``), else with its job's supervisor."""
    import torch.distributed as dist

    signal.signal(signal.SIGTERM, _on_sigterm)
    reader = JobReader()
    job = reader.next()
    if job is None:
        return RankExit.DONE
    die_with(job.supervisor_pid if parent_pid is None else parent_pid)
    try:  # torch is imported: the group's start goes on to its rendezvous (timed apart: trainrun.beats)
        starting(job_heartbeat(job, Store.from_url(job.url, job.storage_options)), "rendezvous")
    except FencedError as e:
        print(f"fenced: {e}", file=sys.stderr)
        return RankExit.FENCED
    try:
        # a FileStore, not a TCPStore: no socket a stranger may reach or write to (docs/security.md);
        # gloo binds the interface GLOO_SOCKET_IFNAME names, for this group and the checkpointer's
        os.environ["GLOO_SOCKET_IFNAME"] = LOOPBACK
        os.close(os.open(job.rendezvous, os.O_RDWR | os.O_CREAT, 0o600))  # at once: FileStore would retry 300 s
        store = dist.FileStore(job.rendezvous, job.ranks)
        dist.init_process_group("gloo", store=store, rank=job.rank, world_size=job.ranks,
                                timeout=timedelta(seconds=job.group_timeout_s))
    except Exception as e:  # noqa: BLE001 - the supervisor reports it
        print(f"rendezvous failed: rank {job.rank} of {job.ranks} could not join the group at {job.rendezvous}: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return RankExit.FAILED
    try:
        while job is not None:
            code = run_job(job)
            if code == RankExit.FAILED:  # its traceback is on stderr; it leaves first (below)
                leave_at_once(code)
            if code:
                return code
            job = reader.next(job.idle_s)
        return RankExit.DONE
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group cannot be destroyed cleanly
            pass


def leave_at_once(code: int) -> None:
    """End this process now with ``code``, its standard streams flushed and nothing else run (no
    atexit, no gloo destroy). A failed rank leaves so: the kernel closes its connections, so it exits
    before the ranks that fail because of it (the supervisor names the first rank to exit, and a
    destroy here could let a peer see the closed connection, fail and exit first). A forked rank
    ends so too (``trainrun.rank_launcher``): it must never return into its launcher's loop."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing more to say
            pass
    os._exit(code)


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM to a rank (a preemption): while it trains, the group stops at the next step its ranks
    agree on (``rank_steps``); between jobs the rank ends at once."""
    preemption.request("SIGTERM")
    if not preemption.training_now():
        raise SystemExit(RankExit.PREEMPTED)


if __name__ == "__main__":
    sys.exit(main())
