"""Data: the open contract (``source``) and the sources xbridge ships.

- ``ByteText``, ``Digits``: bundled data, no files or network;
- ``TokenFile``: a token file (nanoGPT ``train.bin`` layout or ``.npy``), memory-mapped windows;
- ``Arrays``: ``.npz`` / ``.npy`` / ``.safetensors`` files or arrays in memory;
- ``Records``: a map-style data set (``torch.utils.data.Dataset``, Hugging Face ``datasets.Dataset``) with an
  optional ``collate_fn``.

Any object with ``batch_size`` and ``batch(step, seed)`` is a source too (see :mod:`xbridge.data.source`).
"""

from __future__ import annotations

from ..ir.serialize import describe
from .arrays import Arrays
from .bundled import ByteText, Digits
from .records import Records
from .source import BatchCheck, DataError
from .tokens import TokenFile, write_tokens

__all__ = ["Arrays", "BatchCheck", "ByteText", "DataError", "Digits", "Records", "TokenFile", "describe",
           "write_tokens"]
