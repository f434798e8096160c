"""Small image classifiers in plain torch: ``build_model("cnn", in_shape=(1, 8, 8))``.

Registry ``MODELS``:

* ``"mlp"``: flatten → hidden ReLU layers → logits (~10k parameters on 8x8 digits);
* ``"cnn"``: three 3x3 conv layers (16/32/64 channels), one 2x2 max-pool, adaptive average pooling to 2x2,
  one linear layer (~26k parameters on 8x8 digits, any input size);
* ``"resnet20"``: He et al. (2016), Sec. 4.2: a 3x3 stem and 3 stages x 3 basic blocks with 16/32/64 channels,
  stride 2 at the start of stages 2 and 3, global average pooling (adaptive, so 8x8 digits work as well as
  32x32 CIFAR) and one linear layer; 0.27M parameters on 3-channel input with the default option-A shortcut.

Every model's options are a frozen ``Config``; ``in_shape`` ``(C, H, W)`` and ``num_classes`` are options of every
model. Initialisation draws from torch's global RNG, so ``torch.manual_seed(s)`` before ``build_model`` (or its
``seed`` argument, which leaves the global RNG untouched) makes the weights reproducible.

Federated note: BatchNorm running statistics are buffers, not parameters, so ``ModelSpec.from_module`` (and hence
every compressed update) does not carry them; each client keeps its own. ``resnet20(norm="group")`` swaps in
GroupNorm, which has no running statistics and is the usual choice under non-IID data (Hsieh et al., 2020).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fedcomp.registry import ConfigError, Registry

MODELS: Registry[nn.Module] = Registry("model")


def _shape3(value: Any) -> tuple[int, int, int]:
    shape = tuple(int(d) for d in value)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"in_shape must be (C, H, W) with positive sizes, got {value!r}")
    return shape  # type: ignore[return-value]


def _check_common(cfg: Any) -> None:
    object.__setattr__(cfg, "in_shape", _shape3(cfg.in_shape))
    if int(cfg.num_classes) < 2:
        raise ValueError(f"num_classes must be >= 2, got {cfg.num_classes}")


@MODELS.register("mlp")
class MLP(nn.Module):
    """Flatten → ``hidden`` ReLU layers → ``num_classes`` logits."""

    @dataclass(frozen=True)
    class Config:
        in_shape: tuple[int, int, int] = (1, 8, 8)
        num_classes: int = 10
        hidden: tuple[int, ...] = (128,)

        def __post_init__(self) -> None:
            _check_common(self)
            hidden = tuple(int(h) for h in self.hidden)
            if any(h < 1 for h in hidden):
                raise ValueError(f"hidden sizes must be positive, got {self.hidden!r}")
            object.__setattr__(self, "hidden", hidden)

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = cfg = config or self.Config()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(cfg.in_shape)
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True)]
            width = h
        layers.append(nn.Linear(width, cfg.num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@MODELS.register("cnn")
class SmallCNN(nn.Module):
    """conv(w)-conv(2w)-maxpool-conv(4w) (3x3, ReLU) → adaptive avg-pool to 2x2 → linear. ``width`` w = 16."""

    @dataclass(frozen=True)
    class Config:
        in_shape: tuple[int, int, int] = (1, 8, 8)
        num_classes: int = 10
        width: int = 16
        dropout: float = 0.0

        def __post_init__(self) -> None:
            _check_common(self)
            if self.width < 1:
                raise ValueError(f"width must be positive, got {self.width}")
            if not 0.0 <= self.dropout < 1.0:
                raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = cfg = config or self.Config()
        c, w = cfg.in_shape[0], cfg.width
        self.features = nn.Sequential(
            nn.Conv2d(c, w, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2, ceil_mode=True),
            nn.Conv2d(2 * w, 4 * w, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(16 * w, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(self.features(x)))


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    return nn.GroupNorm(min(8, channels), channels)


class _BasicBlock(nn.Module):
    """Two 3x3 conv-norm layers with a residual connection (He et al., 2016, Fig. 2)."""

    def __init__(self, cin: int, cout: int, stride: int, shortcut: str, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = _norm(norm, cout)
        self.stride, self.pad = stride, cout - cin
        self.proj: nn.Module | None = None
        if (stride != 1 or cin != cout) and shortcut == "B":
            self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm(norm, cout))

    def _shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.proj is not None:
            return self.proj(x)
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.pad:
            x = F.pad(x, (0, 0, 0, 0, 0, self.pad))  # option A: zero channels, no parameters
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self._shortcut(x), inplace=True)


@MODELS.register("resnet20")
class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He et al., 2016): 6n+2 layers with n=3 (``depth`` = 20 by default; any 6n+2 works).

    ``shortcut="A"`` (default, the paper's CIFAR choice): identity shortcuts, with stride-2 subsampling and zero
    channel padding where the shape changes, so the shortcut adds no parameters (0.27M in total on 3-channel
    input). ``shortcut="B"``: a 1x1 conv + norm projection where the shape changes (+~3k parameters).
    ``norm``: ``"batch"`` (default) or ``"group"`` (GroupNorm with min(8, C) groups; no running statistics).
    Convs use Kaiming-normal (fan-out) init; norm layers start at weight 1, bias 0.
    """

    @dataclass(frozen=True)
    class Config:
        in_shape: tuple[int, int, int] = (3, 32, 32)
        num_classes: int = 10
        depth: int = 20
        shortcut: str = "A"
        norm: str = "batch"

        def __post_init__(self) -> None:
            _check_common(self)
            if self.depth < 8 or (self.depth - 2) % 6:
                raise ValueError(f"depth must be 6n+2 with n >= 1 (20, 32, 44, ...), got {self.depth}")
            if self.shortcut not in ("A", "B"):
                raise ValueError(f"shortcut must be 'A' or 'B', got {self.shortcut!r}")
            if self.norm not in ("batch", "group"):
                raise ValueError(f"norm must be 'batch' or 'group', got {self.norm!r}")

    def __init__(self, config: Config | None = None) -> None:
        super().__init__()
        self.config = cfg = config or self.Config()
        blocks_per_stage = (cfg.depth - 2) // 6
        self.conv1 = nn.Conv2d(cfg.in_shape[0], 16, 3, padding=1, bias=False)
        self.bn1 = _norm(cfg.norm, 16)
        stages: list[nn.Module] = []
        cin = 16
        for i, cout in enumerate((16, 32, 64)):
            blocks = []
            for j in range(blocks_per_stage):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(_BasicBlock(cin, cout, stride, cfg.shortcut, cfg.norm))
                cin = cout
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)), inplace=True)
        x = self.pool(self.stages(x)).flatten(1)
        return self.fc(x)


def build_model(
    name: str,
    in_shape: tuple[int, int, int] = (1, 8, 8),
    num_classes: int = 10,
    seed: int | None = None,
    **options: Any,
) -> nn.Module:
    """Model ``name`` from ``MODELS`` for inputs ``(N, *in_shape)``; unknown options raise ``ConfigError``.

    ``seed``: when given, initialise from ``torch.manual_seed(seed)`` inside a forked RNG (the global torch RNG
    is left as it was); otherwise initialisation consumes the global RNG.
    """
    if "in_shape" in options or "num_classes" in options:
        raise ConfigError("pass in_shape and num_classes as arguments of build_model")
    cfg = MODELS.make_config(name, in_shape=tuple(in_shape), num_classes=num_classes, **options)
    cls = MODELS.get(name)
    if seed is None:
        return cls(cfg)  # type: ignore[call-arg]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(cfg)  # type: ignore[call-arg]


def num_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of (trainable) parameter elements."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
