"""``xb.shard(x, *spec)``: an activation layout hint inside a model.

Outside a backend that gives it meaning it returns ``x`` unchanged. A backend installs a handler for the duration of
a trace or step with :func:`activate` (JAX: ``with_sharding_constraint``; torch_xla: ``mark_sharding``). The
reference backend installs :func:`checker`, so a hint naming an unknown mesh axis fails on eager first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from .errors import PlanError
from .ir.sharding import Spec, normalize_spec, spec_axes

Handler = Callable[[Any, Spec], Any]
_handler: Handler | None = None


def shard(x: Any, *spec: Any) -> Any:
    """Hint that activation ``x`` is laid out as ``spec`` over the mesh (one entry per leading dimension)."""
    if _handler is None:
        return x
    return _handler(x, normalize_spec(tuple(spec), "xb.shard"))


@contextlib.contextmanager
def activate(handler: Handler | None) -> Iterator[None]:
    global _handler
    previous, _handler = _handler, handler
    try:
        yield
    finally:
        _handler = previous


def check_hint(x: Any, spec: Spec, axis_sizes: dict[str, int]) -> None:
    """Raise PlanError if ``spec`` does not fit ``x`` (rank) or names an axis outside the mesh."""
    shape = tuple(getattr(x, "shape", ()))
    if len(spec) > len(shape):
        raise PlanError(f"xb.shard spec {spec!r} has {len(spec)} entries but the activation has shape {shape}")
    for axis in spec_axes(spec):
        if axis not in axis_sizes:
            raise PlanError(f"xb.shard spec {spec!r} names mesh axis {axis!r}, which is not in the mesh "
                            f"(axes: {', '.join(axis_sizes)})")


def checker(axis_sizes: dict[str, int]) -> Handler:
    """A handler that only validates hints (for backends where a layout means nothing)."""
    def handle(x: Any, spec: Spec) -> Any:
        check_hint(x, spec, axis_sizes)
        return x
    return handle
