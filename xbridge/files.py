"""Result files, written atomically (a reader never sees half a file), and the arrays xbridge exchanges between
processes (.npz, never unpickled)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ConfigError


def check_writable(directory: Path, flag: str) -> None:
    """Fail early (before any work) if ``directory`` cannot hold results."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{flag} {str(directory)!r} exists and is not a directory")
    probe = directory if directory.exists() else next((p for p in directory.parents if p.exists()), Path("."))
    if not os.access(probe, os.W_OK):
        raise ConfigError(f"{flag} {str(directory)!r} is not writable")


def write_atomic(path: Path, write: Callable[[Any], None], mode: str = "w") -> Path:
    """Write through a temporary file in the same directory, fsync, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_json(path: Path, data: Any) -> Path:
    return write_atomic(path, lambda handle: json.dump(data, handle, indent=2))


def read_npz(path: Path, flag: str) -> dict[str, Any]:
    """Arrays written by :func:`write_npz`; never unpickles. Errors name the flag and the file."""
    import zipfile

    import numpy as np

    if not path.is_file():
        raise ConfigError(f"{flag} {str(path)!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{flag} {str(path)!r} is not a readable .npz of arrays: {exc}") from None


def write_npz(path: Path, arrays: dict[str, Any]) -> Path:
    """numpy arrays by name (np.load(..., allow_pickle=False) reads them back)."""
    import numpy as np

    return write_atomic(path, lambda handle: np.savez(handle, **arrays), mode="wb")
