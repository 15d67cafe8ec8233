"""Sharding annotations: regex rules on parameter names, the batch layout, and presets.

A partition spec has one entry per leading tensor dimension: ``None`` (replicated), a mesh axis name, or a tuple of
axis names (the dimension is split over their product). Shorter specs leave the trailing dimensions replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .serialize import register

SpecEntry = str | tuple[str, ...] | None
Spec = tuple[SpecEntry, ...]


def normalize_spec(spec: Any, where: str) -> Spec:
    """Turn user input (tuple/list/str/None) into a tuple of entries; reject anything else naming ``where``."""
    if spec is None:
        return ()
    if isinstance(spec, str):
        spec = (spec,)
    if not isinstance(spec, (tuple, list)):
        raise ConfigError(f"{where}: partition spec must be a tuple like ('model', None), got {spec!r}")
    out: list[SpecEntry] = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            out.append(entry)
        elif isinstance(entry, (tuple, list)) and entry and all(isinstance(a, str) for a in entry):
            out.append(tuple(entry) if len(entry) > 1 else entry[0])
        else:
            raise ConfigError(f"{where}: spec entry {entry!r} must be None, an axis name or a tuple of axis names")
    return tuple(out)


def spec_axes(spec: Spec) -> list[str]:
    axes: list[str] = []
    for entry in spec:
        if isinstance(entry, str):
            axes.append(entry)
        elif isinstance(entry, tuple):
            axes.extend(entry)
    return axes


@register
@dataclass(frozen=True)
class Sharding:
    """``params``: regex (full match on the parameter name) to partition spec; ``batch``: spec of every batch
    array (dimension 0 is the example dimension); ``fsdp``: a mesh axis over which every parameter that no rule
    matches is split along its largest divisible dimension (replicated if none divides)."""

    params: dict[str, Spec] = field(default_factory=dict)
    batch: Spec = ("data",)
    fsdp: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.params, dict):
            raise ConfigError(f"Sharding params must be a dict of regex -> spec, got {type(self.params).__name__}")
        rules: dict[str, Spec] = {}
        for pattern, spec in self.params.items():
            if not isinstance(pattern, str):
                raise ConfigError(f"sharding rule key {pattern!r} must be a regex string")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"sharding rule '{pattern}' is not a valid regex: {exc}") from None
            rules[pattern] = normalize_spec(spec, f"sharding rule '{pattern}'")
        object.__setattr__(self, "params", rules)
        object.__setattr__(self, "batch", normalize_spec(self.batch, "Sharding batch"))
        if self.fsdp is not None and not isinstance(self.fsdp, str):
            raise ConfigError(f"Sharding fsdp must be a mesh axis name, got {self.fsdp!r}")

    def __hash__(self) -> int:  # dict field: hash the canonical items
        return hash((tuple(self.params.items()), self.batch, self.fsdp))


def data_parallel(axis: str = "data") -> Sharding:
    """Replicate every parameter; split the batch over ``axis``."""
    return Sharding(params={}, batch=(axis,))


def fsdp(axis: str = "data", rules: dict[str, Any] | None = None) -> Sharding:
    """Fully sharded data parallel over ``axis``: the batch and every parameter not matched by ``rules`` are split
    over it (parameters along their largest divisible dimension)."""
    return Sharding(params=dict(rules or {}), batch=(axis,), fsdp=axis)
