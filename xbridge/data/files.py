"""Opening the user's data files (resolved against the working directory) with one-line errors."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError


def existing_file(path: str | Path, owner: str) -> Path:
    file = Path(path).expanduser()
    if not file.is_file():
        where = "" if file.is_absolute() else f" (relative to the working directory {Path.cwd()})"
        raise ConfigError(f"{owner}: data file {str(path)!r} does not exist{where}")
    if file.stat().st_size == 0:
        raise ConfigError(f"{owner}: data file {str(path)!r} is empty")
    return file
