"""Result files, written atomically (a reader never sees half a file), and the arrays xbridge exchanges between
processes (.npz, never unpickled).

Nothing of the user's is replaced: every file xbridge writes goes through :func:`write_atomic`, which notes its name
in the folder's ledger (``.xbridge-written``, one name a line); an existing file at an output path is replaced only
when that ledger names it. The commands check their output paths before any work (:func:`check_writable` with the
names a command writes, :func:`check_file_writable`); the write itself checks again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ConfigError

LEDGER = ".xbridge-written"
_claimed: list[tuple[int, Path | None]] = []    # this process's claimed folders: (descriptor, the folder if made here)


def written_by_xbridge(path: Path) -> bool:
    """Whether ``path`` is a file xbridge wrote (named in its folder's ledger)."""
    try:
        names = (path.parent / LEDGER).read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return False
    return path.name in names


def check_replaceable(path: Path, flag: str) -> None:
    """Refuse an output path that holds something xbridge did not write (a user's file or folder)."""
    if path.is_dir() and not path.is_symlink():
        raise ConfigError(f"{flag}: {str(path)!r} is a folder where xbridge writes a file; move it or choose "
                          "another path")
    if (path.exists() or path.is_symlink()) and not written_by_xbridge(path):
        raise ConfigError(f"{flag}: {str(path)!r} exists and xbridge did not write it; xbridge never replaces a "
                          "file of yours: move it or choose another path")


def _note_written(path: Path) -> None:
    ledger = path.parent / LEDGER
    with open(ledger, "a+", encoding="utf-8") as handle:      # several processes may write into one folder
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        if path.name not in handle.read().splitlines():
            handle.write(path.name + "\n")


def check_writable(directory: Path, flag: str, writes: tuple[str, ...] = ()) -> None:
    """Fail early (before any work) if ``directory`` cannot hold results, or if one of the files ``writes`` names
    (relative to it) exists there and xbridge did not write it."""
    _check_names(directory, flag)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{flag} {str(directory)!r} exists and is not a directory")
    _check_creatable(directory, flag)
    for name in writes:
        check_replaceable(directory / name, flag)


def check_file_writable(path: Path, flag: str) -> None:
    """Fail early (before any work) if the file ``path`` cannot be written (a folder there, an unwritable parent, a
    name longer than the file system takes)."""
    _check_names(path, flag)
    if path.is_dir():
        raise ConfigError(f"{flag} {str(path)!r} is a directory; give a file name (e.g. {str(path / 'state.npz')!r})")
    _check_creatable(path.parent, flag, shown=path)
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {str(path)!r} exists and is not writable")
    check_replaceable(path, flag)


def claim(directory: Path, flag: str) -> None:
    """Make ``directory`` this command's alone until :func:`release_claims` (or the process's end): two commands
    given one output folder at once would overwrite each other's records, so the second is refused before any
    work. The lock is the folder's own (fcntl on its descriptor): nothing is written into it for the lock, and a
    folder made here that stays empty (a command refused after this) is removed again."""
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise ConfigError(f"{flag} {str(directory)!r} cannot be opened: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{flag} {str(directory)!r} is being written by another xbridge command; give each "
                          "command its own folder") from None
    _claimed.append((fd, directory if made else None))


def release_claims() -> None:
    """Give back every folder this process claimed (the end of a command)."""
    while _claimed:
        fd, made = _claimed.pop()
        with contextlib.suppress(OSError):
            os.close(fd)
        if made is not None:
            with contextlib.suppress(OSError):      # only while empty
                made.rmdir()


def _check_names(path: Path, flag: str) -> None:
    limit = os.pathconf("/", "PC_NAME_MAX")
    for part in path.parts:
        if len(os.fsencode(part)) > limit:
            raise ConfigError(f"{flag} {str(path)[:60]!r}...: the name {part[:24]!r}... is longer than the {limit} "
                              "bytes a file name may have")


def _check_creatable(directory: Path, flag: str, shown: Path | None = None) -> None:
    """The nearest existing folder of ``directory`` is a folder where a file can be created (tried: permission bits
    say nothing for root, nor on a read-only or special file system)."""
    shown = directory if shown is None else shown
    probe = next((p for p in (directory.absolute(), *directory.absolute().parents) if p.exists()), Path("/"))
    if not probe.is_dir():
        raise ConfigError(f"{flag} {str(shown)!r}: {str(probe)!r} is not a directory")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".xbridge-probe-")
    except OSError as exc:
        raise ConfigError(f"{flag} {str(shown)!r} is not writable: {probe} refuses new files "
                          f"({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(name)


def write_atomic(path: Path, write: Callable[[Any], None], mode: str = "w") -> Path:
    """Write through a temporary file in the same directory, fsync, then rename: readers never see half a file.
    A file already there is replaced only if xbridge wrote it (:func:`check_replaceable`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    check_replaceable(path, "output")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _note_written(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    return write_atomic(path, lambda handle: handle.write(text))


def write_json(path: Path, data: Any) -> Path:
    return write_atomic(path, lambda handle: json.dump(data, handle, indent=2))


def read_npz(path: Path, flag: str) -> dict[str, Any]:
    """Arrays written by :func:`write_npz`; never unpickles. Errors name the flag and the file."""
    import zipfile

    import numpy as np

    if not path.is_file():
        raise ConfigError(f"{flag} {str(path)!r} does not exist")
    try:
        data = np.load(path, allow_pickle=False)
        if isinstance(data, np.lib.npyio.NpzFile):
            with data:
                return {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{flag} {str(path)!r} is not a readable .npz of arrays: {exc}") from None
    raise ConfigError(f"{flag} {str(path)!r} is a single array (.npy); give an .npz of named arrays "
                      "(numpy.savez(path, **{name: array}))")


def write_npz(path: Path, arrays: dict[str, Any]) -> Path:
    """numpy arrays by name (np.load(..., allow_pickle=False) reads them back)."""
    import numpy as np

    return write_atomic(path, lambda handle: np.savez(handle, **arrays), mode="wb")
