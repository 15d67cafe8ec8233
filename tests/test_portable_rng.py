"""--rng portable: the generator (Threefry-2x32, bit for bit JAX's), its statistics, sharded draws, every backend
drawing the same numbers at 1 and 4 devices, a resume continuing the stream, and parity naming the random draws
under --rng native."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, one_error_line, run_cli
from xbridge.torch.portable_rng import PortableRandom, threefry2x32

STOCHASTIC = str(ROOT / "tests" / "fixtures" / "stochastic.py")


def _rows(rows: np.ndarray, step: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([rows, np.full_like(rows, step)], 1).astype(np.int32))


def test_threefry_is_jaxs_threefry_bit_for_bit():
    jax = pytest.importorskip("jax")
    from jax._src import prng

    rng = np.random.default_rng(0)
    for _ in range(3):
        key = rng.integers(0, 2 ** 32, size=2, dtype=np.uint64)
        c0, c1 = rng.integers(0, 2 ** 32, size=(2, 1000), dtype=np.uint64).astype(np.uint32)
        expected = np.asarray(prng.threefry_2x32(jax.numpy.asarray(key.astype(np.uint32)),
                                                 jax.numpy.asarray(np.concatenate([c0, c1]))))
        got = threefry2x32((int(key[0]), int(key[1])), torch.from_numpy(c0.view(np.int32)),
                           torch.from_numpy(c1.view(np.int32)))
        assert np.array_equal(got[0].numpy().view(np.uint32), expected[:1000])
        assert np.array_equal(got[1].numpy().view(np.uint32), expected[1000:])


def test_the_draws_have_the_statistics_they_claim():
    mode = PortableRandom(7, _rows(np.arange(1024), 3))
    u = mode.uniform((1024, 1024), torch.device("cpu")).numpy().ravel()
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 2e-3 and abs(u.var() - 1 / 12) < 1e-3
    counts = np.bincount((u * 256).astype(int), minlength=256)
    chi2 = ((counts - len(u) / 256) ** 2 / (len(u) / 256)).sum()
    assert 180 < chi2 < 340, chi2                  # 255 degrees of freedom: p ~ 1e-3 on either side
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5e-3        # neighbouring counters are independent
    z = mode.normal((1024, 1024), torch.device("cpu")).numpy().ravel()
    assert abs(z.mean()) < 5e-3 and abs(z.std() - 1) < 5e-3 and abs((np.abs(z) < 1).mean() - 0.6827) < 3e-3
    x = torch.ones(1024, 1024)
    kept = (mode.dropout(x, 0.1, True) != 0).float().mean().item()
    assert abs(kept - 0.9) < 2e-3
    assert mode.dropout(x, 0.1, False) is x


def test_draws_are_keyed_by_seed_site_row_and_step():
    def draw(seed, rows, step, sites=1):
        mode = PortableRandom(seed, _rows(rows, step))
        return [mode.uniform((len(rows), 16), torch.device("cpu")) for _ in range(sites)]

    whole = draw(1, np.arange(8), 5)[0]
    assert torch.equal(whole, draw(1, np.arange(8), 5)[0])                    # deterministic
    assert torch.equal(draw(1, np.arange(4, 8), 5)[0], whole[4:])            # a shard draws its rows' numbers
    assert torch.equal(draw(1, np.array([6, 1]), 5)[0], whole[[6, 1]])       # any rows, any order
    first, second = draw(1, np.arange(8), 5, sites=2)
    for other in (second, draw(2, np.arange(8), 5)[0], draw(1, np.arange(8), 6)[0]):   # site, seed, step
        assert (other != whole).float().mean() > 0.99


def test_dropout_and_friends_route_to_the_generator():
    x = torch.randn(4, 3, 5, 5)
    with PortableRandom(0, _rows(np.arange(4), 0)) as mode:
        channel = F.dropout2d(x, 0.5, True)
        assert mode.site == 1
        zeroed = (channel == 0).all(dim=(2, 3))                  # whole channels are dropped
        assert ((channel != 0).all(dim=(2, 3)) | zeroed).all()
        attention = F.scaled_dot_product_attention(x, x, x, dropout_p=0.3)
        assert attention.shape == x.shape and mode.site == 2
        assert torch.rand(2, 3).shape == (2, 3) and torch.randint(3, 7, (100,)).min() >= 3 and mode.site == 4
        with pytest.raises(Exception, match="Tensor.normal_ has no portable form"):
            torch.empty(3).normal_()


@pytest.mark.slow
@pytest.mark.cli
# Suite time: 2 devices (4 passed in the full run of 2026-12-02, 127 s, and left the suite then)
@pytest.mark.parametrize("devices,backends", [("2", "inductor-cpu,jax-cpu:sharding-mode=shard_map,xla-cpu")])
def test_every_backend_draws_the_same_numbers(tmp_path, devices, backends):
    """Dropout, dropout2d, attention dropout, randn_like and rand in one forward, micro-batches of 16 rows; each
    device (inductor rank, shard_map shard, SPMD shard) draws only its rows' numbers. (1 device on every backend:
    the zoo's BERT and T5 with dropout; this program at 1 device passed on all three by hand, 2026-11-30.)"""
    proc = run_cli("parity", STOCHASTIC, "--backends", backends, "--devices", devices, "--steps", "3",
                   "--rng", "portable", "--jobs", "2", "--format", "json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    assert record["rng"] == "portable" and record["random_draws"] == []
    assert all(r["verdict"] == "pass" and r["devices"] == int(devices) for r in record["targets"])


@pytest.mark.slow
@pytest.mark.cli
def test_native_randomness_fails_parity_and_says_why(tmp_path):
    proc = run_cli("parity", STOCHASTIC, "--backends", "jax-cpu", "--steps", "2", "--format", "json",
                   "--out", str(tmp_path))
    assert proc.returncode == 1
    record = json.loads(proc.stdout)
    assert record["rng"] == "native"
    assert [d["op"] for d in record["random_draws"]] == [
        "dropout2d", "dropout", "randn_like", "rand", "scaled_dot_product_attention(dropout_p)"]
    assert record["random_draws"][1]["module"] == "drop"
    (row,) = record["targets"]
    assert row["verdict"] == "FAIL"
    assert "each stack draws its own random numbers (--rng native)" in row["cause"]
    assert "the first '(model)'; rerun with --rng portable, or disable dropout for the check" in row["cause"]
    assert "note: stochastic: each stack draws its own random numbers" in proc.stderr   # said before it ran


@pytest.mark.slow
@pytest.mark.cli
def test_a_resumed_run_continues_the_same_stream(tmp_path):
    whole = run_cli("run", STOCHASTIC, "--backend", "eager-cpu", "--rng", "portable", "--steps", "4", "--format",
                    "json")
    assert whole.returncode == 0, whole.stderr[-2000:]
    ck = str(tmp_path / "ck")
    first = run_cli("run", STOCHASTIC, "--backend", "eager-cpu", "--rng", "portable", "--steps", "2",
                    "--checkpoint-every", "2", "--checkpoint-dir", ck, "--format", "json")
    assert first.returncode == 0, first.stderr[-2000:]
    rest = run_cli("run", STOCHASTIC, "--backend", "eager-cpu", "--rng", "portable", "--steps", "4", "--resume", ck,
                   "--format", "json")
    assert rest.returncode == 0, rest.stderr[-2000:]
    record = json.loads(whole.stdout)
    assert record["rng"] == "portable"
    losses = [s["loss"] for s in record["steps"]]
    assert [s["loss"] for s in json.loads(first.stdout)["steps"]] == losses[:2]
    assert [s["loss"] for s in json.loads(rest.stdout)["steps"]] == losses[2:]


@pytest.mark.cli
def test_a_bad_rng_is_one_line(tmp_path):
    proc = run_cli("run", STOCHASTIC, "--backend", "eager-cpu", "--rng", "philox", "--steps", "2")
    assert proc.returncode == 2
    assert one_error_line(proc) == "error: --rng must be one of native, portable, got 'philox'"
