"""Rank groups talk only to their own ranks: a private rendezvous (a FileStore in a 0700 folder), gloo
on loopback, the checkpointer's messages as JSON of a closed set of types (no pickle), a junk message
failing the group with one clear error, and every error class crossing ranks with its fields.

The two-rank cases run this file as a script in two real processes (gloo on CPU) that write what
each rank saw; the tests compare it."""

from __future__ import annotations

import ast
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from ckptlib import errors

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 20


# --- the ranks' side (run as a script) -------------------------------------------------------------

def samples() -> dict[str, BaseException]:
    """One error of every class that crosses ranks as itself, with fields where its class has them,
    and builtins: a state that does not match (ValueError...), anything else (RuntimeError)."""
    from ckptlib.distributed.collective import GroupFailed
    from ckptlib.documents import DocumentError

    special: dict[str, BaseException] = {
        "Damaged": errors.Damaged("chunks/ab/cd", "does not decode to its checksum"),
        "DamagedStep": errors.DamagedStep("step 7 is damaged: restore step 6", 7, "its manifest is not JSON"),
        "ObjectTooLarge": errors.ObjectTooLarge("manifests/7.json", None, 1024)}
    classes = [*checkpoint_errors(), DocumentError, GroupFailed]
    out = {c.__name__: special.get(c.__name__) or c(f"{c.__name__} met on purpose") for c in classes}
    out["ObjectTooLarge(size)"] = errors.ObjectTooLarge("fragments/7/a.json", 4096, 1024)
    for cls in (ValueError, TypeError, RuntimeError):
        out[cls.__name__] = cls(f"{cls.__name__} met on purpose")
    return out


def checkpoint_errors() -> list[type[errors.CheckpointError]]:
    """Every error class of ckptlib/errors.py."""
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.CheckpointError)]


def seen(e: BaseException) -> list[Any]:
    """An error as the test compares it: its class, its fields (its attributes), its message."""
    return [type(e).__name__, {k: v for k, v in vars(e).items() if not k.startswith("_")}, str(e)]


def errors_cross(coll: Any) -> dict[str, list[Any]]:
    """Each sample raised on rank 0, then on rank 1, through an agreement (restore's) and through a
    save's report and commit (the leader's outcome); what this rank raised each time."""
    from ckptlib.distributed.collective import RemoteError
    from ckptlib.distributed.saving import _report

    out: dict[str, list[Any]] = {}
    for name, e in samples().items():
        for raiser in (0, 1):
            mine = e if coll.rank == raiser else None
            for path in ("agree", "report"):
                try:
                    if path == "agree":
                        coll.agree(mine, "testing")
                    else:
                        def finish(reports: list[Any], mine: Any = mine) -> None:
                            raise mine  # the leader's own commit failed

                        report = RemoteError.of(coll.rank, mine) if mine is not None and raiser else ("k", "c")
                        _report(coll, report, finish if raiser == 0 and coll.leader else None)
                    out[f"{name} {raiser} {path}"] = ["nothing raised"]
                except BaseException as got:  # noqa: BLE001 - what the test compares
                    out[f"{name} {raiser} {path}"] = seen(got)
    return out


JUNK = {  # what a stranger's rank 1 sends instead of a message: (announced length, bytes)
    "huge": (1 << 62, b""),
    "negative": (-1, b""),
    "not json": (8, b"\x80junk!!\x00"),
    "a module to import": (None, b'{"type":"os.system","value":{"command":"touch /tmp/pwned"}}'),
    "a pickle": (None, b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00N."),
    "a summary of wrong types": (None, b'{"type":"Summary","value":{"rank":"0","save_id":1,"skeleton":"",'
                                 b'"fixed_bytes":0,"candidates":[]}}'),
    "too deep": (None, b'{"type":"tuple","value":[' * 40 + b"1" + b"]}" * 40),
}


def junk_arrives(coll: Any) -> dict[str, list[Any]]:
    """Rank 1 speaks the transport's framing with junk in it; rank 0 runs ``all_gather`` and, for the
    leader's own junk, rank 1 a ``broadcast``. What each call raised, and how long it took."""
    import torch
    import torch.distributed as dist

    out: dict[str, list[Any]] = {}
    for name, (length, data) in JUNK.items():
        t0 = time.monotonic()
        if coll.rank == 0:
            try:
                coll.all_gather("a message", "testing")
                out[name] = ["nothing raised"]
            except BaseException as e:  # noqa: BLE001
                out[name] = [*seen(e), time.monotonic() - t0]
            continue
        n = len(data) if length is None else length
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(sizes, torch.tensor([n], dtype=torch.int64), group=coll.group)
        if 0 < n < 1 << 20:  # rank 0 accepted the length: the bytes, padded as the transport does
            top = max(int(s.item()) for s in sizes)
            mine = torch.zeros(top, dtype=torch.uint8)
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dist.all_gather([torch.empty(top, dtype=torch.uint8) for _ in range(2)], mine, group=coll.group)
    t0 = time.monotonic()
    if coll.rank == 0:  # a leader that announces more than any message
        dist.broadcast(torch.tensor([1 << 40], dtype=torch.int64), src=0, group=coll.group)
    else:
        try:
            coll.broadcast(None, "testing")
            out["leader's huge"] = ["nothing raised"]
        except BaseException as e:  # noqa: BLE001
            out["leader's huge"] = [*seen(e), time.monotonic() - t0]
    return out


def rank_main(rank: int, rendezvous: str, out: str) -> None:
    import torch.distributed as dist

    from ckptlib.distributed.collective import Collective

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from datetime import timedelta

    dist.init_process_group("gloo", store=dist.FileStore(rendezvous, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=TIMEOUT_S))
    coll = Collective(dist.group.WORLD, TIMEOUT_S)
    result = {"errors": errors_cross(coll)}
    Path(out).write_text(json.dumps(result))  # (the junk may fail a rank of a collective without the checks)
    result["junk"] = junk_arrives(coll)
    coll.agree(None, "the end")  # still a working group: the junk failed calls, not the group
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


# --- the tests -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("ranks")
    with tempfile.TemporaryDirectory(prefix="rendezvous-") as private:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, __file__, str(r), f"{private}/store", str(folder / f"r{r}.json")],
                                  env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True) for r in range(2)]
        ends = [(p.communicate(timeout=120)[1], p.returncode) for p in procs]
    results = [json.loads((folder / f"r{r}.json").read_text()) for r in range(2)]
    for r, (err, code) in enumerate(ends):
        results[r]["exit"] = f"rank {r} exited {code}:\n{err[-3000:]}" if code else 0
    return results


