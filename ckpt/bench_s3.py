"""The S3 benchmark: ckptlib on S3 against ``torch.save`` + upload and download + ``torch.load``.

``ckpt bench --s3`` calls :func:`run_s3_benchmark`. The state is a ResNet-50's (torchvision's
parameter names and shapes, built here in plain torch) and its SGD momentum buffers after one real
training step: 481 tensors, 195 MiB, most of them small (BatchNorm vectors) — the case where one
object per tensor cost most. Both systems save the same state to the same S3 server, twice (the
second after one more training step), and restore the latest from a fresh reader:

* ``ckptlib``: ``Checkpointer("s3://...").save`` (small tensors packed; the second save is a delta)
  and ``Checkpointer(...).restore()``; objects = what landed under the run's prefix.
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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

BUCKET = "ckpt-bench"


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))


class ResNet50(nn.Module):
    """torchvision's resnet50 layout (same state_dict names and shapes), without torchvision."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = self._layer(64, 3)
        self.layer2 = self._layer(128, 4, stride=2)
        self.layer3 = self._layer(256, 6, stride=2)
        self.layer4 = self._layer(512, 3, stride=2)
        self.fc = nn.Linear(2048, num_classes)

    def _layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        down = None
        if stride != 1 or self.inplanes != planes * 4:
            down = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride=stride, bias=False),
                                 nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, down)]
        self.inplanes = planes * 4
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


class ResNetTraining:
    """A ResNet-50 and SGD with momentum on small random images: real states, quickly."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.model = ResNet50()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        x = torch.randn(2, 3, 32, 32, generator=self.gen)
        y = torch.randint(0, 1000, (2,), generator=self.gen)
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def state(self) -> dict[str, Any]:
        """Model state_dict + the optimizer's momentum buffers: 481 tensors (a copy)."""
        sd = {k: v.clone() for k, v in self.model.state_dict().items()}
        opt = self.opt.state_dict()
        return {"model": sd, "optimizer": {"state": {i: {k: v.clone() if torch.is_tensor(v) else v
                                                         for k, v in s.items()} for i, s in opt["state"].items()},
                                           "param_groups": opt["param_groups"]}}


def count_tensors(state: Any) -> int:
    if torch.is_tensor(state):
        return 1
    if isinstance(state, dict):
        return sum(count_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(count_tensors(v) for v in state)
    return 0


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def run_s3_benchmark(endpoint: str = "local", repeats: int = 3,
                     progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Both systems on one S3 server; returns {"state": ..., "systems": {name: figures}}."""
    work = tempfile.mkdtemp(prefix="ckpt-bench-s3-")
    server = None
    try:
        if endpoint == "local":
            from deployments.local_services import SeaweedFS

            progress("starting SeaweedFS on loopback")
            server = SeaweedFS.start(os.path.join(work, "seaweedfs"))
            server.create_bucket(BUCKET)
            options = dict(server.storage_options)
        else:
            options = {}  # the environment's AWS_ENDPOINT_URL and credentials
        return _measure(options, work, repeats, progress)
    finally:
        if server is not None:
            server.stop(grace=1.0)
        shutil.rmtree(work, ignore_errors=True)


def _measure(options: dict, work: str, repeats: int, progress: Callable[[str], None]) -> dict[str, Any]:
    import s3fs

    from ckptlib import Checkpointer
    from ckptlib.store import Store

    training = ResNetTraining()
    training.step()
    states = [training.state()]
    training.step()
    states.append(training.state())
    nbytes = sum(t.numel() * t.element_size() for t in _all_tensors(states[-1]))
    progress(f"state: {count_tensors(states[-1])} tensors, {nbytes / 2**20:.1f} MiB")
    fs = s3fs.S3FileSystem(**options, use_listings_cache=False)
    out: dict[str, Any] = {"state": {"tensors": count_tensors(states[-1]), "bytes": nbytes}, "systems": {}}

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
        progress(f"ckptlib run {r + 1}/{repeats}: save {saves[-2][1]:.2f}/{saves[-1][1]:.2f} s, restore {dt:.2f} s")
    out["systems"]["ckptlib"] = _figures(saves, restores, statistics.median(objects))

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
    out["systems"]["torch.save+upload"] = _figures(saves, restores, 1)
    return out


def _figures(saves: list[tuple[int, float]], restores: list[float], objects: float) -> dict[str, float]:
    """Medians over the repeats: the first save (everything new), the second (after one more
    training step), the restore of the latest."""
    return {"save_first_s": statistics.median(dt for step, dt in saves if step == 0),
            "save_second_s": statistics.median(dt for step, dt in saves if step == 1),
            "restore_s": statistics.median(restores), "objects": objects}


def _all_tensors(state: Any) -> list[torch.Tensor]:
    if torch.is_tensor(state):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _all_tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _all_tensors(v)]
    return []


def render_s3(result: dict[str, Any]) -> str:
    st = result["state"]
    ours, base = result["systems"]["ckptlib"], result["systems"]["torch.save+upload"]
    lines = [f"S3 benchmark: {st['tensors']} tensors, {st['bytes'] / 2**20:.1f} MiB (ResNet-50 + SGD momentum)",
             "| system | first save s | second save s | restore s | objects per run |",
             "|---|---|---|---|---|"]
    for name, r in result["systems"].items():
        lines.append(f"| {name} | {r['save_first_s']:.2f} | {r['save_second_s']:.2f} | {r['restore_s']:.2f} | "
                     f"{r['objects']:g} |")
    lines.append(f"ckptlib / torch.save+upload: first save {ours['save_first_s'] / base['save_first_s']:.2f}x, "
                 f"second save {ours['save_second_s'] / base['save_second_s']:.2f}x, restore "
                 f"{ours['restore_s'] / base['restore_s']:.2f}x (target: <= 1x)")
    return "\n".join(lines)
