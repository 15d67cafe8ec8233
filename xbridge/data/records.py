"""Records: a map-style data set (``len`` and ``ds[i]``): a ``torch.utils.data.Dataset``, a Hugging Face
``datasets.Dataset``, or any sequence of records, with an optional ``collate_fn`` that turns a list of records into
a dict of arrays (the default stacks the records' dict values)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..ir.source_checks import positive_int, source_name
from .order import positions, record_index
from .source import DataError, host_array


def stack_records(records: list[Any]) -> dict[str, np.ndarray]:
    """The default collation: records are dicts; each key's values are stacked along a new dimension 0."""
    first = records[0]
    if not isinstance(first, Mapping):
        raise DataError(f"records are {type(first).__name__}, not dicts; return a dict per record or pass "
                        "collate_fn=... (a list of records -> a dict of arrays)")
    out = {}
    for key in first:
        values = [record[key] for record in records]
        values = [host_array(v) for v in values]
        try:
            out[key] = np.stack([np.asarray(v) for v in values])
        except ValueError as exc:
            raise DataError(f"records' key {key!r} cannot be stacked into one array ({exc}); records of different "
                            "lengths need a collate_fn that pads them") from None
    return out


class Records:
    """``xb.data.Records(dataset, batch_size=32, collate_fn=None, shuffle=True)``: epoch-shuffled per (seed, epoch),
    each process reading only the records of its rows."""

    def __init__(self, dataset: Any, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None,
                 shuffle: bool = True) -> None:
        owner = f"Records({source_name(dataset)})"
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ConfigError(f"{owner}: the data set needs __len__ and __getitem__ (a map-style data set); an "
                              "iterable-only data set cannot give step k's batch without reading steps 0..k-1")
        positive_int(batch_size, f"{owner}: batch_size")
        if collate_fn is not None and not callable(collate_fn):
            raise ConfigError(f"{owner}: collate_fn must be callable, got {type(collate_fn).__name__}")
        self.dataset, self.batch_size, self.collate_fn, self.shuffle = dataset, batch_size, collate_fn, bool(shuffle)
        self.examples = len(dataset)
        if self.examples == 0:
            raise ConfigError(f"{owner}: the data set is empty")

    def rows(self, step: int, seed: int, index: np.ndarray) -> Any:
        records = [self.dataset[int(i)] for i in record_index(self.examples, seed,
                                                               positions(step, self.batch_size, index), self.shuffle)]
        return self.collate_fn(records) if self.collate_fn is not None else stack_records(records)

    def batch(self, step: int, seed: int) -> Any:
        return self.rows(step, seed, np.arange(self.batch_size))

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dataset": source_name(self.dataset), "examples": self.examples,
                               "shuffle": self.shuffle}
        if self.collate_fn is not None:
            out["collate_fn"] = getattr(self.collate_fn, "__qualname__", type(self.collate_fn).__name__)
        content = getattr(self.dataset, "_fingerprint", None)   # Hugging Face datasets: a hash of the content
        if isinstance(content, str):
            out["fingerprint"] = content
        else:
            out["reproducible"] = False
        return out
