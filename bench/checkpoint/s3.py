"""The S3 benchmark: ckptlib on S3 against ``torch.save`` + upload and download + ``torch.load``.

``ckpt bench --s3 --s3-state resnet`` calls :func:`run_s3_benchmark`. The state is a ResNet-50's
and its SGD momentum buffers (``resnet.py``). Both systems save the same state to the same S3 server, twice (the second
after one more training step), and restore the latest from a fresh reader:

* ``ckptlib``: ``Checkpointer("s3://...").save`` (small tensors packed; the second save is a delta)
  and ``Checkpointer(...).restore()``; objects = what landed under the run's prefix.
* ``ckptlib (flat)``: the same tensors as one flat dict of dotted names (``ResNetTraining.state_flat``:
  a ``save(step, model.state_dict())``), side by side with the nested form in the same run.
* ``torch.save+upload``: ``torch.save`` to a local file, then one upload with s3fs (multipart for
  large files); restore = download with s3fs to a local file, then ``torch.load(weights_only=True)``.

The S3 server is a SeaweedFS started on loopback for the run (the same one the tests use), or the
endpoint in ``AWS_ENDPOINT_URL`` with the environment's credentials when ``endpoint`` is "env".
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .resnet import ResNetTraining
from .trees import tensors

BUCKET = "ckpt-bench"
Progress = Callable[[str], None]


def run_s3_benchmark(endpoint: str = "local", repeats: int = 3, progress: Progress = lambda _m: None) -> dict[str, Any]:
    """Both systems on one S3 server; returns {"state": ..., "systems": {name: figures}}."""
    with s3_server(endpoint, "ckpt-bench-s3-", progress) as (options, work):
        return _measure(options, work, repeats, progress)


@contextmanager
def s3_server(endpoint: str, prefix: str, progress: Progress,
              bucket: str = BUCKET) -> Iterator[tuple[dict[str, Any], str]]:
    """(storage options, a scratch folder) of a benchmark's S3 server: a SeaweedFS started on
    loopback with ``bucket`` (``endpoint`` "local"; stopped at the end), or the environment's
    (``AWS_ENDPOINT_URL`` and its credentials: no options). The folder is removed at the end."""
    work = tempfile.mkdtemp(prefix=prefix)
    server = None
    try:
        options: dict[str, Any] = {}
        if endpoint == "local":
            from deployments.local_services import SeaweedFS

            progress("starting SeaweedFS on loopback")
            server = SeaweedFS.start(os.path.join(work, "seaweedfs"))
            server.create_bucket(bucket)
            options = dict(server.storage_options)
        yield options, work
    finally:
        if server is not None:
            server.stop(grace=1.0)
        shutil.rmtree(work, ignore_errors=True)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _measure(options: dict, work: str, repeats: int, progress: Progress) -> dict[str, Any]:
    training = ResNetTraining()
    training.step()
    states, flat = [training.state()], [training.state_flat()]
    training.step()
    states.append(training.state())
    flat.append(training.state_flat())
    count = len(tensors(states[-1]))
    nbytes = sum(t.numel() * t.element_size() for t in tensors(states[-1]))
    progress(f"state: {count} tensors, {nbytes / 2**20:.1f} MiB")
    return {"state": {"tensors": count, "bytes": nbytes},
            "systems": {"ckptlib": _measure_ckptlib(states, options, repeats, progress),
                        "ckptlib (flat)": _measure_ckptlib(flat, options, repeats, progress, "ckptlib (flat)"),
                        "torch.save+upload": _measure_torch_save(states, options, work, repeats, progress)}}


def _measure_ckptlib(states: list[Any], options: dict, repeats: int, progress: Progress,
                     name: str = "ckptlib") -> dict[str, float]:
    from ckptlib import Checkpointer
    from ckptlib.store import Store

    saves, restores, objects = [], [], []
    for r in range(repeats):
        url = f"s3://{BUCKET}/ckptlib-{uuid.uuid4().hex[:8]}"
        with Checkpointer(url, options) as ck:
            for step, state in enumerate(states):
                _, dt = _timed(lambda ck=ck, step=step, state=state: ck.save(step, state))
                saves.append((step, dt))
        objects.append(sum(1 for _ in Store.from_url(url, options).scan()))  # chunks, manifests, marker
        with Checkpointer(url, options) as reader:
            restored, dt = _timed(reader.restore)
        restores.append(dt)
        del restored
        progress(f"{name} run {r + 1}/{repeats}: save {saves[-2][1]:.2f}/{saves[-1][1]:.2f} s, restore {dt:.2f} s")
    return _figures(saves, restores, statistics.median(objects))


def _measure_torch_save(states: list[Any], options: dict, work: str, repeats: int,
                        progress: Progress) -> dict[str, float]:
    import s3fs

    fs = s3fs.S3FileSystem(**options, use_listings_cache=False)
    saves, restores = [], []
    for r in range(repeats):
        key = f"{BUCKET}/torch-save-{uuid.uuid4().hex[:8]}"
        for step, state in enumerate(states):
            path = os.path.join(work, f"{step}.pt")

            def save_and_upload(state: Any = state, path: str = path, step: int = step, key: str = key) -> None:
                with open(path, "wb") as f:
                    torch.save(state, f)
                fs.put_file(path, f"{key}/{step}.pt")

            _, dt = _timed(save_and_upload)
            saves.append((step, dt))
        local = os.path.join(work, "download.pt")

        def download_and_load(key: str = key, local: str = local) -> Any:
            fs.get_file(f"{key}/{len(states) - 1}.pt", local)
            return torch.load(local, weights_only=True)

        restored, dt = _timed(download_and_load)
        restores.append(dt)
        del restored
        progress(f"torch.save+upload run {r + 1}/{repeats}: save {saves[-1][1]:.2f} s, restore {dt:.2f} s")
    return _figures(saves, restores, 1)


def _figures(saves: list[tuple[int, float]], restores: list[float], objects: float) -> dict[str, float]:
    """Medians over the repeats: the first save (everything new), the second (after one more
    training step), the restore of the latest."""
    return {"save_first_s": statistics.median(dt for step, dt in saves if step == 0),
            "save_second_s": statistics.median(dt for step, dt in saves if step == 1),
            "restore_s": statistics.median(restores), "objects": objects}


def render_s3(result: dict[str, Any]) -> str:
    st = result["state"]
    base = result["systems"]["torch.save+upload"]
    lines = [f"S3 benchmark: {st['tensors']} tensors, {st['bytes'] / 2**20:.1f} MiB (ResNet-50 + SGD momentum)",
             "| system | first save s | second save s | restore s | objects per run |",
             "|---|---|---|---|---|"]
    for name, r in result["systems"].items():
        lines.append(f"| {name} | {r['save_first_s']:.2f} | {r['save_second_s']:.2f} | {r['restore_s']:.2f} | "
                     f"{r['objects']:g} |")
    for name in ("ckptlib", "ckptlib (flat)"):
        ours = result["systems"].get(name)
        if ours is not None:
            lines.append(f"{name} / torch.save+upload: first save {ours['save_first_s'] / base['save_first_s']:.2f}x, "
                         f"second save {ours['save_second_s'] / base['save_second_s']:.2f}x, restore "
                         f"{ours['restore_s'] / base['restore_s']:.2f}x (target: <= 1x)")
    return "\n".join(lines)
