"""A jax process's side of a sharded checkpoint (xbridge/checkpoint/shards.py). Writing: of each global array, the
shards its devices hold whose ``replica_id`` is 0 (JAX numbers the copies of a replicated slice; exactly one device
in the job holds replica 0), at the offsets their ``index`` gives. Reading: each device's slice of an array, read on
its own from numpy or from a checkpoint's tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from xbridge.plugin import shards


def held(leaf: jax.Array, dtype: Any) -> shards.Sharded:
    return shards.Sharded(tuple(leaf.shape), str(np.dtype(dtype)),
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


def abstract(source: Any, sharding: jax.sharding.Sharding,
             convert: Callable[[np.ndarray], np.ndarray] | None = None) -> jax.ShapeDtypeStruct:
    """What :func:`placed` would place, as a shape, a dtype (``convert``-ed) and a sharding: on compile-only devices
    (a TPU topology) nothing is read. ``source``: anything with ``shape`` and ``dtype`` (numpy, torch, jax)."""
    dtype = np.empty((0,), _numpy_dtype(source.dtype)) if convert is None else convert(
        np.empty((0,), _numpy_dtype(source.dtype)))
    return jax.ShapeDtypeStruct(tuple(source.shape), dtype.dtype, sharding=sharding)


def abstract_stack(members: list[Any]) -> jax.ShapeDtypeStruct:
    """``jnp.stack`` of shapes (a scanned layers' group, xbridge/torch/layer_stacks.py)."""
    first = members[0]
    return jax.ShapeDtypeStruct((len(members), *first.shape), first.dtype)


def shape_of(leaf: Any, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
    """A state leaf (an array, a scalar or already a shape) as a shape with the state's sharding."""
    return jax.ShapeDtypeStruct(np.shape(leaf), jax.numpy.result_type(leaf) if not hasattr(leaf, "dtype")
                                else leaf.dtype, sharding=sharding)


def _numpy_dtype(dtype: Any) -> Any:
    """numpy's dtype of a numpy, jax or torch dtype, floating ones as float32 (as the host copies :func:`placed`
    reads are: xbridge.torch.weights.tensor_to_numpy); ``convert`` then gives the state's dtype."""
    found = jax.numpy.dtype(str(dtype).removeprefix("torch."))
    return np.dtype(np.float32) if jax.numpy.issubdtype(found, jax.numpy.floating) else found
