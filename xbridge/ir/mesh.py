"""A named device mesh: ordered axes with sizes; one size may be -1 (takes the remaining devices)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError, PlanError
from .serialize import register

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@register
@dataclass(frozen=True, init=False)
class Mesh:
    """``xb.Mesh(data=-1, model=2)``: axis order is the keyword order (the first axis is the slowest-varying)."""

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: tuple | list | dict | None = None, **sizes: int) -> None:
        if axes is not None and sizes:
            raise ConfigError("xb.Mesh takes either axes=... or keyword sizes, not both")
        items = list(axes.items()) if isinstance(axes, dict) else [tuple(a) for a in (axes or ())]
        items += list(sizes.items())
        if not items:
            raise ConfigError("xb.Mesh needs at least one axis, e.g. xb.Mesh(data=-1)")
        seen: set[str] = set()
        for item in items:
            if len(item) != 2:
                raise ConfigError(f"mesh axis {item!r} must be a (name, size) pair")
            name, size = item
            if not isinstance(name, str) or not _AXIS_NAME.fullmatch(name):
                raise ConfigError(f"mesh axis name {name!r} must be an identifier")
            if name in seen:
                raise ConfigError(f"mesh axis {name!r} appears twice")
            seen.add(name)
            if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
                raise ConfigError(f"mesh axis {name!r} has size {size!r}; use a positive int or -1")
        if sum(1 for _, s in items if s == -1) > 1:
            raise ConfigError("at most one mesh axis may have size -1 (got "
                              + ", ".join(n for n, s in items if s == -1) + ")")
        object.__setattr__(self, "axes", tuple((n, int(s)) for n, s in items))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    def collapsed(self) -> Mesh:
        """The same axis names, each of size 1: the mesh of an unsharded (single-device) run."""
        return Mesh(tuple((n, 1) for n in self.names))

    def resolve(self, devices: int) -> dict[str, int]:
        """Axis sizes for ``devices`` devices, with -1 filled in. Raises PlanError naming the mismatch."""
        if not isinstance(devices, int) or devices < 1:
            raise PlanError(f"device count must be a positive int, got {devices!r}")
        fixed = math.prod(s for _, s in self.axes if s != -1)
        free = [n for n, s in self.axes if s == -1]
        shape = " x ".join(f"{n}={s}" for n, s in self.axes)
        if free:
            if devices % fixed:
                raise PlanError(f"mesh ({shape}) cannot fill {devices} devices: the fixed axes multiply to {fixed}, "
                                f"which does not divide {devices}; change the mesh or --devices")
            return {n: (devices // fixed if s == -1 else s) for n, s in self.axes}
        if fixed != devices:
            raise PlanError(f"mesh ({shape}) has {fixed} devices but {devices} are in use; make the axes multiply "
                            f"to {devices}, use -1 for one axis, or pass --devices {fixed}")
        return dict(self.axes)


def parse_mesh(text: str) -> Mesh:
    """``"data=-1,model=2"`` -> ``Mesh(data=-1, model=2)`` (the ``--mesh`` flag)."""
    axes = []
    for part in text.split(","):
        name, sep, size = part.partition("=")
        try:
            axes.append((name.strip(), int(size)))
        except ValueError:
            raise ConfigError(f"--mesh part {part.strip()!r} of {text!r} is not NAME=SIZE (e.g. "
                              "data=-1,model=2)") from None
        if not sep:
            raise ConfigError(f"--mesh part {part.strip()!r} of {text!r} is not NAME=SIZE (e.g. data=-1,model=2)")
    return Mesh(axes)
