"""Where compilation caches live: ``$XBRIDGE_CACHE_DIR/<name>``, default ``~/.cache/xbridge/<name>``
(``$XDG_CACHE_HOME`` is honoured). Kept between runs, so a second run of a program loads what the first compiled
(Inductor's FX-graph and AOTAutograd caches, JAX's persistent compilation cache, torch_xla's on TPU).

``xbridge cache`` lists them with their sizes; ``xbridge cache --clear [NAME ...]`` empties them of what the
frameworks wrote there, by the names each writes (:data:`WRITTEN`): anything else in a cache folder (a user's own
file) is listed and left.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

# The caches xbridge itself writes, by folder name (torch_xla's carries the device type: torch_xla-tpu).
KNOWN = {"inductor": "Inductor FX-graph, AOTAutograd and generated-code caches (TORCHINDUCTOR_CACHE_DIR)",
         "jax": "JAX persistent compilation cache",
         "torch_xla": "torch_xla persistent compilation cache (TPU; PJRT CPU cannot reload executables)"}
# A user's own setting wins over xbridge's folder for these caches.
OVERRIDES = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "jax": "JAX_COMPILATION_CACHE_DIR"}


# What each framework writes in its cache folder, by entry name at the folder's top: Inductor's generated code in
# two-character buckets and its named subfolders (torch/_inductor/codecache.py, _functorch/_aot_autograd/
# autograd_cache.py); JAX's persistent cache entries KEY-cache and KEY-atime (jax/_src/lru_cache.py); torch_xla's
# entries are named by their hash. isa_probes: xbridge's own record of Inductor's CPU probes (backends/inductor/
# patches.py), beside the code they describe.
WRITTEN = {
    "inductor": re.compile(r"[a-z0-9]{2}|aotautograd|fxgraph|locks|cache|gcc|precompiled_headers|torch_cutlass|"
                           r"aoti_eager|dynamo|triton|isa_probes"),
    "jax": re.compile(r".+-(cache|atime)"),
    "torch_xla": re.compile(r"-?(0x)?[0-9a-fA-F]+"),
}


def cache_root() -> Path:
    """The cache folder: ``XBRIDGE_CACHE_DIR``, or ``xbridge`` under the user's cache folder. A path that is there
    and is not a folder is refused (it never holds a cache: `xbridge cache` said "no cache yet" and exited 0)."""
    root = os.environ.get("XBRIDGE_CACHE_DIR")
    path = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xbridge"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{_named_root()} {str(path)!r} is a file, not a folder; point it at a folder (made if "
                          "missing) or remove the file")
    return path


def _named_root() -> str:
    return "XBRIDGE_CACHE_DIR" if os.environ.get("XBRIDGE_CACHE_DIR") else "the cache folder"


def cache_dir(name: str) -> Path:
    """The cache folder ``name``, created (with the root) readable and writable by the user alone (0700): the
    compilers load what they find there (Inductor's generated code, serialized executables), so a folder others
    may write into is refused (world-writable)."""
    root = cache_root()
    path = root / name
    for folder in (root, path):
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ConfigError(f"{_named_root()} {str(root)!r}: {str(folder)!r} cannot be a folder (a file is in "
                              "the way)") from None
        except PermissionError:
            raise ConfigError(f"{_named_root()} {str(root)!r}: {str(folder)!r} cannot be created here "
                              "(permission denied)") from None
        mode = folder.stat().st_mode
        if mode & stat.S_IWOTH:
            raise ConfigError(f"{_named_root()}: {str(folder)!r} can be written by other users (mode "
                              f"{stat.S_IMODE(mode):o}); the compilers load code from it: chmod 700 it or choose "
                              "another folder")
    return path


def _kind(name: str) -> str | None:
    return name if name in KNOWN else ("torch_xla" if name.startswith("torch_xla-") else None)


@dataclass(frozen=True)
class CacheInfo:
    name: str
    path: str
    what: str
    files: int                     # the framework's files (what --clear removes)
    bytes: int
    overridden_by: str | None      # an environment variable that sends this cache elsewhere in this shell
    not_a_cache: tuple[str, ...] = ()   # entries the framework did not write: listed, never removed


def _entries(path: Path, kind: str) -> tuple[list[Path], list[Path]]:
    """The folder's top entries the framework wrote, and the others."""
    written: list[Path] = []
    other: list[Path] = []
    for entry in sorted(path.iterdir()):
        mine = WRITTEN[kind].fullmatch(entry.name) and not entry.is_symlink()
        (written if mine else other).append(entry)
    return written, other


def describe() -> list[CacheInfo]:
    """Every cache folder under the root, with what it holds and its size."""
    root = cache_root()
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and _kind(p.name)) if root.is_dir() else []
    out = []
    for name in names:
        kind = _kind(name)
        assert kind is not None
        written, other = _entries(root / name, kind)
        files = [f for entry in written for f in ([entry] if entry.is_file() else entry.rglob("*"))
                 if f.is_file() and not f.is_symlink()]
        override = OVERRIDES.get(kind)
        out.append(CacheInfo(name, str(root / name), KNOWN[kind], len(files), sum(p.stat().st_size for p in files),
                             override if override and os.environ.get(override) else None,
                             tuple(entry.name for entry in other)))
    return out


def clear(names: list[str]) -> list[CacheInfo]:
    """Empty the named caches (all of them when ``names`` is empty) of the frameworks' entries; return what was
    removed (with the entries left). Only folders that are xbridge caches are touched: an unknown name is refused
    before anything is removed."""
    present = {info.name: info for info in describe()}
    for name in names:
        if _kind(name) is None:
            raise ConfigError(f"cache {name!r} is not an xbridge cache; known: {', '.join(sorted(KNOWN))} "
                              "(torch_xla-DEVICE for torch_xla)")
    chosen = [present[n] for n in names if n in present] if names else list(present.values())
    for info in chosen:
        kind = _kind(info.name)
        assert kind is not None
        for entry in _entries(Path(info.path), kind)[0]:
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    return chosen
