"""Sharded checkpoints: the pieces each process writes, and tensors read back slice by slice.

A run spread over several processes (``--processes``) saves without gathering: each process writes the pieces its
devices hold (a replicated piece once, by the replica the backend numbers 0) into its own ``model-IIIII-of-PPPPP``
and ``train-IIIII-of-PPPPP.safetensors``, and process 0 commits the checkpoint when every process has written
(writer.py). The manifest's ``layout`` records, for every tensor, its global dtype and shape and
its pieces: the file, the key in that file, where the piece starts in the global array and the SHA-256 of its
bytes. A reader asks a :class:`Stored` for the slice it needs; only the pieces overlapping that slice are read,
each checked against its SHA-256.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, NonFinite


@dataclass
class Sharded:
    """A global array given by the pieces this process writes: ``(start index, values)``; a process may hold
    none (another one writes every piece it has a replica of)."""
    shape: tuple[int, ...]
    dtype: str
    pieces: list[tuple[tuple[int, ...], np.ndarray]] = field(default_factory=list)


@dataclass
class Group:
    """The processes saving one checkpoint together: this one's ``index`` of ``count``, and ``barrier(name)``,
    which returns once every process has called it with that name (a collective)."""
    index: int
    count: int
    barrier: Callable[[str], None]


def part_record(index: int) -> str:
    """The file in which process ``index`` describes what it wrote (process 0 reads it, then removes it)."""
    return f"part-{index:05d}.json"


def part_file(kind: str, index: int, count: int) -> str:
    return f"{kind}-{index:05d}-of-{count:05d}.safetensors"


def piece_key(name: str, start: tuple[int, ...]) -> str:
    return f"{name}@{','.join(str(s) for s in start)}"


def _contiguous(array: np.ndarray) -> np.ndarray:
    return array if array.flags.c_contiguous else array.copy()    # np.ascontiguousarray makes a scalar 1-d


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(_contiguous(array).data).hexdigest()


def write_tensors(path: Path, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """A new safetensors file (never an existing one) of ``arrays``, fsynced; its size and SHA-256. safetensors'
    ``save_file`` writes straight from the arrays' memory (no serialized copy of the file is held, as ``save``
    would hold one), and the digest is taken by reading the file back in chunks."""
    import safetensors.numpy

    if path.exists():
        raise FileExistsError(errno.EEXIST, "File exists", str(path))
    safetensors.numpy.save_file(arrays, str(path))
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def write_part(tmp: Path, group: Group, model: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    """Write this process's pieces into ``tmp`` (one file per kind it holds a piece of) and return the part that
    describes them; full numpy arrays (the same in every process) are written by process 0 alone. A piece holding
    NaN or Inf is refused (:class:`xbridge.errors.NonFinite`) before anything is written."""
    part: dict[str, Any] = {"index": group.index, "count": group.count, "files": {}, "tensors": {},
                            "layout": {"model": {}, "train": {}}}
    held: dict[str, dict[str, np.ndarray]] = {}
    for kind, arrays in (("model", model), ("train", train)):
        file = part_file(kind, group.index, group.count)
        stored = held.setdefault(file, {})
        for name, value in arrays.items():
            if isinstance(value, Sharded):
                shape, dtype, pieces = value.shape, value.dtype, value.pieces
            else:
                shape, dtype = tuple(value.shape), str(value.dtype)
                pieces = [((0,) * value.ndim, value)] if group.index == 0 else []
            listed: list[dict[str, Any]] = []
            part["layout"][kind][name] = {"dtype": dtype, "shape": list(shape), "pieces": listed}
            for start, array in pieces:
                if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all():
                    raise NonFinite(f"{name!r} holds NaN or Inf")
                if str(array.dtype) != dtype:
                    raise ValueError(f"piece of {name!r} is {array.dtype}, the tensor {dtype}")
                key = piece_key(name, start)
                stored[key] = _contiguous(array)
                listed.append({"file": file, "key": key, "start": list(start), "sha256": _digest(array)})
    for file, stored in held.items():
        if stored:
            part["files"][file] = write_tensors(tmp / file, stored)
            part["tensors"][file] = {k: [str(a.dtype), list(a.shape)] for k, a in stored.items()}
    return part


def merge_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The files, per-file tensors and layout of all processes' parts (index order) as one manifest section."""
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    layout: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    for part in parts:
        files.update(part["files"])
        tensors.update(part["tensors"])
        for kind in ("model", "train"):
            for name, entry in part["layout"][kind].items():
                merged = layout[kind].setdefault(name, {"dtype": entry["dtype"], "shape": entry["shape"],
                                                        "pieces": []})
                if (merged["dtype"], merged["shape"]) != (entry["dtype"], entry["shape"]):
                    raise CheckpointError(f"the processes disagree about tensor {name!r}: {merged['dtype']}"
                                          f"{merged['shape']} and {entry['dtype']}{entry['shape']}")
                merged["pieces"].extend(entry["pieces"])
    return {"files": files, "tensors": tensors, "layout": layout}


# ---------------------------------------------------------------------------------------------- reading