def test_every_error_class_crosses_ranks_with_its_class_fields_and_message(two_ranks):
    assert {c.__name__ for c in checkpoint_errors()} <= set(samples())
    for name, e in samples().items():
        kind = name.split("(")[0] if isinstance(e, errors.CheckpointError) else type(e).__name__
        for raiser in (0, 1):
            for path in ("agree", "report"):
                for rank, got in enumerate(two_ranks):
                    what = f"{name} raised on rank {raiser} ({path}), seen on rank {rank}"
                    if kind == "RuntimeError":  # not ckptlib's: a CheckpointError naming it
                        want = ["CheckpointError", {}]
                    else:
                        want = [kind, seen(e)[1]]
                    cls, fields, message = got["errors"][f"{name} {raiser} {path}"]
                    if rank == raiser and path == "agree":  # its own error, raised as it was
                        assert [cls, fields, message] == [type(e).__name__, want[1], str(e)], what
                        continue
                    assert [cls, fields] == want, what
                    assert message.startswith(f"rank {raiser}: {e}"), what


def test_a_junk_message_fails_the_call_with_one_clear_error_at_once_and_nothing_runs(two_ranks):
    assert [r["exit"] for r in two_ranks] == [0, 0], two_ranks[0]["exit"] or two_ranks[1]["exit"]
    got = {**two_ranks[0]["junk"], **two_ranks[1]["junk"]}
    assert set(got) == {*JUNK, "leader's huge"}
    for name, (cls, _, message, seconds) in got.items():
        assert cls == "GroupFailed", (name, message)
        assert re.match(r"rank [01] of the checkpoint's process group (announced|sent) a message", message), message
        assert "restart the job" in message and seconds < TIMEOUT_S / 4, (name, seconds)
    assert "announced a message of 4611686018427387904 bytes" in got["huge"][2]  # refused before any allocation
    assert "unknown type 'os.system'" in got["a module to import"][2]
    assert not Path("/tmp/pwned").exists()


def test_a_rank_groups_rendezvous_is_private_and_its_sockets_listen_on_loopback_only(tmp_path):
    """A real group (trainrun.rank_group) kept warm: its folder (the FileStore) is 0700, no rank
    listens off 127.0.0.1, and ending the group removes the folder."""
    import psutil

    from tests.runs import rank_spec as spec
    from tests.runs import step_zero
    from trainrun.documents import Cut
    from trainrun.rank_group import _WARM, end_groups, train_shard_group

    s = spec()
    ck = step_zero(str(tmp_path / "run"), s)
    train_shard_group(ck, None, s, 0, 1, Cut.of_step(0), heartbeat_every_s=0.2, warm=True)
    try:
        (group,) = [g for k, g in _WARM.items() if k[0] == ck.url]
        folder = Path(group.workdir.name)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and (folder / "rendezvous").exists()
        listening = [c.laddr for r in group.ranks for c in psutil.Process(r.process.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and {a.ip for a in listening} == {"127.0.0.1"}, listening
    finally:
        end_groups(ck.url)
    assert not folder.exists()


OBJECT_COLLECTIVES = {f"{op}_object{tail}" for op in ("all_gather", "gather", "broadcast", "scatter", "send", "recv")
                      for tail in ("", "_list")}


def pickle_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Where code (not text) imports pickle, calls a torch ``*_object`` collective, or ``torch.load``
    without ``weights_only=True``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [(node.lineno, f"imports {n}") for n in names if n and n.split(".")[0] in ("pickle", "cloudpickle", "dill")]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            safe = any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords)
            if name in OBJECT_COLLECTIVES or (name == "load" and ast.unparse(node.func) == "torch.load" and not safe):
                found.append((node.lineno, ast.unparse(node.func)))
    return found


def test_no_module_of_ckptlib_or_trainrun_uses_pickle_or_an_object_collective():
    assert pickle_uses(ast.parse("import pickle\nd.all_gather_object(o, x)\ntorch.load(f)\n'torch.load(f)'")) == [
        (1, "imports pickle"), (2, "d.all_gather_object"), (3, "torch.load")]  # the scan sees code, not text
    # the store contract checks that a Store pickles for a caller's worker pool: no path of ckptlib's own
    allowed = {Path("ckptlib/testing/store_contract.py")}
    found = [f"{p.relative_to(ROOT)}:{line}: {what}" for top in ("ckptlib", "trainrun")
             for p in sorted((ROOT / top).rglob("*.py")) if p.relative_to(ROOT) not in allowed
             for line, what in pickle_uses(ast.parse(p.read_text()))]
    assert not found, found


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
