"""The live table of ``ckpt train``: each shard's beat, each checkpoint and each recovery, read from the store.

``Progress`` polls the run's heartbeats, manifests and verdicts from a thread of its own, so the
table looks the same whichever task runner trains the shards (threads, Dask, a work pool); rich
renders it (``Live(progress)``). A failure to read is shown in the table, never raised: the
display must not break the run.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptlib.heartbeat import Beat
    from ckptlib.store import Store
    from ckptlib.validate import Verdict

STATUS_STYLE = {"running": "yellow", "finished": "green", "failed": "red", "fenced": "magenta"}


class Progress:
    """Reads heartbeats, manifests and verdicts of one run every ``every_s`` seconds (own thread)."""

    def __init__(self, url: str, storage_options: dict | None, params: Any, every_s: float = 0.5):
        self.url, self.so, self.params, self.every_s = url, storage_options, params, every_s
        self.beats: dict[str, Beat] = {}
        self.manifests: dict[int, dict] = {}
        self.verdicts: dict[int, Verdict] = {}
        self.recoveries: dict[str, Any] = {}  # key -> trainrun.recovery.Recovery
        self.error: str | None = None
        self._store: Store | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-train-progress", daemon=True)
        self.started = time.time()

    def start(self) -> Progress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.poll()  # the final state
        except Exception:  # noqa: BLE001 - the display must never break the run
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - the display must never break the run
                self.error = f"{type(e).__name__}: {e}"

    def poll(self) -> None:
        from ckptlib import commit
        from ckptlib.heartbeat import read_heartbeats
        from ckptlib.store import Store
        from ckptlib.validate import read_verdict

        if self._store is None:
            self._store = Store.from_url(self.url, self.so)
        store = self._store
        self.beats = {p: b for p, b in read_heartbeats(store).items() if b.time >= self.started - 1}
        for step in commit.committed_steps(store):
            if step not in self.manifests:
                m = commit.read_manifest(store, step)
                self.manifests[step] = {"step": step, "bytes_written": m.bytes_written,
                                        "logical_bytes": m.logical_bytes, "kind": m.kind, "digest": m.digest,
                                        "loss": m.meta.get("loss"), "eval_loss": m.meta.get("eval_loss")}
        for step in self.manifests:
            if step not in self.verdicts:
                verdict = read_verdict(store, step)
                if verdict is not None:
                    self.verdicts[step] = verdict
        self._poll_recoveries(store)

    def _poll_recoveries(self, store: Store) -> None:
        from trainrun.recovery import Recovery

        for info in store.scan("recoveries"):
            if info.key not in self.recoveries and info.modified >= self.started - 1:
                try:
                    self.recoveries[info.key] = Recovery.from_json(store.get(info.key), info.key)
                except Exception:  # noqa: BLE001 - the display must never break the run
                    continue

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        p = self.params
        done_rounds = max([b.round for b in self.beats.values() if b.status == "finished"] +
                          list(self.manifests), default=0)
        head = Text.assemble(("training ", "bold"), (f"{p.workload}", "cyan"),
                             f" · {p.shards} shards · {p.rounds} rounds × {p.steps_per_round} steps · ",
                             (self.url, "dim"), f"   {time.time() - self.started:5.0f} s")
        bar = Table.grid(padding=(0, 1))
        bar.add_row(Text(f"rounds {done_rounds}/{p.rounds}", style="bold"),
                    ProgressBar(total=p.rounds, completed=done_rounds, width=40))
        parts = [head, bar, self._shards(), Text("checkpoints", style="bold"), self._checkpoints()]
        if self.recoveries:
            parts += [Text("recoveries", style="bold"), self._recoveries()]
        if self.error:
            parts.append(Text(f"(progress display: {self.error})", style="dim"))
        return Group(*parts)

    def _shards(self) -> Any:
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False, show_header=True, header_style="dim")
        for col in ("shard", "round", "step", "ckpt at", "loss", "status", "attempt", "gen"):
            table.add_column(col, justify="right" if col not in ("shard", "status") else "left")
        for part in sorted(self.beats, key=lambda s: (len(s), s)):
            b = self.beats[part]
            step = "-" if b.round_step is None else f"{b.round_step}/{b.steps_per_round or self.params.steps_per_round}"
            ckpt = b.meta.get("checkpoint_step") if isinstance(b.meta, dict) else None
            table.add_row(part, str(b.round), step, "-" if ckpt is None else str(ckpt), loss_text(b.loss),
                          Text(b.status, style=STATUS_STYLE.get(b.status, "")), str(b.attempt or "-"),
                          str(b.generation))
        return table

    def _recoveries(self) -> Any:
        from rich.table import Table

        table = Table(box=None, pad_edge=False, header_style="dim")
        for col in RECOVERY_COLUMNS:
            table.add_column(col, justify="left" if col in ("shard", "kind") else "right")
        rows = sorted(self.recoveries.values(), key=lambda r: (r.round, r.failed_at or 0.0))
        for r in rows[-8:]:
            table.add_row(*recovery_cells(r.row()))
        return table

    def _checkpoints(self) -> Any:
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False, header_style="dim")
        for col in ("step", "loss", "eval", "written", "full copy", "ratio", "kind", "valid"):
            table.add_column(col, justify="right")
        for step in sorted(self.manifests)[-12:]:
            m = self.manifests[step]
            v = self.verdicts.get(step)
            valid = Text("…", style="dim") if v is None else (Text("✓", style="green") if v.passed
                                                             else Text("✗ " + ",".join(v.failed), style="red"))
            table.add_row(str(step), loss_text(m["loss"]), loss_text(m["eval_loss"]), size_text(m["bytes_written"]),
                          size_text(m["logical_bytes"]), f"{m['logical_bytes'] / max(m['bytes_written'], 1):.2f}x",
                          m["kind"], valid)
        return table


def loss_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def size_text(n: float | None) -> str:
    """Bytes in decimal units (``89.9 MB``), as the summary prints them."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


RECOVERY_COLUMNS = ("shard", "round", "kind", "failed at", "resumed at", "recomputed", "detect", "back to training")


def recovery_cells(row: dict[str, Any]) -> tuple[str, ...]:
    """A recovery row (``trainrun.recovery.Recovery.row``) as the table's cells."""
    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} s"

    kind = row["kind"] + (f" ({row['cause']})" if row.get("cause") and row["cause"] != row["kind"] else "")
    return (f"shard-{row['shard']}", str(row["round"]), kind, str(row["failed_at_step"]), str(row["resumed_at_step"]),
            str(row["steps_recomputed"]), secs(row["detect_s"]), secs(row["back_to_training_s"]))


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """``ckpt train``'s summary lines of shard checkpoints and recoveries."""
    sc = summary.get("shard_checkpoints") or {}
    lines = []
    if sc.get("count"):
        lines.append(f"  shard ckpts     {sc['count']} written (every {sc['every']}), {size_text(sc['bytes_written'])}; "
                     f"loops waited {sc['blocked_s']:.2f} s ({sc['blocked_share_of_train']:.2%} of training), "
                     f"background writes {sc['write_s']:.1f} s")
    for row in summary.get("recoveries") or []:
        c = recovery_cells(row)
        lines.append(f"  recovery        {c[0]} round {c[1]}: {c[2]} at step {c[3]}, resumed at {c[4]} "
                     f"({c[5]} steps recomputed, from {row.get('source') or 'cut'}), detected in {c[6]}, "
                     f"training again {c[7]} later")
    return lines
