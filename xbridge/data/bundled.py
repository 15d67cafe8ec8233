"""Data specs: real data with no network, deterministic per (seed, step).

A spec is a frozen dataclass (so it serialises with the program); ``batch(step, seed)`` returns the global batch of
that step as a dict of numpy arrays, the same on every backend and every process. Nothing is stateful: resuming at
step k gives exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..ir.serialize import register
from ..ir.source_checks import positive_int


def _rng(seed: int, step: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([stream, seed, step])


def _check_batch(owner: str, batch_size: object) -> None:
    positive_int(batch_size, f"{owner} batch_size")


# Which standard library the text comes from: Python 3.11's and 3.12's differ, so a command whose targets run in
# other environments (xbridge/environments.py) names its own for them (parity's and compare's targets:
# xbridge/run/isolated.py; run, compile and check passed to another interpreter: environments.forward): each reads
# the same bytes, whatever Python it runs on.
STDLIB_ROOT = "XBRIDGE_STDLIB_ROOT"


def stdlib_root() -> str:
    """The standard library folder ``ByteText.python_stdlib`` reads: ``$XBRIDGE_STDLIB_ROOT``, else this Python's."""
    return os.environ.get(STDLIB_ROOT) or sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """The bytes of the Python standard library's own ``.py`` files (sorted paths, concatenated), as uint8."""
    root = Path(stdlib_root())
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    if not files:
        raise ConfigError(f"no Python source files found under the standard library at {root}")
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


@register
@dataclass(frozen=True)
class ByteText:
    """Byte-level language modelling on a text corpus: each example is ``seq_len`` consecutive bytes from a random
    offset. ``batch(step, seed)`` gives ``{"tokens": int64[batch_size, seq_len]}`` with values in [0, 256)."""

    seq_len: int
    batch_size: int
    source: str = "python_stdlib"
    max_bytes: int = 8_000_000

    def __post_init__(self) -> None:
        _check_batch("ByteText", self.batch_size)
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ConfigError(f"ByteText seq_len must be an int >= 2, got {self.seq_len!r}")
        if self.source != "python_stdlib":
            raise ConfigError(f"ByteText source {self.source!r} is unknown; the available source is 'python_stdlib'")

    @classmethod
    def python_stdlib(cls, seq_len: int, batch_size: int, max_bytes: int = 8_000_000) -> ByteText:
        return cls(seq_len=seq_len, batch_size=batch_size, source="python_stdlib", max_bytes=max_bytes)

    def corpus(self) -> np.ndarray:
        return stdlib_corpus(self.max_bytes)

    def batch(self, step: int, seed: int) -> dict[str, np.ndarray]:
        corpus = self.corpus()
        starts = _rng(seed, step, 0).integers(0, len(corpus) - self.seq_len, size=self.batch_size)
        index = starts[:, None] + np.arange(self.seq_len)[None, :]
        return {"tokens": corpus[index].astype(np.int64)}

    @property
    def tokens_per_example(self) -> int:
        return self.seq_len


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of ``sklearn.datasets.load_digits()``, read from the file it reads
    (``sklearn/datasets/data/digits.csv.gz``: 64 pixel columns and the label, comma-separated) without importing
    scikit-learn, whose import (SciPy with it) cost 2.2 s of a 12 s two-step jax run, in every process of a
    parity or a compare. Where the file is not there (another layout), ``load_digits`` itself."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ConfigError("xb.data.Digits needs scikit-learn (pip install 'xbridge[eager]')")
    found = [Path(p) / "datasets" / "data" / "digits.csv.gz" for p in spec.submodule_search_locations or ()]
    if found and found[0].is_file():
        import gzip

        with gzip.open(found[0], "rt") as handle:
            data = np.loadtxt(handle, delimiter=",")
        pixels, labels = data[:, :-1], data[:, -1]
    else:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        pixels, labels = bunch.data, bunch.target
    return (pixels / 16.0).astype(np.float32), labels.astype(np.int64)


@register
@dataclass(frozen=True)
class Digits:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, no download). Epochs are shuffled per
    (seed, epoch); ``batch(step, seed)`` gives ``{"x": float32[batch_size, 64] in [0, 1], "y": int64[batch_size]}``."""

    batch_size: int

    def __post_init__(self) -> None:
        _check_batch("Digits", self.batch_size)

    def batch(self, step: int, seed: int) -> dict[str, np.ndarray]:
        x, y = _digits()
        n = len(y)
        positions = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        index = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(positions // n):
            mask = positions // n == epoch
            perm = _rng(seed, int(epoch), 1).permutation(n)
            index[mask] = perm[positions[mask] % n]
        return {"x": x[index], "y": y[index]}

    @property
    def tokens_per_example(self) -> int:
        return 1


DataSpec = ByteText | Digits
