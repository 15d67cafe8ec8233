"""Arrays: examples along dimension 0 of same-length arrays, from ``.npz`` / ``.safetensors`` / ``.npy`` files or
from numpy arrays in memory, epoch-shuffled per (seed, epoch) like ``Digits``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..ir.source_checks import positive_int
from . import fingerprint
from .files import existing_file
from .order import positions, record_index


def _load_file(path: str, owner: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    file = existing_file(path, owner)
    suffix = file.suffix
    try:
        if suffix == ".npz":
            with np.load(file, allow_pickle=False) as archive:
                arrays = {name: archive[name] for name in archive.files}
        elif suffix == ".safetensors":
            arrays = _safetensors(file, path, owner)
        elif suffix == ".npy":
            arrays = {file.stem: np.load(file, mmap_mode="r", allow_pickle=False)}
        else:
            raise ConfigError(f"{owner}: data file {path!r} is not .npz, .npy or .safetensors")
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{owner}: data file {path!r} cannot be read: {exc}") from None
    return arrays, {"path": str(path), "bytes": file.stat().st_size, "fingerprint": fingerprint.of_file(file)}


def _safetensors(file: Path, path: str, owner: str) -> dict[str, np.ndarray]:
    """A .safetensors file's tensors as numpy (safetensors' own reader); its bfloat16 tensors, which numpy has no
    dtype for, widened to float32 exactly (a bfloat16 is a float32's top 16 bits), read here from the file's
    documented layout: 8 bytes of header length, the JSON header (dtype, shape, data_offsets), then the data."""
    import json

    import safetensors

    with open(file, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
        start = 8 + size
        arrays: dict[str, np.ndarray] = {}
        with safetensors.safe_open(str(file), framework="np") as tensors:
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] == "BF16":
                    first, end = entry["data_offsets"]
                    handle.seek(start + first)
                    bits = np.frombuffer(handle.read(end - first), dtype="<u2").astype(np.uint32) << 16
                    arrays[name] = bits.view(np.float32).reshape(entry["shape"])
                elif entry["dtype"].startswith("F8"):
                    raise ConfigError(f"{owner}: data file {path!r}: key {name!r} has dtype {entry['dtype']}, which "
                                      "numpy cannot hold; store it as float32, float16 or bfloat16")
                else:
                    arrays[name] = tensors.get_tensor(name)
    return arrays


class Arrays:
    """``xb.data.Arrays("train.npz", batch_size=64)``, ``xb.data.Arrays({"x": x, "y": y}, batch_size=64)`` or
    ``xb.data.Arrays({"x": "x.npy", "y": "y.npy"}, batch_size=64)``: ``batch(step, seed)`` gives every key's
    examples of that step. ``shuffle=False`` reads them in order, epoch after epoch."""

    def __init__(self, source: str | Path | dict[str, Any], batch_size: int, shuffle: bool = True) -> None:
        owner = "Arrays"
        self.batch_size, self.shuffle = batch_size, bool(shuffle)
        self.arrays: dict[str, np.ndarray] = {}
        self.files: list[dict[str, Any]] = []
        self.in_memory: list[str] = []
        self._description: dict[str, Any] | None = None
        if isinstance(source, (str, Path)):
            self.arrays, info = _load_file(str(source), owner)
            self.files.append(info)
        elif isinstance(source, dict) and source:
            for key, value in source.items():
                if isinstance(value, (str, Path)):
                    loaded, info = _load_file(str(value), owner)
                    if len(loaded) != 1:
                        raise ConfigError(f"{owner}: key {key!r} names {str(value)!r}, which holds {len(loaded)} "
                                          "arrays; name a .npy file or pass the archive itself")
                    self.arrays[key] = next(iter(loaded.values()))
                    self.files.append({"key": key, **info})
                elif isinstance(value, np.ndarray):
                    self.arrays[key] = value
                    self.in_memory.append(key)
                else:
                    raise ConfigError(f"{owner}: key {key!r} is a {type(value).__name__}; give a numpy array or a "
                                      ".npy path")
        else:
            raise ConfigError(f"{owner}: source must be a .npz/.npy/.safetensors path or a non-empty dict of arrays, "
                              f"got {type(source).__name__}")
        positive_int(batch_size, f"{owner}: batch_size")
        lengths = {k: (v.shape[0] if v.ndim else None) for k, v in self.arrays.items()}
        if not self.arrays or any(n is None for n in lengths.values()):
            raise ConfigError(f"{owner}: every array needs dimension 0 (the examples); got shapes "
                              f"{ {k: list(v.shape) for k, v in self.arrays.items()} }")
        if len(set(lengths.values())) != 1:
            raise ConfigError(f"{owner}: arrays have different numbers of examples {lengths}")
        self.examples = int(next(iter(self.arrays.values())).shape[0])
        if self.examples == 0:
            raise ConfigError(f"{owner}: the arrays hold no examples")

    def rows(self, step: int, seed: int, index: np.ndarray) -> dict[str, np.ndarray]:
        records = record_index(self.examples, seed, positions(step, self.batch_size, index), self.shuffle)
        return {k: np.asarray(v[records]) for k, v in self.arrays.items()}

    def batch(self, step: int, seed: int) -> dict[str, np.ndarray]:
        return self.rows(step, seed, np.arange(self.batch_size))

    def describe(self) -> dict[str, Any]:
        if self._description is None:
            self._description = self._describe()
        return self._description

    def _describe(self) -> dict[str, Any]:
        arrays = {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in self.arrays.items()}
        for key in self.in_memory:      # hashed once per description (the config hash, the manifest)
            arrays[key]["fingerprint"] = fingerprint.of_array(self.arrays[key])
        return {"shuffle": self.shuffle, "examples": self.examples, "arrays": arrays, "files": self.files}
