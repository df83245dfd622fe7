"""The channel between the ranks of a collective ``Checkpointer``: a gloo process group of its own.

The group is created when the Checkpointer is (every rank of ``process_group`` constructs one), with
the ranks of ``process_group``, and it carries only the checkpointer's own messages: small Python
objects (plans, reports, outcomes), never tensors. So a background save never runs a collective on
the training loop's group (which would interleave with the training collectives and deadlock),
and an NCCL job needs no GPU for it. Per save: one ``all_gather`` in the foreground (the plan), one
``gather`` and one ``broadcast`` once the rank fragments are written (the leader's commit and its
outcome); per restore: one ``broadcast`` (the step) and two ``all_gather`` (the checks, the outcome).
At most one save or restore uses it at a time (a Checkpointer drains its save in flight first).

Every exchange carries errors as values: a rank that fails sends its error instead of its part,
and every rank raises it (the same class, naming the rank), so the ranks never disagree about an
outcome. A rank that dies or hangs fails the exchange (gloo notices a closed connection at once,
a hang after ``timeout_s``): ``GroupFailed`` on the other ranks, and nothing is committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import errors
from ..errors import CheckpointError

__all__ = ["Collective", "GroupFailed", "Outcome", "RemoteError"]


class GroupFailed(CheckpointError):
    """A rank of the checkpoint's process group died, hung or left during a collective call."""


@dataclass(frozen=True)
class RemoteError:
    """An error one rank met, as it travels to the others: its class name, message and rank."""

    rank: int
    kind: str
    message: str

    @classmethod
    def of(cls, rank: int, e: BaseException) -> RemoteError:
        return cls(rank, type(e).__name__, str(e))

    def exception(self) -> BaseException:
        """The error to raise on every rank: the same ckptlib error class when it is one, else
        CheckpointError; ValueError/TypeError (a state that does not match) stay what they are."""
        text = f"rank {self.rank}: {self.message}"
        cls = getattr(errors, self.kind, None)
        if isinstance(cls, type) and issubclass(cls, CheckpointError) and cls is not errors.Damaged:
            return cls(text)
        if self.kind in ("ValueError", "TypeError", "KeyError"):
            return {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError}[self.kind](text)
        return CheckpointError(f"{text} ({self.kind})")


@dataclass(frozen=True)
class Outcome:
    """What one exchange gives every rank: a value, or the error of the first rank that failed."""

    value: Any = None
    error: RemoteError | None = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error.exception()
        return self.value


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
        import torch.distributed as dist

        out: list[Any] = [None] * self.world

        self._call(what, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        """Every rank's ``obj`` on the leader (None elsewhere)."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.leader else None
        self._call(what, lambda: dist.gather_object(obj, out, dst=self.ranks[0], group=self.group))
        return out

    def broadcast(self, obj: Any, what: str) -> Any:
        """The leader's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj if self.leader else None]
        self._call(what, lambda: dist.broadcast_object_list(box, src=self.ranks[0], group=self.group))
        return box[0]

    def agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank the first error any rank met (``error``: this rank's, or None)."""
        found = self.all_gather(RemoteError.of(self.rank, error) if error is not None else None, what)
        first = next((e for e in found if e is not None), None)
        if first is not None:
            if error is not None and first.rank == self.rank:
                raise error
            raise first.exception()
