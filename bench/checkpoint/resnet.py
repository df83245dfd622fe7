"""A ResNet-50 and its SGD momentum buffers after real training steps: 481 tensors, 195 MiB, most
of them small (BatchNorm vectors), the case where one object per tensor costs most. torchvision's
parameter names and shapes, built here in plain torch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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

    def state_flat(self) -> dict[str, Any]:
        """The same 481 tensors as ``state`` as one flat dict of dotted names (a copy): the model's
        ``state_dict()`` names and each parameter's momentum buffer as ``<name>.momentum_buffer``, as
        ``ck.save(step, model.state_dict())``-style code saves it."""
        sd = {k: v.clone() for k, v in self.model.state_dict().items()}
        names = [name for name, _ in self.model.named_parameters()]
        for i, s in self.opt.state_dict()["state"].items():
            sd[f"{names[i]}.momentum_buffer"] = s["momentum_buffer"].clone()
        return sd

    def state(self) -> dict[str, Any]:
        """Model state_dict + the optimizer's momentum buffers: 481 tensors (a copy)."""
        sd = {k: v.clone() for k, v in self.model.state_dict().items()}
        opt = self.opt.state_dict()
        return {"model": sd, "optimizer": {"state": {i: {k: v.clone() if torch.is_tensor(v) else v
                                                         for k, v in s.items()} for i, s in opt["state"].items()},
                                           "param_groups": opt["param_groups"]}}
