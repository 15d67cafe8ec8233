"""Portable checkpoints: one format for every backend, written atomically, verified before anything is loaded.

A checkpoint is a directory ``step-NNNNNNNN`` (the number of completed optimizer steps) holding

- ``model.safetensors``: parameters and buffers, full (unsharded) arrays under the eager state_dict names;
- ``train.safetensors``: everything else the next step depends on, under backend-neutral names:
  ``optim/<param>/<key>`` (torch.optim's per-parameter keys: ``step``, ``exp_avg``, ``exp_avg_sq``,
  ``momentum_buffer``), ``loop/updates`` (the schedule's count), ``scaler/*`` (dynamic loss scaling) and
  ``rng/*`` (framework RNG states);
- ``manifest.json``: step, data position, program config and its hashes, precision, target, mesh, versions, and
  the size and SHA-256 of both tensor files;
- ``COMMIT``: the SHA-256 of ``manifest.json``, written last: a manifest edited or damaged afterwards is refused.

Loading checks, before anything is used: the commit, every manifest field's type, the step against the directory's
name and the ``loop/updates`` counter, both files' sizes and checksums, and every tensor's name, shape and dtype
against the program's. A step directory that is a symbolic link is refused (pruning would delete through it).

Floating arrays are stored in float32 (exact for bf16 and fp16 state; the manifest records the dtype the run kept
them in). Nothing is pickled: safetensors holds only a JSON header and raw bytes, so loading never runs code.

Saving writes every file into a hidden temporary directory next to the checkpoints, fsyncs the files and the
directory, then renames it into place: a process killed at any moment leaves either the new checkpoint complete
or no trace of it besides a ``.tmp-*`` directory, which the next save removes when its owner is dead. A save that
fails (disk full) removes its temporary directory and keeps the last good checkpoint. One writer at a time: a run
holds an exclusive lock (``.lock``, fcntl) on its checkpoint directory and a second one is refused up front.

A run spread over several processes writes a sharded checkpoint instead (xbridge/run/shards.py): each process
writes the pieces it holds into its own hidden temporary directory; when all have written (a barrier), process 0
moves their files into its own, writes the manifest (with a ``layout``: every tensor's global shape and dtype and
where each of its pieces lies) and ``COMMIT``, and renames it into place; the others wait for that before going on.
A process killed at any moment stops the job before the rename, so the previous checkpoint stays the newest.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..contract import PieceWriter
from ..errors import CheckpointError, NonFinite, RunError
from ..ir import serialize
from ..ir.program import Program
from . import shards

FORMAT = "xbridge-checkpoint"
VERSION = 1
MODEL_FILE, TRAIN_FILE, MANIFEST, COMMIT = "model.safetensors", "train.safetensors", "manifest.json", "COMMIT"
LOCK = ".lock"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_TMP_DIR = re.compile(r"^\.tmp-step-\d{8}-(\d+)(-p\d+)?$")


def resume_hash(program: Program) -> str:
    """The config hash without the mesh and the sharding rules, which change where arrays live, and without the
    step's scan over layers and remat, which change how the step is compiled: none changes the arithmetic, so a
    checkpoint resumes under another mesh (resharding on load), scanned or unrolled, with or without remat."""
    return serialize.config_hash(program, leave_out=("mesh", "sharding", "step.scan_layers", "step.remat",
                                                     "step.layers"))


def _resumes(program: Program, written: str) -> bool:
    """Whether a checkpoint whose manifest says ``written`` resumes ``program``: today's hash, or the one written
    before 2026-12-01 (without the mesh and the sharding only), so that older checkpoints still load."""
    return written in (resume_hash(program), serialize.config_hash(program, leave_out=("mesh", "sharding")))


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``directory`` (renamed into place, manifest present), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def locate(path: Path) -> Path:
    """``path`` itself when it is a checkpoint, else the newest checkpoint in the directory ``path``."""
    if (path / MANIFEST).is_file():
        _refuse_link(path, "--resume")
        return path
    if not path.exists():
        raise CheckpointError(f"--resume {str(path)!r} does not exist")
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(f"--resume {str(path)!r} holds no checkpoint (no step-NNNNNNNN/{MANIFEST})")
    _refuse_link(found[-1][1], "--resume")
    return found[-1][1]


def _refuse_link(path: Path, flag: str) -> None:
    if path.is_symlink():
        raise CheckpointError(f"{flag}: checkpoint {str(path)!r} is a symbolic link; xbridge deletes old checkpoints "
                              "and never through a link: copy the checkpoint there instead")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's process
        return True
    return True


# ---------------------------------------------------------------------------------------------- writing

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> dict[str, Any]:
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _describe(arrays: dict[str, np.ndarray]) -> dict[str, list[Any]]:
    return {name: [str(a.dtype), list(a.shape)] for name, a in arrays.items()}


def _first_nonfinite(arrays: dict[str, np.ndarray]) -> str | None:
    """The first tensor holding NaN or Inf (a sharded save checks its pieces in shards.write_part)."""
    for name, array in arrays.items():
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            return name
    return None


class Writer:
    """Saves checkpoints of one run into ``directory``, keeping the newest ``keep``."""

    def __init__(self, directory: Path, keep: int, start_step: int) -> None:
        if keep < 1:
            raise CheckpointError(f"--keep must be >= 1, got {keep}")
        self.directory, self.keep = directory, keep
        self.last: Path | None = None
        self._lock_fd: int | None = None
        self._check_directory(start_step)

    def _check_directory(self, start_step: int) -> None:
        directory = self.directory
        if directory.exists() and not directory.is_dir():
            raise CheckpointError(f"--checkpoint-dir {str(directory)!r} exists and is not a directory")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"--checkpoint-dir {str(directory)!r} cannot be created: {exc.strerror}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise CheckpointError(f"--checkpoint-dir {str(directory)!r} is not writable")
        for _, found in list_checkpoints(directory):
            if found.is_symlink():
                raise CheckpointError(f"--checkpoint-dir {str(directory)!r}: {found.name} is a symbolic link; xbridge "
                                      "deletes old checkpoints and never through a link: move it out first")
        later = [step for step, _ in list_checkpoints(directory) if step > start_step]
        if later:
            raise CheckpointError(f"--checkpoint-dir {str(directory)!r} already holds checkpoints up to step "
                                  f"{max(later)} and this run starts at step {start_step}; resume from it "
                                  f"(--resume {directory}) or choose another directory")

    def lock(self) -> None:
        """Take the directory's exclusive lock, held until :meth:`release` or the process's end: a second run
        writing here is refused before its first step. Taken after the backend is prepared, where the processes
        that never write (torchrun's ranks other than 0) have left the run."""
        directory = self.directory
        try:
            fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CheckpointError(f"--checkpoint-dir {str(directory)!r}: its lock file cannot be created: "
                                  f"{exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointError(f"--checkpoint-dir {str(directory)!r} is in use by another run (pid {owner}); "
                                  "give each run its own checkpoint directory") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd       # closed (and the lock released) when the process ends

    def release(self) -> None:
        """Give the directory's lock back (the end of a run; the process ending does it too)."""
        fd = self._lock_fd
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
            self._lock_fd = None

    def _remove_stale(self) -> None:
        """Temporary directories of saves whose process died (killed mid-save); a live owner's are left alone."""
        for stale in self.directory.glob(".tmp-step-*"):
            match = _TMP_DIR.match(stale.name)
            owner = int(match.group(1)) if match else None
            if owner is None or (owner != os.getpid() and not _alive(owner)):
                shutil.rmtree(stale, ignore_errors=True)

    def _refuse(self, step: int, model: dict[str, Any], train: dict[str, Any]) -> Path:
        bad = _first_nonfinite(model) or _first_nonfinite(train)
        if bad is not None:
            raise self._not_saving(step, f"{bad!r} holds NaN or Inf")
        return self._final(step)

    def _not_saving(self, step: int, why: str) -> RunError:
        kept = f"; the last good checkpoint is {self.last}" if self.last else ""
        return RunError(f"not saving step {step}: {why}{kept}")

    def _final(self, step: int) -> Path:
        final = step_dir(self.directory, step)
        if final.exists():
            raise CheckpointError(f"checkpoint {str(final)!r} already exists; it is not overwritten")
        return final

    def _failed(self, step: int, exc: OSError) -> RunError:
        kept = f"; the last good checkpoint is {self.last}" if self.last else ""
        return RunError(f"checkpoint of step {step} could not be written to {str(self.directory)!r}: "
                        f"{exc.strerror or exc}{kept}")

    def _prune(self) -> None:
        for _, old in list_checkpoints(self.directory)[:-self.keep]:
            if not old.is_symlink():
                shutil.rmtree(old)

    def save(self, step: int, model: dict[str, Any], train: dict[str, Any], info: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` of a state whole in this process; refuses (RunError) a state holding NaN/Inf,
        keeping the last good one."""
        import safetensors.numpy

        final = self._refuse(step, model, train)
        self._remove_stale()
        tmp = self.directory / f".tmp-step-{step:08d}-{os.getpid()}"
        try:
            tmp.mkdir()
            files = {MODEL_FILE: write_file(tmp / MODEL_FILE, safetensors.numpy.save(model))}
            files[TRAIN_FILE] = write_file(tmp / TRAIN_FILE, safetensors.numpy.save(train))
            self._publish(step, tmp, final, {**info, "files": files, "tensors": {MODEL_FILE: _describe(model),
                                                                                 TRAIN_FILE: _describe(train)}},
                          list(train))
        except OSError as exc:      # disk full, quota, I/O error: nothing half-written stays, the last good one does
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(step, exc) from None
        self.last = final
        self._prune()
        return final

    def save_pieces(self, step: int, pieces: PieceWriter, info: dict[str, Any]) -> Path:
        """Write checkpoint ``step`` in pieces (``Executable`` with the ShardedCheckpoint capability). With a
        ``pieces.group``, every process of the group calls it and writes its part into a folder of its own, and
        process 0 commits once all have (module docstring); without one, ``pieces.write`` has every process write its
        part into this process's folder (inductor's ranks, which this process drives), and this process commits. A
        process that fails raises and stops; the job's supervisor then stops the others, blocked at a barrier."""
        final = self._final(step)
        group = pieces.group
        if group is None:
            self._remove_stale()
            tmp = self.directory / f".tmp-step-{step:08d}-{os.getpid()}"
        else:
            group.barrier(f"xbridge-save-{step}-begin")
            if group.index == 0:
                # process 0 holds the directory's lock, so no other run saves here, and this job's processes create
                # their folders after the next barrier: every temporary folder present is a dead save's
                for stale in self.directory.glob(".tmp-step-*"):
                    shutil.rmtree(stale, ignore_errors=True)
            group.barrier(f"xbridge-save-{step}-clean")
            tmp = self.directory / f".tmp-step-{step:08d}-{os.getpid()}-p{group.index}"
        try:
            tmp.mkdir()
            parts = pieces.write(tmp)
            if group is not None:
                write_file(tmp / shards.part_record(group.index), json.dumps(parts[0]).encode())
                _fsync_dir(tmp)
            else:
                self._commit(step, tmp, final, info, parts)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._failed(step, exc) from None
        except NonFinite as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise self._not_saving(step, str(exc)) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if group is not None:
            group.barrier(f"xbridge-save-{step}-written")
            if group.index == 0:
                try:
                    self._commit(step, tmp, final, info, self._gather_parts(step, tmp, group.count))
                except OSError as exc:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise self._failed(step, exc) from None
            group.barrier(f"xbridge-save-{step}-committed")
        self.last = final
        if group is None or group.index == 0:
            self._prune()
        return final

    def _gather_parts(self, step: int, tmp: Path, count: int) -> list[dict[str, Any]]:
        """Process 0 of a group: every process's part, its files moved into ``tmp``."""
        parts = []
        for index in range(count):
            found = list(self.directory.glob(f".tmp-step-{step:08d}-*-p{index}/{shards.part_record(index)}"))
            if len(found) != 1:
                raise CheckpointError(f"checkpoint of step {step}: process {index} left {len(found)} parts in "
                                      f"{str(self.directory)!r}, not one")
            parts.append(json.loads(found[0].read_text()))
            found[0].unlink()
            if found[0].parent != tmp:
                for file in found[0].parent.iterdir():
                    os.rename(file, tmp / file.name)
                found[0].parent.rmdir()
        return parts

    def _commit(self, step: int, tmp: Path, final: Path, info: dict[str, Any], parts: list[dict[str, Any]]) -> None:
        """The manifest of every process's ``parts`` (their files in ``tmp``) and COMMIT, then the rename."""
        merged = shards.merge_parts(parts)
        self._publish(step, tmp, final, {**info, "processes": len(parts), **merged}, list(merged["layout"]["train"]))

    def _publish(self, step: int, tmp: Path, final: Path, fields: dict[str, Any], train: list[str]) -> None:
        """The manifest (``fields`` with the format, the step, which RNG states ``train`` holds and the time), then
        COMMIT, fsyncs, and the rename of ``tmp`` into place."""
        manifest = {"format": FORMAT, "version": VERSION, "step": step, **fields,
                    "rng": sorted(k for k in train if k.startswith("rng/")),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        text = json.dumps(manifest, indent=2).encode()
        write_file(tmp / MANIFEST, text)
        write_file(tmp / COMMIT, f"sha256 {hashlib.sha256(text).hexdigest()}\n".encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(self.directory)


def manifest_info(program: Program, target: str, devices: int, mesh: dict[str, int], step: int,
                  versions: dict[str, str]) -> dict[str, Any]:
    return {"program": program.name, "config_hash": program.config_hash, "resume_hash": resume_hash(program),
            "config": program.config(), "precision": program.precision.name,
            "data": {"next_batch": step, "seed": program.seed, "batch_size": program.data.batch_size},
            "target": target, "devices": devices, "mesh": mesh, "versions": versions}


# ---------------------------------------------------------------------------------------------- reading

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
    match = _STEP_DIR.match(path.name)
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
    from ..weights import meta_model, shape_mismatch

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
        if str(array.dtype) != kind:    # floating state is stored in float32 (module docstring)
            raise CheckpointError(f"tensor {name!r} in checkpoint {str(path)!r} is {array.dtype}; program "
                                  f"{program.name!r} stores it as {kind}")
    for key, array in train.items():
        if key.startswith("optim/") and not key.endswith("/step") and str(array.dtype) != "float32":
            raise CheckpointError(f"optimizer state {key!r} in checkpoint {str(path)!r} is {array.dtype}, not "
                                  "float32")


def load(path: Path, program: Program, allow_config_change: bool = False) -> Checkpoint:
    """Verify and read checkpoint ``path`` for ``program``: manifest, sizes and checksums, then every tensor's
    name and shape against the program. Raises CheckpointError (one line) on the first problem."""
    manifest = _read_manifest(path)
    from ..data.contract import changed_data

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
