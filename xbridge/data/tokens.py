"""Token files: a flat binary of token ids (nanoGPT's ``train.bin``: uint16 or uint32, no header) or a 1-D ``.npy``,
memory-mapped; each example is a random window of ``seq_len + 1`` tokens (inputs and the shifted targets)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..ir.serialize import register
from ..ir.source_checks import positive_int
from . import fingerprint
from .bundled import _rng
from .files import existing_file
from .source import DataError

TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")


@functools.lru_cache(maxsize=8)
def _open(path: str, dtype: str, stamp: str) -> np.ndarray:
    """The tokens as a read-only memory map (``stamp``, the fingerprint, keys the cache: a changed file reopens)."""
    if path.endswith(".npy"):
        return np.load(path, mmap_mode="r")
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


@register
@dataclass(frozen=True)
class TokenFile:
    """``xb.data.TokenFile("train.bin", seq_len=256, batch_size=16, dtype="uint16", vocab_size=50304,
    val_path="val.bin")``. ``batch(step, seed)`` gives ``{"tokens": int64[batch_size, seq_len + 1]}``: the loss
    predicts ``tokens[:, 1:]`` from ``tokens[:, :-1]``. ``fingerprint`` and ``tokens`` are filled in from the file
    (a given fingerprint that no longer matches is refused: the file changed)."""

    path: str
    seq_len: int
    batch_size: int
    dtype: str = "uint16"
    vocab_size: int | None = None
    val_path: str | None = None
    fingerprint: str = ""
    tokens: int = 0

    def __post_init__(self) -> None:
        owner = f"TokenFile {self.path!r}"
        for name in ("seq_len", "batch_size"):
            positive_int(getattr(self, name), f"{owner}: {name}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                            or self.vocab_size < 1):
            raise ConfigError(f"{owner}: vocab_size must be a positive int or None, got {self.vocab_size!r}")
        file = existing_file(self.path, "TokenFile")
        npy = file.suffix == ".npy"
        if not npy:
            if self.dtype not in TOKEN_DTYPES:
                raise ConfigError(f"{owner}: dtype {self.dtype!r} is not a token dtype ({', '.join(TOKEN_DTYPES)})")
            if file.stat().st_size % np.dtype(self.dtype).itemsize:
                raise ConfigError(f"{owner}: {file.stat().st_size} bytes is not a whole number of {self.dtype} "
                                  "tokens (is dtype right?)")
        found = fingerprint.of_file(file)
        if self.fingerprint and self.fingerprint != found:
            raise DataError(f"{owner}: the file changed (fingerprint {found}, the config says {self.fingerprint})")
        object.__setattr__(self, "fingerprint", found)
        tokens = self._open()
        if npy:
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise ConfigError(f"{owner}: a .npy token file holds one 1-D integer array, this one is "
                                  f"{tokens.dtype}{list(tokens.shape)}")
            object.__setattr__(self, "dtype", str(tokens.dtype))
        object.__setattr__(self, "tokens", int(tokens.shape[0]))
        if self.tokens < self.seq_len + 1:
            raise ConfigError(f"{owner}: {self.tokens} tokens cannot fill one window of seq_len + 1 = "
                              f"{self.seq_len + 1}")
        if self.vocab_size is not None and file.stat().st_size <= fingerprint.FULL_HASH_BYTES:
            top = int(tokens.max())     # cheap for a small file; a large one is checked batch by batch
            if top >= self.vocab_size:
                raise DataError(f"{owner}: token id {top} is outside the vocabulary (vocab_size {self.vocab_size})")

    def _open(self) -> np.ndarray:
        return _open(str(Path(self.path).expanduser().resolve()), self.dtype, self.fingerprint)

    def validation(self, batch_size: int | None = None) -> TokenFile:
        """The validation split (``val_path``) with the same windows, e.g. for ``xb.Eval(data=...)``."""
        if self.val_path is None:
            raise ConfigError(f"TokenFile {self.path!r} has no val_path (the validation split file)")
        return TokenFile(self.val_path, self.seq_len, batch_size or self.batch_size, self.dtype, self.vocab_size)

    def rows(self, step: int, seed: int, index: np.ndarray) -> dict[str, np.ndarray]:
        tokens = self._open()
        starts = _rng(seed, step, 2).integers(0, self.tokens - self.seq_len, size=self.batch_size)[index]
        out = np.stack([tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)
        if self.vocab_size is not None and out.size and int(np.max(out)) >= self.vocab_size:
            raise DataError(f"data TokenFile {self.path!r}, step {step}: key 'tokens' holds id {int(np.max(out))}, "
                            f"outside the vocabulary (vocab_size {self.vocab_size})")
        return {"tokens": out}

    def batch(self, step: int, seed: int) -> dict[str, np.ndarray]:
        return self.rows(step, seed, np.arange(self.batch_size))

    @property
    def tokens_per_example(self) -> int:
        return self.seq_len


def write_tokens(path: str | Path, tokens: np.ndarray, dtype: str = "uint16") -> Path:
    """Write token ids as a flat binary (the nanoGPT layout TokenFile reads)."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.dtype(dtype)).max):
        raise ConfigError(f"token ids {array.min()}..{array.max()} do not fit {dtype}")
    out = Path(path)
    array.astype(dtype).tofile(out)
    return out


__all__ = ["TOKEN_DTYPES", "TokenFile", "write_tokens"]
