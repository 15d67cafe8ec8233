"""Parity on parameters with no true gradient (docs/parity.md): in fp32 the elements whose step-0 gradient is ~0
(attention's key bias) are judged against the reference's own noise, measured by running it again from initial
weights one ulp apart; every other element keeps the bound, and a skewed update on such an element still fails."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import ROOT, run_cli
from xbridge.contract import registry
from xbridge.parity import noise, policy
from xbridge.parity.record import NoiseReference, ParityCheck, ParityRecord
from xbridge.program_file import load_program
from xbridge.torch.weights import initial_weights

FIXTURE = ROOT / "tests" / "fixtures" / "no_true_grad.py"
TOL = policy.tolerance("fp32")
FLOOR = policy.PARAM_SCALE_FLOOR


def case(quiet_noise: float = 1e-4):
    """A reference, its run from one ulp apart (``quiet_noise`` x the floor on the key bias, rounding elsewhere)
    and the measured QuietNoise; the numbers are the fixture's (tests/fixtures/no_true_grad.py, 8 steps)."""
    rng = np.random.default_rng(0)
    ref = {"attn.k.weight": rng.normal(0, 0.1, (32, 32)), "attn.k.bias": rng.normal(0, 1e-4, 32),
           "attn.qkv.bias": rng.normal(0, 0.02, 96)}
    sign = rng.choice([-1.0, 1.0], 32)
    other = {"attn.k.weight": ref["attn.k.weight"] * (1 + 1e-7), "attn.k.bias": ref["attn.k.bias"] +
             sign * quiet_noise * FLOOR, "attn.qkv.bias": ref["attn.qkv.bias"].copy()}
    other["attn.qkv.bias"][32:64] += sign * quiet_noise * FLOOR * np.sqrt(3)     # the key third: same measure
    quiet = {"attn.k.bias": np.ones(32, bool), "attn.qkv.bias": np.arange(96) // 32 == 1}
    kinds = {name: noise.kind(name, mask) for name, mask in quiet.items()}
    return ref, policy.QuietNoise(other, quiet, kinds), sign


def shifted(ref, name, rel, sign, where=slice(None)):
    out = {k: v.copy() for k, v in ref.items()}
    out[name][where] += sign * rel * FLOOR
    return out


def test_a_key_bias_within_the_references_own_noise_passes_and_the_row_says_why():
    """Measured on the fixture: the targets 2.2e-4 to 3.3e-4 from eager on attn.k.bias (FAIL against 1e-4), eager
    from one ulp apart 3.3e-4 from eager: the limit becomes 4 x that."""
    ref, quiet, sign = case(3.3e-4)
    target = shifted(ref, "attn.k.bias", 6.6e-4, -sign)      # twice the reference's own noise, on the other side
    assert not policy.param_deviation(ref, target, TOL).ok
    dev = policy.param_deviation(ref, target, TOL, noise=quiet)
    assert dev.ok and dev.where == "attn.k.bias"
    assert dev.limit == pytest.approx(policy.NOISE_FACTOR * 3.3e-4) and dev.value == pytest.approx(6.6e-4)
    assert dev.note == "true gradient ~0: key bias; within 4x the reference's own noise (3.3e-04)"


def test_a_skewed_key_bias_update_still_fails():
    """A real bug on a tensor with no true gradient: the update skewed by 10x the reference's own noise."""
    ref, quiet, sign = case(1e-4)
    dev = policy.param_deviation(ref, shifted(ref, "attn.k.bias", 10 * 1e-4, sign), TOL, noise=quiet)
    assert not dev.ok and dev.where == "attn.k.bias" and dev.value == pytest.approx(1e-3)
    assert "beyond 4x the reference's own noise" in dev.note
    nan = shifted(ref, "attn.k.bias", 0.0, sign)
    nan["attn.k.bias"][3] = np.nan
    assert not policy.param_deviation(ref, nan, TOL, noise=quiet).ok


def test_only_the_elements_without_a_true_gradient_are_lent_the_noise():
    """In a fused q/k/v bias the key third is judged against the noise, the query and value thirds against the
    bound; every other tensor keeps the bound too."""
    ref, quiet, sign = case(3e-4)
    assert quiet.kinds["attn.qkv.bias"] == "key bias (the middle third of the fused q/k/v bias)"
    key = shifted(ref, "attn.qkv.bias", 5e-4 * np.sqrt(3), sign, slice(32, 64))
    dev = policy.param_deviation(ref, key, TOL, noise=quiet)
    assert dev.ok and dev.where == "attn.qkv.bias" and "key bias (the middle third" in dev.note
    assert dev.value == pytest.approx(5e-4 * 0.02 / np.sqrt(np.mean(ref["attn.qkv.bias"] ** 2)), rel=1e-6)
    value = shifted(ref, "attn.qkv.bias", 3 * TOL.param_rtol * np.sqrt(3), sign, slice(64, 96))
    dev = policy.param_deviation(ref, value, TOL, noise=quiet)
    assert not dev.ok and dev.where == "attn.qkv.bias" and dev.limit == TOL.param_rtol and dev.note == ""
    weight = {**ref, "attn.k.weight": ref["attn.k.weight"] * (1 + 3 * TOL.param_rtol)}
    dev = policy.param_deviation(ref, weight, TOL, noise=quiet)
    assert not dev.ok and dev.where == "attn.k.weight" and dev.limit == TOL.param_rtol


def test_a_reference_that_pins_the_elements_down_lends_nothing():
    ref, quiet, sign = case(1e-6)          # 4 x 1e-6 < the bound: the tensor is judged whole, as before
    target = shifted(ref, "attn.k.bias", 2 * TOL.param_rtol, sign)
    dev = policy.param_deviation(ref, target, TOL, noise=quiet)
    assert not dev.ok and dev.limit == TOL.param_rtol and dev.note == ""
    assert policy.param_deviation(ref, ref, TOL, noise=quiet) == policy.Deviation(0.0, "attn.k.weight",
                                                                                  TOL.param_rtol)


def test_ulp_weights_move_every_nonzero_float_by_one_ulp():
    weights = {"w": np.array([1.0, -2.5, 0.0, 3e-8], np.float32), "n": np.array([3], np.int64)}
    moved = noise.ulp_weights(weights)
    assert moved["w"][2] == 0.0 and moved["n"].tolist() == [3] and moved["w"].dtype == np.float32
    gap = (moved["w"].view(np.int32) - weights["w"].view(np.int32))[[0, 1, 3]]
    assert gap.tolist() == [1, -1, 1]            # one representable step towards +inf


def test_the_fixtures_key_bias_is_found_from_its_step_0_gradient():
    program = load_program(str(FIXTURE))
    quiet = noise.quiet_elements(program, initial_weights(program))
    assert quiet["attn.k.bias"].all() and noise.kind("attn.k.bias", quiet["attn.k.bias"]) == "key bias"
    assert all(mask.mean() < 0.01 for name, mask in quiet.items() if name != "attn.k.bias")
    assert noise.kind("blocks.0.mlp.bias", np.ones(8, bool)) == ""


def test_the_note_and_the_noise_run_survive_parity_json():
    check = ParityCheck(1e-7, "step 1", 1e-5, None, 3e-4, "attn.k.bias", 1.3e-3, [1.0, 0.9], 0,
                        param_note="true gradient ~0: key bias; within 4x the reference's own noise (3.3e-04)")
    assert ParityCheck.from_json(check.to_json()) == check
    assert "max_param_dev_note" not in ParityCheck(1e-7, "step 1", 1e-5, None, 1e-7, "w", 1e-4, [1.0], 0).to_json()
    ran = NoiseReference("the reference again from initial weights one ulp apart", "ok", {"attn.k.bias": "key bias"})
    assert NoiseReference(**json.loads(json.dumps(ran.__dict__))) == ran


@pytest.mark.slow
@pytest.mark.cli
def test_the_fixture_passes_parity_in_fp32_where_the_key_bias_failed(tmp_path):
    """End to end on jax-cpu (inductor-cpu and xla-cpu behave alike: measured by hand, docs/parity.md; one target
    keeps the suite's time): it fails on attn.k.bias against the bound and passes against the reference's own
    noise, the row naming why."""
    targets = [r["target"] for r in registry.describe() if r["available"] and r["target"] == "jax-cpu"]
    if not targets:
        pytest.skip("jax-cpu is not available here")
    proc = run_cli("parity", str(FIXTURE), "--format", "json", "--out", str(tmp_path), "--steps", "8",
                   "--backends", ",".join(targets))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = ParityRecord.from_json(json.loads(proc.stdout))
    assert record.reference_noise is not None and record.reference_noise.quiet["attn.k.bias"] == "key bias"
    for row in record.targets:
        assert row.check is not None and row.check.max_param_dev_at == "attn.k.bias"
        assert row.check.max_param_dev > TOL.param_rtol and row.check.param_note is not None
        assert row.check.param_note.startswith("true gradient ~0: key bias; within 4x")


@pytest.mark.slow
def test_a_chaotic_program_is_within_the_references_own_noise_and_a_wrong_stack_beyond_it(tmp_path):
    """The noise floor (docs/parity.md): tests/fixtures/chaotic.py amplifies fp32 rounding, so Inductor parts from
    eager beyond the fp32 bounds (until 2026-12-07: FAIL) and so does eager from itself one ulp apart: the verdict is
    pass, within the reference's own noise. A stack that parts at step 0 (its own dropout masks under --rng
    native, tests/fixtures/dropout.py) is beyond any floor: FAIL, without the noise run. (Beyond a measured floor:
    tests/test_third_party_backend.py's skewed export.)"""
    chaotic = tmp_path / "chaotic"
    proc = run_cli("parity", str(ROOT / "tests" / "fixtures" / "chaotic.py"), "--backends", "inductor-cpu",
                   "--steps", "20", "--out", str(chaotic))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "within 4x the reference's own noise" in proc.stdout
    row = json.loads((chaotic / "parity.json").read_text())["targets"][0]
    floor = row["noise_floor"]
    assert row["verdict"] == "pass" and floor["within"] is True
    assert row["max_loss_dev"] > TOL.loss_rtol and floor["loss"] > TOL.loss_rtol    # beyond the bound, both
    assert row["max_loss_dev"] <= policy.NOISE_FACTOR * floor["loss"]

    wrong = tmp_path / "wrong"
    proc = run_cli("parity", str(ROOT / "tests" / "fixtures" / "dropout.py"), "--backends", "inductor-cpu",
                   "--rng", "native", "--steps", "4", "--out", str(wrong))
    assert proc.returncode == 1, proc.stderr[-3000:]
    row = json.loads((wrong / "parity.json").read_text())["targets"][0]
    # beyond the bound at step 0, where the reference's own noise is one forward's rounding: no noise run is made
    assert row["verdict"] == "FAIL" and row["first_failing_step"] == 0 and "noise_floor" not in row
    assert not (wrong / "runs" / "reference-noise").exists()
