"""The program: what a user writes once. A frozen dataclass whose non-callable fields serialise to JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from . import serialize
from .mesh import Mesh
from .optim import SGD, AdamW
from .precision import Precision, parse_precision
from .sharding import Sharding
from .source_checks import check_source

RNG_MODES = ("native", "portable")   # StepOptions.rng
REMAT_MODES = ("none", "full", "dots")   # StepOptions.remat
ATTENTION_KERNELS = ("auto", "math", "flash", "efficient", "cudnn")   # StepOptions.attention


@serialize.register
@dataclass(frozen=True)
class StepOptions:
    """``grad_accum``: the global batch is split into this many micro-batches whose mean-loss gradients are
    averaged (the result equals one step on the whole batch); ``clip_grad_norm``: clip gradients by their global
    L2 norm (torch.nn.utils.clip_grad_norm_ semantics) before the update; None disables it. ``rng``: where the
    forward's random draws (dropout, torch.rand...) come from: ``native``, each stack's own generator (fast; the
    stacks draw different numbers), or ``portable``, one counter-based generator computed inside the step, the same
    bits on every backend, mesh and process (parity of programs with dropout; docs/parity.md, "Randomness").
    ``remat``: activation checkpointing of the model's layers (docs/depth-and-memory.md): ``none``; ``full``, each
    layer keeps only its inputs and is recomputed in the backward pass; ``dots``, each layer keeps its matmul outputs
    and recomputes the rest. ``layers``: the dotted path of the ``nn.ModuleList`` that holds the layers (e.g.
    ``"blocks"``, ``"model.layers"``); None finds the longest ``ModuleList`` of modules of one class.
    ``attention``: the kernel every ``scaled_dot_product_attention`` call must use: ``auto`` (the stack's own
    choice), ``math``, ``flash``, ``efficient`` (memory-efficient) or ``cudnn``; a kernel the target cannot run is
    refused before the first step, never replaced silently (docs/depth-and-memory.md). ``scan_layers``: the
    layers (``layers``) traced once and iterated (jax: ``jax.lax.scan`` over their stacked parameters; eager runs
    the loop; inductor and xla refuse it for now), so compile time does not grow with depth."""

    grad_accum: int = 1
    clip_grad_norm: float | None = None
    rng: str = "native"
    remat: str = "none"
    layers: str | None = None
    attention: str = "auto"
    scan_layers: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.grad_accum, bool) or not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ConfigError(f"StepOptions grad_accum must be a positive int, got {self.grad_accum!r}")
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float))
                                                    and self.clip_grad_norm > 0):
            raise ConfigError(f"StepOptions clip_grad_norm must be a number > 0 or None, got {self.clip_grad_norm!r}")
        if self.rng not in RNG_MODES:
            raise ConfigError(f"StepOptions rng must be one of {', '.join(RNG_MODES)}, got {self.rng!r}")
        if self.remat not in REMAT_MODES:
            raise ConfigError(f"StepOptions remat must be one of {', '.join(REMAT_MODES)}, got {self.remat!r}")
        if not isinstance(self.scan_layers, bool):
            raise ConfigError(f"StepOptions scan_layers must be True or False, got {self.scan_layers!r}")
        if self.attention not in ATTENTION_KERNELS:
            raise ConfigError(f"StepOptions attention must be one of {', '.join(ATTENTION_KERNELS)}, got "
                              f"{self.attention!r}")
        if self.layers is not None and not (isinstance(self.layers, str) and all(
                part.isidentifier() or part.isdigit() for part in self.layers.split("."))):
            raise ConfigError(f"StepOptions layers must be a dotted module path such as 'model.layers' or None, "
                              f"got {self.layers!r}")


_CALLABLE = {"callable": True}
_DATA = {"data": True}      # serialised by the data contract's describe()


@serialize.register
@dataclass(frozen=True)
class Eval:
    """``xb.Eval(data=..., every=K, batches=M)``: the mean loss over M batches of ``data`` (batches 0..M-1, the same
    every time), in eval mode without gradients, every K steps (None: only at the end) and after the last step."""

    data: Any = field(default=None, metadata=_DATA)
    every: int | None = None
    batches: int = 1

    def __post_init__(self) -> None:
        check_source(self.data, "Eval")
        if self.every is not None and (isinstance(self.every, bool) or not isinstance(self.every, int)
                                       or self.every < 1):
            raise ConfigError(f"Eval every must be a positive int or None, got {self.every!r}")
        if isinstance(self.batches, bool) or not isinstance(self.batches, int) or self.batches < 1:
            raise ConfigError(f"Eval batches must be a positive int, got {self.batches!r}")


@serialize.register
@dataclass(frozen=True)
class Program:
    """One training program. ``model`` builds the ``nn.Module`` (called under the program's seed); ``loss(model,
    batch)`` returns a scalar tensor; ``data`` yields the global batch per step."""

    name: str
    model: Callable[[], Any] = field(metadata=_CALLABLE, compare=False)
    loss: Callable[[Any, dict], Any] = field(metadata=_CALLABLE, compare=False)
    data: Any = field(default=None, metadata=_DATA)
    optimizer: SGD | AdamW = None  # type: ignore[assignment]
    precision: Precision = "fp32"  # type: ignore[assignment]
    mesh: Mesh = field(default_factory=lambda: Mesh(data=-1))
    sharding: Sharding = field(default_factory=Sharding)
    step: StepOptions = field(default_factory=StepOptions)
    seed: int = 0
    eval: Eval | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"Program name must be a non-empty string, got {self.name!r}")
        for attr, kind in (("model", "a function that builds the nn.Module"),
                           ("loss", "a function loss(model, batch) -> a 0-d tensor or xb.LossSum(total, count)")):
            if not callable(getattr(self, attr)):
                raise ConfigError(f"Program {self.name!r}: {attr} must be {kind}, got "
                                  f"{type(getattr(self, attr)).__name__}")
        check_source(self.data, f"Program {self.name!r}")
        if self.eval is not None and not isinstance(self.eval, Eval):
            raise ConfigError(f"Program {self.name!r}: eval must be xb.Eval(data=..., every=..., batches=...), got "
                              f"{type(self.eval).__name__}")
        if not isinstance(self.optimizer, (SGD, AdamW)):
            raise ConfigError(f"Program {self.name!r}: optimizer must be xb.SGD(...) or xb.AdamW(...), "
                              f"got {type(self.optimizer).__name__}")
        object.__setattr__(self, "precision", parse_precision(self.precision))
        if isinstance(self.mesh, dict):
            object.__setattr__(self, "mesh", Mesh(self.mesh))
        if not isinstance(self.mesh, Mesh):
            raise ConfigError(f"Program {self.name!r}: mesh must be xb.Mesh(...), got {type(self.mesh).__name__}")
        if not isinstance(self.sharding, Sharding):
            raise ConfigError(f"Program {self.name!r}: sharding must be xb.Sharding(...), "
                              f"got {type(self.sharding).__name__}")
        if isinstance(self.step, dict):
            object.__setattr__(self, "step", StepOptions(**self.step))
        if not isinstance(self.step, StepOptions):
            raise ConfigError(f"Program {self.name!r}: step must be xb.StepOptions(...), got "
                              f"{type(self.step).__name__}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise ConfigError(f"Program {self.name!r}: seed must be an int in [0, 2**63), got {self.seed!r}")
        if self.data.batch_size % self.step.grad_accum:
            raise ConfigError(f"Program {self.name!r}: batch_size {self.data.batch_size} is not divisible by "
                              f"grad_accum {self.step.grad_accum}")

    def config(self) -> dict[str, Any]:
        """Every non-callable field as JSON-ready data."""
        return serialize.to_config(self)

    @property
    def config_hash(self) -> str:
        return serialize.config_hash(self)

    def replace(self, **changes: Any) -> Program:
        """A copy with fields changed (validated again), e.g. ``program.replace(precision="bf16-mixed")``."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_config(cls, config: dict[str, Any], model: Callable, loss: Callable, **sources: Any) -> Program:
        """Rebuild from :meth:`config`; ``sources`` (``data=``, ``eval=``) replace fields whose data sources the
        config only describes (a user's object, arrays in memory)."""
        fields = {k: v for k, v in config.items() if k not in sources}
        program = serialize.from_config(fields, model=model, loss=loss, **sources)
        if not isinstance(program, cls):
            raise ConfigError(f"config describes a {config.get('kind')!r}, not a Program")
        return program