def _volume(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


def malformed_layout(manifest: dict[str, Any]) -> str | None:
    """The first problem of a sharded manifest's ``layout``: a field of the wrong type, a piece in a file the
    manifest does not list, outside its tensor, overlapping another, or pieces that leave part of a tensor
    unwritten."""
    layout = manifest["layout"]
    if not isinstance(layout, dict) or set(layout) != {"model", "train"}:
        return "'layout' must be an object with 'model' and 'train'"
    for kind, table in layout.items():
        if not isinstance(table, dict):
            return f"'layout' entry {kind!r} must be an object"
        for name, entry in table.items():
            if (not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str)
                    or not isinstance(entry.get("shape"), list) or not isinstance(entry.get("pieces"), list)
                    or not all(isinstance(s, int) and s >= 0 for s in entry["shape"])):
                return f"tensor {name!r} of the layout must hold 'dtype', 'shape' and 'pieces'"
            boxes: list[list[tuple[int, int]]] = []
            for piece in entry["pieces"]:
                if (not isinstance(piece, dict) or not isinstance(piece.get("start"), list)
                        or not isinstance(piece.get("sha256"), str)):
                    return f"a piece of tensor {name!r} must hold 'file', 'key', 'start' and 'sha256'"
                spec = manifest["tensors"].get(piece.get("file"), {}).get(piece.get("key"))
                if spec is None:
                    return (f"a piece of tensor {name!r} names {piece.get('key')!r} in {piece.get('file')!r}, which "
                            "the manifest does not list")
                start, size = piece["start"], spec[1]
                if spec[0] != entry["dtype"] or len(start) != len(entry["shape"]) or len(size) != len(start):
                    return f"the piece {piece['key']!r} of tensor {name!r} is not a {entry['dtype']} slice of it"
                if any(a < 0 or a + s > n for a, s, n in zip(start, size, entry["shape"])):
                    return f"the piece {piece['key']!r} lies outside tensor {name!r} {entry['shape']}"
                box = [(a, a + s) for a, s in zip(start, size)]
                if any(all(lo < b_hi and b_lo < hi for (lo, hi), (b_lo, b_hi) in zip(box, other))
                       and _volume(size) > 0 for other in boxes):
                    return f"the pieces of tensor {name!r} overlap"
                boxes.append(box)
            if sum(_volume(hi - lo for lo, hi in box) for box in boxes) != _volume(entry["shape"]):
                return f"the pieces of tensor {name!r} do not cover it"
    return None


def _normalized(index: Any, shape: tuple[int, ...]) -> tuple[slice, ...]:
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) < len(shape):
        index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for item, size in zip(index, shape):
        if not isinstance(item, slice):
            raise TypeError(f"a stored tensor is read by slices, got {item!r}")
        start, stop, step = item.indices(size)
        if step != 1:
            raise TypeError("a stored tensor is read by contiguous slices")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


class Stored:
    """One tensor of a sharded checkpoint, read on demand: ``stored[slices]`` reads the pieces that overlap the
    slice (each verified against its SHA-256) and returns a numpy array; ``np.asarray(stored)`` reads all of it."""

    def __init__(self, directory: Path, name: str, entry: dict[str, Any], sizes: dict[tuple[str, str], list[int]]):
        self.directory, self.name = directory, name
        self.shape = tuple(entry["shape"])
        self.dtype = np.dtype(entry["dtype"])
        self.pieces = [(p["file"], p["key"], tuple(p["start"]), tuple(sizes[p["file"], p["key"]]), p["sha256"])
                       for p in entry["pieces"]]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _piece(self, file: str, key: str, digest: str) -> np.ndarray:
        from safetensors import safe_open

        path = self.directory / file
        try:
            with safe_open(str(path), framework="np") as handle:
                array = handle.get_tensor(key)
        except Exception as exc:    # noqa: BLE001 (safetensors raises its own error types for a damaged file)
            raise CheckpointError(f"checkpoint file {str(path)!r} cannot be read: {exc}") from None
        if _digest(array) != digest:
            raise CheckpointError(f"checkpoint file {str(path)!r} is corrupted: piece {key!r} differs from its "
                                  "SHA-256 in the manifest")
        return array

    def __getitem__(self, index: Any) -> np.ndarray:
        want = _normalized(index, self.shape)
        out = np.empty(tuple(s.stop - s.start for s in want), dtype=self.dtype)
        for file, key, start, size, digest in self.pieces:
            overlap = [(max(w.start, a), min(w.stop, a + s)) for w, a, s in zip(want, start, size)]
            if any(lo >= hi for lo, hi in overlap):
                continue
            piece = self._piece(file, key, digest)
            src = tuple(slice(lo - a, hi - a) for (lo, hi), a in zip(overlap, start))
            dst = tuple(slice(lo - w.start, hi - w.start) for (lo, hi), w in zip(overlap, want))
            out[dst] = piece[src]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        full = self[tuple(slice(None) for _ in self.shape)]
        return full if dtype is None else full.astype(dtype)


def stored_tensors(directory: Path, manifest: dict[str, Any], kind: str) -> dict[str, Stored]:
    sizes = {(file, key): spec[1] for file, table in manifest["tensors"].items() for key, spec in table.items()}
    return {name: Stored(directory, name, entry, sizes) for name, entry in manifest["layout"][kind].items()}
