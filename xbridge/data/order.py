"""Which record each example of a step reads: epoch-shuffled, from (seed, position) alone.

Position ``p`` of the run (step * batch_size + row) reads record ``order[p]``. With shuffling, grain's
``MapDataset.shuffle`` gives each epoch its own permutation (``repeat`` reseeds every epoch) by an index shuffle that
costs no memory per record, and random access to any position: exactly the stateless (seed, step) contract, for a
data set of any size. Without shuffling, ``order[p] = p mod n``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np


@functools.lru_cache(maxsize=16)
def _shuffled(n: int, seed: int) -> Any:
    import logging

    absl = logging.getLogger("absl")    # grain warns through absl at import about profiling it does not do here
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        import grain
    finally:
        absl.setLevel(level)
    return grain.MapDataset.range(n).shuffle(seed=seed).repeat()


def record_index(n: int, seed: int, positions: np.ndarray, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return positions % n
    order = _shuffled(n, seed)
    return np.fromiter((order[int(p)] for p in positions), dtype=np.int64, count=len(positions))


def positions(step: int, batch_size: int, index: np.ndarray | None) -> np.ndarray:
    rows = np.arange(batch_size) if index is None else np.asarray(index, dtype=np.int64)
    return step * batch_size + rows
