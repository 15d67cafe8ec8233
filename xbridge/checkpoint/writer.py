"""Writing checkpoints: atomically, one writer at a time, the oldest pruned; whole in this process or in pieces.

Saving writes every file into a hidden temporary directory next to the checkpoints, fsyncs the files and the
directory, then renames it into place: a process killed at any moment leaves either the new checkpoint complete
or no trace of it besides a ``.tmp-*`` directory, which the next save removes when its owner is dead. A save that
fails (disk full) removes its temporary directory and keeps the last good checkpoint. One writer at a time: a run
holds an exclusive lock (``.lock``, fcntl) on its checkpoint directory and a second one is refused up front.

A run spread over several processes writes a sharded checkpoint instead (shards.py): each process writes the
pieces it holds into its own hidden temporary directory; when all have written (a barrier), process 0 moves their
files into its own, writes the manifest (with a ``layout``: every tensor's global shape and dtype and where each
of its pieces lies) and ``COMMIT``, and renames it into place; the others wait for that before going on. A process
killed at any moment stops the job before the rename, so the previous checkpoint stays the newest.
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
from pathlib import Path
from typing import Any

import numpy as np

from ..contract import PieceWriter
from ..errors import CheckpointError, NonFinite, RunError
from . import shards
from .format import COMMIT, FORMAT, LOCK, MANIFEST, MODEL_FILE, TRAIN_FILE, VERSION, list_checkpoints, step_dir

_TMP_DIR = re.compile(r"^\.tmp-step-\d{8,}-(\d+)(-p\d+)?$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's process
        return True
    return True


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
        if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all():
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
