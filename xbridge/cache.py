"""Where compilation caches live: ``$XBRIDGE_CACHE_DIR/<name>``, default ``~/.cache/xbridge/<name>``
(``$XDG_CACHE_HOME`` is honoured). Kept between runs and test sessions so nothing recompiles from scratch."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str) -> Path:
    root = os.environ.get("XBRIDGE_CACHE_DIR")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xbridge"
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path
