"""Optimizer specs with every hyperparameter explicit, and learning-rate schedules.

Defaults equal torch.optim's, and every value is stored, so a backend never falls back on its own framework's
defaults (optax's ``adamw`` weight decay is 1e-4 where torch's is 1e-2). A schedule is a multiplier of the base
learning rate as a function of the 0-based optimizer update count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from .serialize import register


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@register
@dataclass(frozen=True)
class Constant:
    """The base learning rate at every update."""

    def factor(self, step: int) -> float:
        return 1.0

    def factor_array(self, step: Any, xp: Any) -> Any:
        return xp.ones_like(step, dtype=xp.float32)


@register
@dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up over ``warmup_steps`` updates (update t gets (t+1)/warmup), then a cosine decay to
    ``min_ratio`` times the base rate at ``total_steps``; constant at ``min_ratio`` after that."""

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.0

    def __post_init__(self) -> None:
        _check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
               f"WarmupCosine warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        _check(isinstance(self.total_steps, int) and self.total_steps > self.warmup_steps,
               f"WarmupCosine total_steps ({self.total_steps!r}) must be an int > warmup_steps ({self.warmup_steps})")
        _check(0.0 <= self.min_ratio <= 1.0, f"WarmupCosine min_ratio must be in [0, 1], got {self.min_ratio!r}")

    def factor(self, step: int) -> float:
        return float(self.factor_array(np.float64(step), np))

    def factor_array(self, step: Any, xp: Any) -> Any:
        """The same formula on an array namespace (numpy, jax.numpy), for a traced step count."""
        warm = self.warmup_steps
        progress = xp.clip((step - warm) / (self.total_steps - warm), 0.0, 1.0)
        decay = self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + xp.cos(math.pi * progress))
        if warm == 0:
            return decay
        return xp.where(step < warm, (step + 1) / warm, decay)


Schedule = Constant | WarmupCosine


def _check_schedule(owner: str, schedule: object) -> None:
    _check(isinstance(schedule, (Constant, WarmupCosine)),
           f"{owner} schedule must be xb.Constant() or xb.WarmupCosine(...), not {type(schedule).__name__}")


@register
@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD semantics: coupled weight decay (added to the gradient), momentum buffer
    ``b = momentum*b + (1-dampening)*g`` (the first buffer is ``g``), optional Nesterov."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    schedule: Schedule = field(default_factory=Constant)

    def __post_init__(self) -> None:
        _check(isinstance(self.lr, (int, float)) and self.lr > 0, f"SGD lr must be a number > 0, got {self.lr!r}")
        _check(0.0 <= self.momentum < 1.0, f"SGD momentum must be in [0, 1), got {self.momentum!r}")
        _check(0.0 <= self.dampening <= 1.0, f"SGD dampening must be in [0, 1], got {self.dampening!r}")
        _check(self.weight_decay >= 0.0, f"SGD weight_decay must be >= 0, got {self.weight_decay!r}")
        _check(not self.nesterov or (self.momentum > 0 and self.dampening == 0),
               "SGD nesterov=True needs momentum > 0 and dampening == 0 (as in torch.optim.SGD)")
        _check_schedule("SGD", self.schedule)


@register
@dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW semantics: decoupled weight decay ``p -= lr*wd*p`` before the Adam update, bias-corrected
    moments, ``eps`` added to the bias-corrected square root."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    schedule: Schedule = field(default_factory=Constant)

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        _check(isinstance(self.lr, (int, float)) and self.lr > 0, f"AdamW lr must be a number > 0, got {self.lr!r}")
        _check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
               f"AdamW betas must be two numbers in [0, 1), got {self.betas!r}")
        _check(self.eps > 0, f"AdamW eps must be > 0, got {self.eps!r}")
        _check(self.weight_decay >= 0.0, f"AdamW weight_decay must be >= 0, got {self.weight_decay!r}")
        _check_schedule("AdamW", self.schedule)


OptimizerSpec = SGD | AdamW
