"""Content fingerprints of data files and arrays: the IR records them, and a resume refuses a file that changed.

A file up to ``FULL_HASH_BYTES`` is hashed whole (BLAKE2b); a larger one by its size and 256 blocks of 64 KiB spread
evenly over it (the first and the last included), so fingerprinting a many-GiB token file reads 16 MiB. A change
confined to bytes between the sampled blocks of a large file is not seen; docs/data.md says so.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

FULL_HASH_BYTES = 64 << 20
BLOCK = 64 << 10
BLOCKS = 256


def of_file(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as handle:
        if size <= FULL_HASH_BYTES:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        else:
            for offset in np.linspace(0, max(size - BLOCK, 0), BLOCKS).astype(np.int64):
                handle.seek(int(offset), os.SEEK_SET)
                digest.update(handle.read(BLOCK))
    return digest.hexdigest()


def of_array(array: np.ndarray) -> str:
    digest = hashlib.blake2b(f"{array.dtype}{array.shape}".encode(), digest_size=16)
    digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()
