"""The channel between the ranks of a collective ``Checkpointer``: a gloo process group of its own.

The group is created when the Checkpointer is (every rank of ``process_group`` constructs one), with
the ranks of ``process_group``, and it carries only the checkpointer's own messages: plans, reports
and outcomes as JSON (``wire``: a closed set of types, never pickle), each a uint8 tensor after its
length, which every rank checks against ``MAX_MESSAGE_BYTES`` before it allocates. So a background save never runs a collective on
the training loop's group (which would interleave with the training collectives and deadlock),
and an NCCL job needs no GPU for it. Per save: one ``all_gather`` in the foreground (the plan), one
``gather`` (an ``all_gather``) and one ``broadcast`` once the rank fragments are written (the leader's commit and its
outcome); per restore: one ``broadcast`` (the step) and two ``all_gather`` (the checks, the outcome).
At most one save or restore uses it at a time (a Checkpointer drains its save in flight first).

Every exchange carries errors as values: a rank that fails sends its error instead of its part,
and every rank raises it (the same class, naming the rank), so the ranks never disagree about an
outcome. A rank that dies or hangs fails the exchange (gloo notices a closed connection at once,
a hang after ``timeout_s``): ``GroupFailed`` on the other ranks, and nothing is committed. So does
a message that is not the checkpointer's (a length out of bounds, bytes ``wire`` refuses).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .wire import MAX_MESSAGE_BYTES, BadMessage, GroupFailed, Outcome, RemoteError, decode, encode

__all__ = ["Collective", "GroupFailed", "Outcome", "RemoteError"]


_FOREIGN = ("a process that is not a rank of this job joined its group, or its ranks run different ckptlib "
            "versions. Nothing of this call was committed; keep the group's rendezvous private (docs/security.md) "
            "and restart the job with one ckptlib version on every rank")


class Collective:
    """This process's rank in the checkpointer's own gloo group over ``process_group``'s ranks."""

    def __init__(self, process_group: Any, timeout_s: float):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("Checkpointer(process_group=...) needs torch.distributed initialised "
                             "(dist.init_process_group) in every rank first")
        self.timeout_s = timeout_s
        self.ranks = dist.get_process_group_ranks(process_group)
        # over the whole world every rank makes it: a numbered group, destroyed with the Checkpointer
        # (close); over a sub-group only its ranks do: a group named by its ranks (see close)
        self._whole_world = len(self.ranks) == dist.get_world_size()
        try:
            self.group = dist.new_group(ranks=self.ranks, backend="gloo", timeout=timedelta(seconds=timeout_s),
                                        use_local_synchronization=not self._whole_world)
        except (RuntimeError, ValueError) as e:
            raise GroupFailed(f"could not create the checkpointer's gloo group over ranks {self.ranks[:8]}: {e}. "
                              "Every rank of the process group must construct its Checkpointer") from e
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Destroy the gloo group (its sockets and threads: 5 open files on 2 ranks). Local, not
        collective: called once this rank's calls are done; a group broken by a dead rank is dropped
        the same. A process that makes a Checkpointer per round (a long-lived rank) keeps no round's.

        A sub-group's group is left as it is: torch names a group made with
        ``use_local_synchronization`` by a hash of its ranks and the number of groups registered, so
        a destroyed one's name would come back for the next, whose rendezvous would then read the
        old group's addresses from the store (connection refused). A whole world's groups are
        numbered, never named twice."""
        import torch.distributed as dist

        group, self.group = self.group, None
        if group is None or not self._whole_world or not dist.is_initialized():
            return
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - nothing of the group is used again either way
            pass

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except (RuntimeError, ValueError, OSError) as e:  # gloo: a closed connection, a timeout
            raise GroupFailed(
                f"the checkpoint's process group failed while {what} ({type(e).__name__}: {str(e)[:300]}): a rank "
                f"died, hung longer than {self.timeout_s:.0f} s or left. Nothing of this call was committed; "
                "restart the job, whose new group can save and restore again") from e

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order: the lengths (int64), checked, then the bytes, padded."""
        import torch
        import torch.distributed as dist

        data = encode(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._call(what, lambda: dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group))
        lengths = [self._length(int(s.item()), r, what) for r, s in enumerate(sizes)]
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(max(lengths), dtype=torch.uint8) for _ in range(self.world)]
        self._call(what, lambda: dist.all_gather(out, mine, group=self.group))
        return [self._decode(t[:n], r, what) for r, (t, n) in enumerate(zip(out, lengths, strict=True))]

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        """Every rank's ``obj`` on the leader (None elsewhere). An ``all_gather``: the messages are
        small (a fragment's key and checksum, or an error), and gloo's gather needs equal sizes too."""
        found = self.all_gather(obj, what)
        return found if self.leader else None

    def broadcast(self, obj: Any, what: str) -> Any:
        """The leader's ``obj`` on every rank: its length (int64), checked, then its bytes."""
        import torch
        import torch.distributed as dist

        data = encode(obj) if self.leader else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._call(what, lambda: dist.broadcast(size, src=self.ranks[0], group=self.group))
        n = self._length(int(size.item()), 0, what)
        box = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.leader else torch.empty(n, dtype=torch.uint8)
        self._call(what, lambda: dist.broadcast(box, src=self.ranks[0], group=self.group))
        return self._decode(box, 0, what)

    def _length(self, n: int, rank: int, what: str) -> int:
        """A message's length as a rank announced it, checked before anything of that size is allocated."""
        if not 0 < n <= MAX_MESSAGE_BYTES:
            raise GroupFailed(f"rank {rank} of the checkpoint's process group announced a message of {n} bytes while "
                              f"{what} (a message is 1 to {MAX_MESSAGE_BYTES} bytes): {_FOREIGN}")
        return n

    def _decode(self, t: Any, rank: int, what: str) -> Any:
        try:
            return decode(t.numpy().tobytes())
        except BadMessage as e:
            raise GroupFailed(f"rank {rank} of the checkpoint's process group sent a message that is not one of the "
                              f"checkpointer's while {what} ({e}): {_FOREIGN}") from None

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank the first error any rank met (``error``: this rank's, or None)."""
        found = self.all_gather(RemoteError.of(self.rank, error) if error is not None else None, what)
        first = next((e for e in found if e is not None), None)
        if first is not None:
            if error is not None and first.rank == self.rank:
                raise error
            raise first.exception()
