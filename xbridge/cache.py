"""Where compilation caches live: ``$XBRIDGE_CACHE_DIR/<name>``, default ``~/.cache/xbridge/<name>``
(``$XDG_CACHE_HOME`` is honoured). Kept between runs, so a second run of a program loads what the first compiled
(Inductor's FX-graph and AOTAutograd caches, JAX's persistent compilation cache, torch_xla's on TPU).

``xbridge cache`` lists them with their sizes; ``xbridge cache --clear [NAME ...]`` empties them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

# The caches xbridge itself writes, by folder name (torch_xla's carries the device type: torch_xla-tpu).
KNOWN = {"inductor": "Inductor FX-graph, AOTAutograd and generated-code caches (TORCHINDUCTOR_CACHE_DIR)",
         "jax": "JAX persistent compilation cache",
         "torch_xla": "torch_xla persistent compilation cache (TPU; PJRT CPU cannot reload executables)"}
# A user's own setting wins over xbridge's folder for these caches.
OVERRIDES = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "jax": "JAX_COMPILATION_CACHE_DIR"}


def cache_root() -> Path:
    root = os.environ.get("XBRIDGE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xbridge"


def cache_dir(name: str) -> Path:
    """The cache folder ``name``, created (with the root) readable and writable by the user alone (0700): the
    compilers load what they find there (Inductor's generated code, serialized executables)."""
    root = cache_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = root / name
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _kind(name: str) -> str | None:
    return name if name in KNOWN else ("torch_xla" if name.startswith("torch_xla-") else None)


@dataclass(frozen=True)
class CacheInfo:
    name: str
    path: str
    what: str
    files: int
    bytes: int
    overridden_by: str | None      # an environment variable that sends this cache elsewhere in this shell


def describe() -> list[CacheInfo]:
    """Every cache folder under the root, with what it holds and its size."""
    root = cache_root()
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and _kind(p.name)) if root.is_dir() else []
    out = []
    for name in names:
        files = [p for p in (root / name).rglob("*") if p.is_file() and not p.is_symlink()]
        kind = _kind(name)
        assert kind is not None
        override = OVERRIDES.get(kind)
        out.append(CacheInfo(name, str(root / name), KNOWN[kind], len(files), sum(p.stat().st_size for p in files),
                             override if override and os.environ.get(override) else None))
    return out


def clear(names: list[str]) -> list[CacheInfo]:
    """Empty the named caches (all of them when ``names`` is empty); return what was removed. Only folders that
    are xbridge caches are touched: an unknown name is refused before anything is removed."""
    present = {info.name: info for info in describe()}
    for name in names:
        if _kind(name) is None:
            raise ConfigError(f"cache {name!r} is not an xbridge cache; known: {', '.join(sorted(KNOWN))} "
                              "(torch_xla-DEVICE for torch_xla)")
    chosen = [present[n] for n in names if n in present] if names else list(present.values())
    for info in chosen:
        shutil.rmtree(info.path)
    return chosen
