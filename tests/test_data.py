"""Data specs: real data, deterministic per (seed, step), stateless."""

from __future__ import annotations

import numpy as np

import xbridge as xb


def test_byte_text_is_python_source_and_deterministic():
    spec = xb.data.ByteText.python_stdlib(seq_len=65, batch_size=4)
    corpus = spec.corpus()
    assert corpus.dtype == np.uint8 and len(corpus) > 1_000_000
    assert b"def " in corpus[:200_000].tobytes() and b"import " in corpus[:200_000].tobytes()
    a, b = spec.batch(3, seed=0), spec.batch(3, seed=0)
    assert a["tokens"].shape == (4, 65) and a["tokens"].dtype == np.int64
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert not np.array_equal(a["tokens"], spec.batch(4, seed=0)["tokens"])
    assert not np.array_equal(a["tokens"], spec.batch(3, seed=1)["tokens"])
    assert a["tokens"].min() >= 0 and a["tokens"].max() < 256
    # each row is a contiguous window of the corpus
    row = a["tokens"][0].astype(np.uint8).tobytes()
    assert row in corpus.tobytes()


def _rows(x):
    return sorted(row.tobytes() for row in x)


def test_digits_are_scikit_learns_load_digits():
    """Read from scikit-learn's own data file without importing it: the same images and labels as load_digits."""
    from sklearn.datasets import load_digits

    from xbridge.data.bundled import _digits

    x, y = _digits()
    bunch = load_digits()
    np.testing.assert_array_equal(x, (bunch.data / 16.0).astype(np.float32))
    np.testing.assert_array_equal(y, bunch.target)
    assert x.shape == (1797, 64) and y.dtype == np.int64


def test_digits_epochs_are_permutations():
    from xbridge.data.bundled import _digits

    all_x, all_y = _digits()
    spec = xb.data.Digits(batch_size=599)            # 3 steps = 1797 = one epoch exactly
    batches = [spec.batch(step, seed=5) for step in range(3)]
    x = np.concatenate([b["x"] for b in batches])
    y = np.concatenate([b["y"] for b in batches])
    assert x.shape == (1797, 64) and x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0
    assert _rows(x) == _rows(all_x)                 # every example exactly once per epoch
    assert np.array_equal(np.sort(y), np.sort(all_y))
    np.testing.assert_array_equal(spec.batch(1, seed=5)["y"], batches[1]["y"])
    assert not np.array_equal(spec.batch(0, seed=6)["y"], batches[0]["y"])
    assert not np.array_equal(spec.batch(3, seed=5)["y"], batches[0]["y"])   # the next epoch is reshuffled


def test_digits_batch_crossing_an_epoch_boundary():
    from xbridge.data.bundled import _digits

    spec = xb.data.Digits(batch_size=1000)
    b0, b1 = spec.batch(0, seed=0), spec.batch(1, seed=0)   # positions 1000..1999 span epochs 0 and 1
    assert b1["x"].shape == (1000, 64)
    first_epoch = np.concatenate([b0["x"], b1["x"][:797]])
    assert _rows(first_epoch) == _rows(_digits()[0])
