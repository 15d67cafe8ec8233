"""A jax process's side of a sharded checkpoint (xbridge/checkpoint/shards.py). Writing: of each global array, the
shards its devices hold whose ``replica_id`` is 0 (JAX numbers the copies of a replicated slice; exactly one device
in the job holds replica 0), at the offsets their ``index`` gives. Reading: each device's slice of an array, read on
its own from numpy or from a checkpoint's tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from xbridge.checkpoint.shards import Sharded


def held(leaf: jax.Array, dtype: Any) -> Sharded:
    return Sharded(tuple(leaf.shape), str(np.dtype(dtype)),
                   [(tuple(s.indices(n)[0] for s, n in zip(shard.index, leaf.shape)),
                     np.asarray(shard.data).astype(dtype, copy=False))    # on CPU: a view of the device buffer
                    for shard in leaf.addressable_shards if shard.replica_id == 0])


def placed(source: Any, sharding: jax.sharding.Sharding,
           convert: Callable[[np.ndarray], np.ndarray] | None = None) -> jax.Array:
    """A global array from ``source`` (numpy, or a sharded checkpoint's tensor: anything with ``shape`` and
    ``[slices]``): each of this process's devices gets its slice, read on its own, then ``convert``-ed."""
    def read(index: Any) -> np.ndarray:
        value = np.asarray(source[index])
        return convert(value) if convert is not None else value

    return jax.make_array_from_callback(tuple(source.shape), sharding, read)
