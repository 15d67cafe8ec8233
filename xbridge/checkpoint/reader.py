"""Reading a checkpoint back: verified before anything is loaded.

Loading checks, before anything is used: the commit, every manifest field's type, the step against the directory's
name and the ``loop/updates`` counter, both files' sizes and checksums, and every tensor's name, shape and dtype
against the program's. A step directory that is a symbolic link is refused (pruning would delete through it).
A sharded checkpoint's tensors are read slice by slice (shards.py: each piece checked against its SHA-256).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError
from ..ir import serialize
from ..ir.program import Program
from . import shards
from .format import COMMIT, FORMAT, MANIFEST, MODEL_FILE, STEP_NAME, TRAIN_FILE, VERSION, resume_hash


@dataclass
class Checkpoint:
    """``weights`` and ``train``: numpy arrays, or for a sharded checkpoint :class:`shards.Stored` tensors that
    read the slices asked for (``np.asarray`` reads one whole)."""
    path: Path
    manifest: dict[str, Any]
    weights: dict[str, Any]
    train: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def _resumes(program: Program, written: str) -> bool:
    """Whether a checkpoint whose manifest says ``written`` resumes ``program``: today's hash, or the one written
    before 2026-12-01 (without the mesh and the sharding only), so that older checkpoints still load."""
    return written in (resume_hash(program), serialize.config_hash(program, leave_out=("mesh", "sharding")))


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint manifest {str(file)!r} cannot be read: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{str(file)!r} is not an xbridge checkpoint manifest (format {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {str(path)!r} has format version {manifest.get('version')!r}; this "
                              f"xbridge reads version {VERSION}")
    for key in ("step", "files", "tensors", "resume_hash", "config_hash"):
        if key not in manifest:
            raise CheckpointError(f"checkpoint manifest {str(file)!r} has no {key!r}")
    _check_commit(path)
    problem = _malformed(manifest)
    if problem is not None:
        raise CheckpointError(f"checkpoint manifest {str(file)!r}: {problem}")
    match = STEP_NAME.match(path.name)
    if match and int(match.group(1)) != manifest["step"]:
        raise CheckpointError(f"checkpoint {str(path)!r} says step {manifest['step']} in its manifest, its directory "
                              f"name says {int(match.group(1))}")
    return manifest


def _check_commit(path: Path) -> None:
    try:
        line = (path / COMMIT).read_text().split()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} has no {COMMIT} file: it was not completely written, or by "
                              "an xbridge older than this one") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {str(path / COMMIT)!r} cannot be read: {exc}") from None
    digest = hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()
    if line != ["sha256", digest]:
        raise CheckpointError(f"checkpoint manifest {str(path / MANIFEST)!r} was changed after it was written (its "
                              f"SHA-256 differs from {COMMIT}'s)")


def _malformed(manifest: dict[str, Any]) -> str | None:
    """The first field of the manifest that is not of the type its writer gives it."""
    step = manifest["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"'step' must be a whole number >= 0, got {step!r}"
    files, tensors = manifest["files"], manifest["tensors"]
    if not isinstance(files, dict):
        return f"'files' must be an object, got {type(files).__name__}"
    for name, entry in files.items():
        if (not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int)
                or not isinstance(entry.get("sha256"), str)):
            return f"'files' entry {name!r} must hold an integer 'bytes' and a string 'sha256', got {entry!r}"
    if not isinstance(tensors, dict):
        return f"'tensors' must be an object, got {type(tensors).__name__}"
    for name, table in tensors.items():
        if not isinstance(table, dict):
            return f"'tensors' entry {name!r} must be an object, got {type(table).__name__}"
        for tensor, spec in table.items():
            if (not isinstance(spec, list) or len(spec) != 2 or not isinstance(spec[0], str)
                    or not isinstance(spec[1], list)):
                return f"tensor {tensor!r} of {name!r} must be [dtype, shape], got {spec!r}"
    return shards.malformed_layout(manifest) if "layout" in manifest else None


def _read_tensors(path: Path, name: str, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    import safetensors.numpy

    file = path / name
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint manifest {str(path / MANIFEST)!r} lists no {name}")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {str(file)!r} cannot be read: {exc.strerror}") from None
    if len(data) != expected["bytes"]:
        raise CheckpointError(f"checkpoint file {str(file)!r} is truncated or padded: {len(data)} bytes, the "
                              f"manifest says {expected['bytes']}")
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"checkpoint file {str(file)!r} is corrupted: its SHA-256 differs from the manifest's")
    arrays = safetensors.numpy.load(data)
    for tensor, (dtype, shape) in manifest["tensors"].get(name, {}).items():
        if tensor not in arrays:
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing tensor {tensor!r}")
        if str(arrays[tensor].dtype) != dtype or list(arrays[tensor].shape) != shape:
            raise CheckpointError(f"tensor {tensor!r} in {str(file)!r} is {arrays[tensor].dtype}"
                                  f"{list(arrays[tensor].shape)}, the manifest says {dtype}{shape}")
    return arrays


def _check_sizes(path: Path, manifest: dict[str, Any]) -> None:
    """A sharded checkpoint's files against the manifest's sizes and headers (each piece is checked against its
    SHA-256 when it is read; reading only the slices needed is the point)."""
    from safetensors import safe_open

    for name, expected in manifest["files"].items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {str(file)!r} cannot be read: {exc.strerror}") from None
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} is truncated or padded: {size} bytes, the "
                                  f"manifest says {expected['bytes']}")
        try:
            with safe_open(str(file), framework="np") as handle:
                keys = set(handle.keys())
        except Exception as exc:    # noqa: BLE001 (safetensors raises its own error types for a damaged header)
            raise CheckpointError(f"checkpoint file {str(file)!r} cannot be read: {exc}") from None
        missing = sorted(set(manifest["tensors"].get(name, {})) - keys)
        if missing:
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing tensor {missing[0]!r}")


def _check_against_program(path: Path, program: Program, weights: dict[str, Any], train: dict[str, Any]) -> None:
    from ..torch.weights import meta_model, shape_mismatch

    problem = shape_mismatch(program, weights, f"checkpoint {str(path)!r}")
    if problem is not None:
        raise CheckpointError(problem)
    model = meta_model(program)
    params = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for key, array in train.items():
        if not key.startswith("optim/"):
            continue
        param, _, slot = key[len("optim/"):].rpartition("/")
        if param not in params:
            raise CheckpointError(f"checkpoint {str(path)!r} has optimizer state {key!r} for a parameter program "
                                  f"{program.name!r} does not have")
        if slot != "step" and tuple(array.shape) != params[param]:
            raise CheckpointError(f"optimizer state {key!r} in checkpoint {str(path)!r} has shape "
                                  f"{tuple(array.shape)}, parameter {param!r} is {params[param]}")
    if "loop/updates" not in train:
        raise CheckpointError(f"checkpoint {str(path)!r} is missing tensor 'loop/updates'")
    expected = {name: t.dtype for name, t in model.state_dict().items()}
    for name, array in weights.items():
        want = expected[name]
        kind = "float32" if want.is_floating_point else str(want).removeprefix("torch.")
        if str(array.dtype) != kind:    # floating state is stored in float32 (format.py)
            raise CheckpointError(f"tensor {name!r} in checkpoint {str(path)!r} is {array.dtype}; program "
                                  f"{program.name!r} stores it as {kind}")
    for key, array in train.items():
        if key.startswith("optim/") and not key.endswith("/step"):
            param = key[len("optim/"):].rpartition("/")[0]      # a complex parameter's state is complex (torch's)
            kind = "complex64" if param in expected and expected[param].is_complex else "float32"
            if str(array.dtype) != kind:
                raise CheckpointError(f"optimizer state {key!r} in checkpoint {str(path)!r} is {array.dtype}, not "
                                      f"{kind}")


def load(path: Path, program: Program, allow_config_change: bool = False) -> Checkpoint:
    """Verify and read checkpoint ``path`` for ``program``: manifest, sizes and checksums, then every tensor's
    name and shape against the program. Raises CheckpointError (one line) on the first problem."""
    manifest = _read_manifest(path)
    from ..data.source import changed_data

    changed = changed_data(manifest.get("config", {}), program.config())
    if changed is not None:   # the batches after the checkpoint would not be the ones an uninterrupted run reads
        raise CheckpointError(f"checkpoint {str(path)!r}: {changed}; resume with the data it was written with")
    if not _resumes(program, manifest["resume_hash"]) and not allow_config_change:
        raise CheckpointError(f"checkpoint {str(path)!r} belongs to another program config (program "
                              f"{manifest.get('program')!r}, config hash {manifest['config_hash']}; this is "
                              f"{program.name!r}, {program.config_hash}); pass --allow-config-change to load it anyway")
    if "layout" in manifest:
        _check_sizes(path, manifest)
        weights: dict[str, Any] = shards.stored_tensors(path, manifest, "model")
        train: dict[str, Any] = shards.stored_tensors(path, manifest, "train")
    else:
        weights = _read_tensors(path, MODEL_FILE, manifest)
        train = _read_tensors(path, TRAIN_FILE, manifest)
    _check_against_program(path, program, weights, train)
    updates = np.asarray(train["loop/updates"])
    if updates.shape != () or int(updates) != manifest["step"]:
        raise CheckpointError(f"checkpoint {str(path)!r} says step {manifest['step']} in its manifest, but its "
                              f"optimizer has made {updates.tolist()} updates")
    return Checkpoint(path, manifest, weights, train)


def config_changes(manifest: dict[str, Any], program: Program) -> list[str]:
    """Top-level config fields that differ between the checkpoint and ``program`` (for the run record)."""
    old, new = manifest.get("config", {}), program.config()
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
