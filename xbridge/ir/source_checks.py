"""What the IR asks of a program's data source and of its count fields, checked when a Program is made (the data
sources themselves are xbridge/data, which builds on the IR)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def source_name(source: Any) -> str:
    return type(source).__qualname__


def positive_int(value: object, what: str) -> None:
    """The one check of a count field (batch sizes, lengths): an int >= 1, bools refused."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive int, got {value!r}")


def check_source(source: Any, owner: str) -> None:
    """Refuse, in one line, an object that cannot be a data source."""
    if source is None:
        raise ConfigError(f"{owner}: data is missing; give a data source, e.g. xb.data.TokenFile(...) or any object "
                          "with batch_size and batch(step, seed)")
    batch = getattr(source, "batch", None)
    if not callable(batch):
        raise ConfigError(f"{owner}: data {source_name(source)} has no batch(step, seed) method (a data source "
                          "gives the global batch of a step as a dict of numpy arrays)")
    positive_int(getattr(source, "batch_size", None), f"{owner}: data {source_name(source)} batch_size")
