"""Batches onto the devices for the JAX executable: host arrays in the dtype JAX computes in, split as the plan says;
under several processes (--processes) each process reads and checks only the rows its own devices hold and hands
them to JAX as its part of the global batch (docs/multi-process.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.dlpack
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xbridge.errors import DataError, LoweringError
from xbridge.ir.program import Program
from xbridge.plugin import BatchCheck, data_source, rng_rows


def to_jax_dtype(array: np.ndarray, float_dtype: Any, where: str = "batch", key: str = "") -> np.ndarray:
    if np.issubdtype(array.dtype, np.floating):
        return array.astype(float_dtype, copy=False)
    if array.dtype == np.int64 and not jax.config.jax_enable_x64:
        check_int32({key: array}, where)
        return array.astype(np.int32)
    return array


def check_int32(batch: dict[str, np.ndarray], where: str) -> None:
    """JAX computes integers in int32 (x64 off, as xbridge runs it): an int64 array with a value outside int32 would
    wrap around. One line naming the key and ``where`` (the source and step) instead."""
    if jax.config.jax_enable_x64:
        return
    limits = np.iinfo(np.int32)
    for key, value in batch.items():
        if value.dtype == np.int64 and value.size:
            high, low = int(value.max()), int(value.min())
            if high > limits.max or low < limits.min:
                raise DataError(f"{where}: key {key!r} holds the int64 value {high if high > limits.max else low}, "
                                "outside int32, which the jax targets compute integers in (JAX without x64): keep "
                                "the values within +-2**31 (ids, indices) or give them as float")


class BatchFeed:
    """The batch's way onto the mesh: ``batch_spec`` splits it over ``batch_sharding``; ``processes`` > 1: the mesh
    spans several processes, each feeding its own rows."""

    def __init__(self, program: Program, mesh: jax.sharding.Mesh, batch_spec: P, batch_sharding: NamedSharding,
                 processes: int) -> None:
        self.program, self.mesh, self.batch_spec, self.batch_sharding = program, mesh, batch_spec, batch_sharding
        self.processes = processes
        self._local: tuple[BatchCheck, np.ndarray] | None = None

    def local_rows(self, batch_size: int) -> np.ndarray:
        """The rows of the global batch this process's devices hold (all of them in one process)."""
        first = NamedSharding(self.mesh, P(*self.batch_spec[:1]))
        index = first.addressable_devices_indices_map((batch_size,))
        rows = np.asarray(sorted({r for sl in index.values() if sl for r in range(batch_size)[sl[0]]}),
                          dtype=np.int64)
        if len(rows) and not np.array_equal(rows, np.arange(rows[0], rows[0] + len(rows))):
            raise LoweringError(f"process {jax.process_index()}'s devices hold rows that are not one block of the "
                                f"batch ({rows.tolist()[:8]}...); put the batch's mesh axis first in the mesh")
        return rows

    def fetch(self, source: Any, step: int, seed: int,
              check: Callable[[Any, int], dict[str, np.ndarray]]) -> dict[str, jax.Array]:
        """Several processes: each reads and checks only the rows its own devices hold (the source's ``rows``
        when it has one) and hands them to JAX as its part of the global batch."""
        if self._local is None:
            rows = self.local_rows(source.batch_size)
            self._local = (BatchCheck(source, expected_rows=len(rows), rng_rows=rng_rows(self.program, rows)), rows)
        local_check, rows = self._local
        local = local_check(data_source.rows(source, step, seed, rows), step)
        check_int32(local, f"data {data_source.source_name(source)}, {local_check.label} {step}")
        if isinstance(check, BatchCheck):      # the run loop reports what this process read
            check.bytes_read[step] = local_check.bytes_read.pop(step, 0)
        return self.global_arrays(local, source.batch_size)

    def global_arrays(self, local: dict[str, np.ndarray], batch_size: int) -> dict[str, jax.Array]:
        """This process's rows of every key, made into global arrays split as the plan says."""
        float_dtype = jnp.dtype(self.program.precision.params)
        out = {}
        for key, value in local.items():
            array = to_jax_dtype(value, float_dtype, key=key)
            shape = (batch_size, *array.shape[1:])
            out[key] = jax.make_array_from_process_local_data(self.batch_sharding, array, shape)
        return out

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """On the devices, split as the plan says (``jax.device_put`` returns at once; the copy is asynchronous).
        On one device, an array already in the dtype JAX computes in and in memory XLA can use as it is (64-byte
        aligned, C order: a torch tensor's, as a collate function returns) crosses by DLPack without a copy."""
        if self.processes > 1:        # a whole batch (eval, traces): this process's rows of it
            size = next(iter(batch.values())).shape[0]
            rows = self.local_rows(size)
            return self.global_arrays({k: v[rows] for k, v in batch.items()}, size)
        float_dtype = jnp.dtype(self.program.precision.params)
        one_device = len(self.batch_sharding.device_set) == 1
        out = {}
        for key, value in batch.items():
            array = to_jax_dtype(value, float_dtype, key=key)
            # numpy's DLPack export knows the standard dtypes only (not ml_dtypes' bfloat16)
            if one_device and array.dtype.kind in "biuf" and array.flags.c_contiguous and array.ctypes.data % 64 == 0:
                out[key] = jax.device_put(jax.dlpack.from_dlpack(array), self.batch_sharding)   # no copy
            else:
                out[key] = jax.device_put(array, self.batch_sharding)
        return out
