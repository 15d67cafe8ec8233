"""The data contract: what any object must do to feed a program, and what the IR records about it.

A data source is any object with

- ``batch_size``: an int >= 1, the global batch;
- ``batch(step, seed)``: the global batch of that step as a dict of numpy arrays (dimension 0 is the example),
  computed from (seed, step) alone, so every backend, every process and every resume sees the same batches.

Optional:

- ``rows(step, seed, index)``: only the examples ``index`` of that batch (a process reads only its share);
- ``tokens_per_example``: for tokens/s (default 1);
- ``describe()``: a JSON-ready dict that identifies the data (paths, sizes, fingerprints); the config hash and the
  checkpoint manifest keep it;
- ``variable_shapes = True``: the arrays' shapes may change between steps (each new shape compiles again).

An object the IR cannot describe still runs; the run record then says that its data is not reproducible from the
config alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import DataError
from ..ir.source_checks import source_name

# The batch entry --rng portable adds to every training batch: int32 [global row index, step] per example.
RNG_KEY = "xbridge.rng"


# torch's floating dtypes numpy has; the others (bfloat16, the float8s) reach the step as float32, exactly, and are
# cast to the precision's parameter dtype there like any floating array
_NUMPY_FLOATS = ("torch.float16", "torch.float32", "torch.float64")
# the same dtypes as ml_dtypes names them in numpy (a source of JAX arrays, a safetensors file)
WIDENED = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def host_array(value: Any) -> Any:
    """A torch tensor (from a collate function, a data set's records) as numpy; bfloat16 and float8 values, torch's
    or ml_dtypes', as float32 (exact). Anything else as it is."""
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        value = value.detach().cpu()
        if value.is_floating_point() and str(value.dtype) not in _NUMPY_FLOATS:
            value = value.float()
        return value.numpy()
    if isinstance(value, np.ndarray) and value.dtype.name in WIDENED:
        return value.astype(np.float32)
    return value


def fingerprints(description: Any, where: str = "data") -> dict[str, str]:
    """Every content fingerprint in a description (or a whole program config), by the file path or field it
    belongs to."""
    out: dict[str, str] = {}
    if isinstance(description, dict):
        if isinstance(description.get("fingerprint"), str):
            out[str(description.get("path", where))] = description["fingerprint"]
        for key, value in description.items():
            out.update(fingerprints(value, f"{where}.{key}"))
    elif isinstance(description, list):
        for index, value in enumerate(description):
            out.update(fingerprints(value, f"{where}[{index}]"))
    return out


def changed_data(saved_config: dict[str, Any], config: dict[str, Any]) -> str | None:
    """The first data file or array whose content differs between a saved config and this one, as one line."""
    before = fingerprints({k: saved_config.get(k) for k in ("data", "eval")})
    now = fingerprints({k: config.get(k) for k in ("data", "eval")})
    for name, value in before.items():
        if name in now and now[name] != value:
            return f"data {name!r} changed since it was saved (fingerprint {now[name]}, saved {value})"
    return None


def reproducible(description: dict[str, Any]) -> bool:
    """Whether the config alone identifies the data (a described source can still say ``reproducible: false``)."""
    return description.get("reproducible", True) is not False


def tokens_per_example(source: Any) -> int:
    return int(getattr(source, "tokens_per_example", 1))


def rows(source: Any, step: int, seed: int, index: np.ndarray) -> dict[str, Any]:
    """Examples ``index`` of step ``step``'s batch: the source's own ``rows`` when it has one (it reads only those),
    else the whole batch, sliced."""
    own = getattr(source, "rows", None)
    if callable(own):
        return own(step, seed, index)
    batch = source.batch(step, seed)
    return {k: v[index] for k, v in batch.items()} if isinstance(batch, Mapping) else batch


def checked_batch(source: Any, step: int, seed: int, rng_rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """One batch, checked (and a collate function's torch tensors made numpy): for code outside the run loop.
    ``rng_rows`` (--rng portable: xbridge.run.rng.rng_rows): the batch carries the portable generator's rows, as the
    run loop's batches do, so a trace of the loss draws as the step will."""
    return BatchCheck(source, expected_rows=source.batch_size, rng_rows=rng_rows)(source.batch(step, seed), step)


@dataclasses.dataclass
class BatchCheck:
    """Checks every batch against the first one: same keys, dtypes and shapes, numeric arrays whose dimension 0 is
    the batch size. Each problem is one line naming the source, the step and the key."""

    source: Any
    expected_rows: int | None = None        # the batch size (or a process's share); None: not checked
    signature: dict[str, tuple[str, tuple[int, ...]]] | None = None
    first_step: int = 0
    label: str = "step"          # what the index counts: "step" (training) or "eval batch"
    bytes_read: dict[int, int] = dataclasses.field(default_factory=dict)   # per step, until taken
    buffers: dict[str, int] = dataclasses.field(default_factory=dict)      # each key's memory in the last batch
    # --rng portable: the global row index of each example checked here (a rank's share: its rows); each checked
    # batch then carries RNG_KEY, [row, step] per example, for the portable generator (xbridge/torch/portable_rng.py)
    rng_rows: np.ndarray | None = None

    def __call__(self, batch: Any, step: int) -> dict[str, np.ndarray]:
        name = source_name(self.source)
        where = f"data {name}, {self.label} {step}"
        if not isinstance(batch, Mapping):
            raise DataError(f"{where}: batch() returned {type(batch).__name__}, not a dict of arrays")
        out: dict[str, np.ndarray] = {}
        for key, value in batch.items():
            if not isinstance(key, str):
                raise DataError(f"{where}: batch key {key!r} is not a string")
            out[key] = self._array(value, where, key)
        variable = getattr(self.source, "variable_shapes", False) is True
        signature = {k: (str(v.dtype), tuple(v.shape)) for k, v in out.items()}
        if self.signature is None:
            if not out:
                raise DataError(f"{where}: batch() returned an empty dict")
            self.signature, self.first_step = signature, step
        else:
            missing = sorted(set(self.signature) - set(signature))
            extra = sorted(set(signature) - set(self.signature))
            if missing:
                raise DataError(f"{where}: batch key {missing[0]!r} is missing ({self.label} {self.first_step} had "
                                "it)")
            if extra:
                raise DataError(f"{where}: batch key {extra[0]!r} is new ({self.label} {self.first_step} had keys "
                                f"{sorted(self.signature)})")
            for key, (dtype, shape) in signature.items():
                was_dtype, was_shape = self.signature[key]
                if dtype != was_dtype:
                    raise DataError(f"{where}: key {key!r} is {dtype}, it was {was_dtype} at {self.label} "
                                    f"{self.first_step}")
                if shape != was_shape and not variable:
                    raise DataError(f"{where}: key {key!r} has shape {list(shape)}, it was {list(was_shape)} at "
                                    f"{self.label} {self.first_step} (a source whose shapes change sets "
                                    "variable_shapes = True)")
        if self.expected_rows is not None and not variable:
            for key, value in out.items():
                if value.ndim == 0 or value.shape[0] != self.expected_rows:
                    raise DataError(f"{where}: key {key!r} has shape {list(value.shape)}; dimension 0 must be the "
                                    f"{self.expected_rows} examples of the batch")
        self.bytes_read[step] = sum(v.nbytes for v in out.values())
        for key, value in out.items():
            # a source that refills one buffer every step would change a batch the device may still read (batches
            # load a step ahead and cross to the device without a copy where they can): that batch gets a copy
            address = value.ctypes.data
            if value.size and self.buffers.get(key) == address:
                out[key] = value.copy()
            self.buffers[key] = address
        if RNG_KEY in out:      # under either --rng: one line on every backend, before any compute
            raise DataError(f"{where}: batch key {RNG_KEY!r} is reserved for --rng portable; rename it")
        if self.rng_rows is not None:
            rows = np.asarray(self.rng_rows, dtype=np.int64)
            out[RNG_KEY] = np.stack([rows, np.full_like(rows, step)], axis=1).astype(np.int32)
        return out

    @staticmethod
    def _array(value: Any, where: str, key: str) -> np.ndarray:
        value = host_array(value)
        if not isinstance(value, np.ndarray):
            raise DataError(f"{where}: key {key!r} is a {type(value).__name__}, not a numpy array")
        if not (np.issubdtype(value.dtype, np.number) or value.dtype == np.bool_):
            raise DataError(f"{where}: key {key!r} has dtype {value.dtype}; arrays must be numeric")
        if value.dtype == np.uint64 and value.size and int(value.max()) > np.iinfo(np.int64).max:
            at = np.unravel_index(int(np.argmax(value)), value.shape)
            raise DataError(f"{where}: key {key!r} holds {int(value.max())} at index {tuple(int(i) for i in at)}, "
                            "beyond int64, the widest integer torch and JAX compute with; keep ids and labels "
                            "below 2**63")
        return value
