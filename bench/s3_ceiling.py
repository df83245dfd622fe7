"""``ckpt bench --s3``: ckptlib's save and restore of a dense state on S3 against the store's own speed.

The state: float32 tensors shaped like a transformer's layers (``dense_state``: per layer a QKV, an
output, an MLP up and down matrix, two norm weights), random, ``size_mib`` in all. Two systems, each
in a child process of its own (``python -m bench.s3_ceiling <json config>``, the store's credentials
in ``CKPT_STORAGE_OPTIONS``, never on a command line), so one's freed memory is not the next one's
baseline:

* ``ckptlib``: ``Checkpointer(url).save(0, state)`` (durable when it returns), then a fresh
  ``Checkpointer(url).restore(0, into=state)``: in place, as a job resumes into its model. With
  ``keyframe_every`` (``--s3-keyframe-every 32,1`` when run as ``python -m bench.s3_ceiling``), one
  row per value, each Checkpointer made with it: ``1`` is the low-memory mode (no delta base kept).
* ``s3fs-parallel``: the ceiling on this machine. The same bytes, cut into objects of ckptlib's chunk
  size (``auto_chunk_bytes``), uploaded with s3fs's ``pipe_file`` from as many threads as
  ckptlib's pool has (``default_threads``), then downloaded with ``cat_file`` from as many and
  copied into the state's tensors. Same endpoint, same credentials, same s3fs settings (the
  filesystem is ckptlib's own ``S3Store.fs``).

Before the restore the state is zeroed; after it, its digest must equal the saved one (else the
child fails). ``peak_extra_mib``: the largest RSS above the baseline (the child with its state
built, freed heap returned) over the save and over the restore (``bench.checkpoint.probes.PeakRss``:
the kernel's exact high-water mark where it can be reset, else 1 ms sampling).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.checkpoint.s3 import Progress, s3_server

BUCKET = "ckpt-bench-ceiling"
SYSTEMS = ("ckptlib", "s3fs-parallel")
TARGET_PEAK_FRACTION = 0.3  # peak RSS above baseline, as a fraction of the state (the target)
ROOT = Path(__file__).resolve().parent.parent


def dense_state(size_mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``size_mib`` MiB (at least one layer) of random float32 tensors named and shaped like a
    transformer's: an embedding, then layers whose width is the largest power of two up to 1024
    that gives 4 of them (the embedding's rows take what whole layers leave)."""
    target = size_mib << 20
    d = 1024
    while d > 64 and 4 * _layer_bytes(d) > target:
        d //= 2
    gen = torch.Generator().manual_seed(seed)
    shapes = {"attn.qkv": (3 * d, d), "attn.out": (d, d), "mlp.up": (4 * d, d), "mlp.down": (d, 4 * d),
              "norm1": (d,), "norm2": (d,)}
    layers = max(1, target // _layer_bytes(d))
    rows = (target - layers * _layer_bytes(d)) // (4 * d)  # the rest: an embedding's rows
    state = {"embed": torch.randn((rows, d), generator=gen)} if rows > 0 else {}
    state.update({f"layers.{i}.{name}": torch.randn(shape, generator=gen)
                  for i in range(layers) for name, shape in shapes.items()})
    return state


def _layer_bytes(d: int) -> int:
    return (12 * d * d + 2 * d) * 4


def state_digest(state: dict[str, torch.Tensor]) -> str:
    from ckptlib import codecs

    return codecs.checksum("\n".join(f"{k}:{codecs.checksum(v.numpy().view(np.uint8).reshape(-1))}"
                                     for k, v in state.items()).encode())


# ------------------------------------------------------------------------------------- the runner


def run_s3_ceiling(size_mib: int = 1024, endpoint: str = "local", progress: Progress = lambda _m: None,
                   timeout: float = 1800, keyframe_every: tuple[int | None, ...] = (None,)) -> list[dict[str, Any]]:
    """One row per system (``SYSTEMS``) on one S3 server: SeaweedFS started on loopback for the run
    (``endpoint="local"``), or ``AWS_ENDPOINT_URL`` with the environment's credentials ("env"; its
    bucket ``BUCKET`` must exist). ckptlib: a row per ``keyframe_every`` (None: the default)."""
    if size_mib < 1:
        raise ValueError(f"--s3-size-mib must be at least 1, got {size_mib}")
    if not keyframe_every or any(k is not None and (not isinstance(k, int) or k < 1) for k in keyframe_every):
        raise ValueError(f"--s3-keyframe-every must list positive integers, got {keyframe_every!r}")
    runs = [(system, k) for system in SYSTEMS for k in (keyframe_every if system == "ckptlib" else (None,))]
    with s3_server(endpoint, "ckpt-bench-ceiling-", progress, BUCKET) as (options, _work):
        rows = []
        for system, k in runs:
            name = system if k is None else f"{system} (keyframe_every={k})"
            progress(f"{name}: save and restore of {size_mib} MiB ...")
            cfg = {"system": system, "size_mib": size_mib, "url": f"s3://{BUCKET}/{system}-{uuid.uuid4().hex[:8]}",
                   "keyframe_every": k}
            rows.append(_run_child(cfg, options, timeout))
            progress(f"{name}: save {rows[-1]['save_s']:.2f} s, restore {rows[-1]['restore_s']:.2f} s, "
                     f"peak +{rows[-1]['peak_extra_mib']:.0f} MiB")
        return rows


def _run_child(cfg: dict[str, Any], options: dict, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if options:
        env["CKPT_STORAGE_OPTIONS"] = json.dumps(options)
    proc = subprocess.run([sys.executable, "-m", "bench.s3_ceiling", json.dumps(cfg)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the {cfg['system']} run of the S3 benchmark failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def render(rows: list[dict[str, Any]]) -> str:
    """A plain-text table, one row per system, the ratios ckptlib / s3fs-parallel and the targets."""
    first = rows[0]
    head = (f"{'system':<14} {'save s':>8} {'restore s':>9} {'peak +MiB':>9} {'(restore)':>9} {'bytes stored':>13} "
            f"{'objects':>7}")
    lines = [f"S3 benchmark: {first['state_bytes'] / 2**20:.0f} MiB of float32 in {first['tensors']} tensors, "
             f"{first['chunk_bytes'] >> 10} KiB chunks, {first['threads']} threads",
             head, "-" * len(head)]
    for r in rows:
        lines.append(f"{_label(r):<14} {r['save_s']:>8.2f} {r['restore_s']:>9.2f} {r['peak_extra_mib']:>9.1f} "
                     f"{r['peak_restore_extra_mib']:>9.1f} {r['bytes']:>13,} {r['objects']:>7}")
    ceiling = next((r for r in rows if r["system"] == "s3fs-parallel"), None)
    for ours in (r for r in rows if r["system"] == "ckptlib"):
        lines.append("")
        if ceiling:
            lines.append(f"{_label(ours)} / s3fs-parallel: save {ours['save_s'] / ceiling['save_s']:.2f}x, "
                         f"restore {ours['restore_s'] / ceiling['restore_s']:.2f}x, peak "
                         f"{ours['peak_extra_mib'] / max(ceiling['peak_extra_mib'], 1e-9):.2f}x, bytes stored "
                         f"{ours['bytes'] / max(ceiling['bytes'], 1):.2f}x")
        frac = ours["peak_extra_mib"] / (ours["state_bytes"] / 2**20)
        met = "met" if frac <= TARGET_PEAK_FRACTION else "NOT met"
        lines.append(f"{_label(ours)} peak above baseline: {frac:.2f}x the state (target <= {TARGET_PEAK_FRACTION}x: "
                     f"{met})")
    return "\n".join(lines)


def _label(row: dict[str, Any]) -> str:
    k = row.get("keyframe_every")
    return row["system"] if k is None else f"{row['system']} k={k}"


# ------------------------------------------------------------------------------- one system's run


Phase = Callable[[], Callable[[], None]]  # untimed set-up (a client opened) -> the timed work


def _measure(state: dict[str, torch.Tensor], save: Phase, restore: Phase) -> dict:
    """Time ``save`` and ``restore`` (the state zeroed between them; each one's set-up untimed),
    the peak RSS above the RSS before each, and check that the restore gave the saved bytes back."""
    from bench.checkpoint.probes import PeakRss, release_free_memory, rss_bytes

    digest = state_digest(state)
    out: dict[str, Any] = {}
    for phase, setup in (("save", save), ("restore", restore)):
        if phase == "restore":
            for t in state.values():
                t.zero_()
        fn = setup()
        release_free_memory()
        base = rss_bytes() or 0
        with PeakRss() as peak:
            t0 = time.perf_counter()
            fn()
            out[f"{phase}_s"] = time.perf_counter() - t0
        out[f"peak_{phase}_extra_mib"] = max(0, (peak.peak or base) - base) / 2**20
    if state_digest(state) != digest:
        raise RuntimeError("the restored state differs from the saved one")
    out["peak_extra_mib"] = max(out["peak_save_extra_mib"], out["peak_restore_extra_mib"])
    out["peak_method"] = PeakRss.method
    return out


def _pieces(state: dict[str, torch.Tensor], chunk_bytes: int) -> Iterator[list[memoryview]]:
    """The state's bytes, in order, as lists of views of ``chunk_bytes`` in all (the last: the rest)."""
    piece: list[memoryview] = []
    room = chunk_bytes
    for t in state.values():
        view = memoryview(t.numpy().view(np.uint8).reshape(-1).data)
        while len(view):
            piece.append(view[:room])
            room -= len(piece[-1])
            view = view[len(piece[-1]):]
            if room == 0:
                yield piece
                piece, room = [], chunk_bytes
    if piece:
        yield piece


def _ceiling(state: dict[str, torch.Tensor], store: Any, threads: int, chunk_bytes: int) -> tuple[Phase, Phase]:
    """Save and restore of the ceiling: one object per chunk, ``threads`` requests at a time; the
    set-up of each is a request that opens s3fs's connection (as ckptlib's opening does)."""
    pieces = list(_pieces(state, chunk_bytes))
    paths = [f"{store.bucket}/{store.prefix}/{i:06d}" for i in range(len(pieces))]
    fs, timeout = store.fs, store.timeout_s

    def put(i: int) -> None:
        views = pieces[i]  # bytes: the request's body, as ckptlib's put hands it over
        fs.pipe_file(paths[i], bytes(views[0]) if len(views) == 1 else b"".join(views), timeout=timeout)

    def get(i: int) -> None:
        data = memoryview(fs.cat_file(paths[i], timeout=timeout))
        for view in pieces[i]:
            view[:] = data[:len(view)]
            data = data[len(view):]

    def run(fn: Callable[[int], None]) -> None:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(fn, range(len(pieces))))

    def opened(fn: Callable[[int], None]) -> Callable[[], None]:
        store.check()
        return lambda: run(fn)

    return (lambda: opened(put)), (lambda: opened(get))


def _ckptlib(state: dict[str, torch.Tensor], url: str, options: dict, keyframe_every: int | None) -> tuple[Phase, Phase]:
    """``save`` then ``restore(into=)``, each by a Checkpointer opened (untimed) for it alone and
    closed (timed: a close waits for what is in flight); ``keyframe_every``: its option (None: the
    default)."""
    from ckptlib import Checkpointer

    extra = {} if keyframe_every is None else {"keyframe_every": keyframe_every}

    def opened(work: Callable[[Checkpointer], Any]) -> Callable[[], None]:
        ck = Checkpointer(url, options, **extra)

        def run() -> None:
            with ck:
                work(ck)
        return run

    return (lambda: opened(lambda ck: ck.save(0, state))), (lambda: opened(lambda ck: ck.restore(0, into=state)))


def child_main(cfg: dict[str, Any]) -> dict[str, Any]:
    """One system's save and restore (see the module docstring); the row."""
    from ckptlib.checkpointer import default_threads
    from ckptlib.chunking import auto_chunk_bytes
    from ckptlib.store import Store

    options = json.loads(os.environ.get("CKPT_STORAGE_OPTIONS", "{}"))
    state = dense_state(int(cfg["size_mib"]))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    store = Store.from_url(cfg["url"], options)
    threads, chunk_bytes = default_threads(store), auto_chunk_bytes(nbytes)
    if cfg["system"] == "ckptlib":
        save, restore = _ckptlib(state, cfg["url"], options, cfg.get("keyframe_every"))
    elif cfg["system"] == "s3fs-parallel":
        save, restore = _ceiling(state, store, threads, chunk_bytes)
    else:
        raise ValueError(f"unknown system {cfg['system']!r}: use one of {', '.join(SYSTEMS)}")
    row = {"system": cfg["system"], **_measure(state, save, restore)}
    stored = list(store.scan())
    return {**row, "bytes": sum(o.size for o in stored), "objects": len(stored), "state_bytes": nbytes,
            "tensors": len(state), "chunk_bytes": chunk_bytes, "threads": threads,
            "keyframe_every": cfg.get("keyframe_every")}


def keyframe_values(text: str) -> tuple[int | None, ...]:
    """``"default,1"`` -> ``(None, 1)``: the ``keyframe_every`` of each ckptlib row (None: the default)."""
    try:
        ks = tuple(None if k.strip() == "default" else int(k) for k in text.split(","))
    except ValueError:
        ks = ()
    if not ks or any(k is not None and k < 1 for k in ks):
        raise ValueError(f"--s3-keyframe-every must list positive integers or 'default', got {text!r}")
    return ks


def main(argv: list[str]) -> None:
    """``python -m bench.s3_ceiling [--s3-size-mib N] [--s3-endpoint local|env] [--s3-keyframe-every
    32,1]``: the benchmark with ckptlib's rows per ``keyframe_every`` (what ``ckpt bench --s3`` runs
    with the default only); a JSON config instead: one system's run (the child)."""
    if argv and argv[0].startswith("{"):
        print(json.dumps(child_main(json.loads(argv[0]))), flush=True)
        return
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.s3_ceiling", description=__doc__.splitlines()[0])
    parser.add_argument("--s3-size-mib", type=int, default=1024)
    parser.add_argument("--s3-endpoint", choices=("local", "env"), default="local")
    parser.add_argument("--s3-keyframe-every", default="default",
                        help="comma-separated values of ckptlib's keyframe_every, a row each ('default': its own)")
    args = parser.parse_args(argv)
    try:
        ks = keyframe_values(args.s3_keyframe_every)
    except ValueError as e:
        parser.error(str(e))
    rows = run_s3_ceiling(args.s3_size_mib, args.s3_endpoint, lambda m: print(m, file=sys.stderr, flush=True),
                          keyframe_every=ks)
    print(render(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
