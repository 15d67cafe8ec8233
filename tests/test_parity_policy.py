"""The parity checks themselves, fed failing cases: each must fail, naming the step or the parameter, and the
tolerance numbers the code uses are the ones docs/parity.md publishes."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import ROOT
from xbridge.parity import policy
from xbridge.parity.divergence import first_divergence


def test_docs_table_is_the_policy():
    text = (ROOT / "docs" / "parity.md").read_text()
    table = text[text.index("## Bounds"):].split("\n\n")[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = (float(cells[1]), float(cells[2]))
    assert rows == {name: (tol.loss_rtol, tol.param_rtol) for name, tol in policy.POLICY.items()}


@pytest.mark.parametrize("precision", list(policy.POLICY))
def test_loss_deviation_fails_past_the_bound_and_names_the_step(precision):
    tol = policy.tolerance(precision)
    ref = [2.5, 2.4, 2.3, 2.2]
    inside = [v * (1 + 0.5 * tol.loss_rtol) for v in ref]
    assert policy.loss_deviation(ref, inside, tol).ok
    outside = list(ref)
    outside[2] = ref[2] * (1 + 2 * tol.loss_rtol)
    dev = policy.loss_deviation(ref, outside, tol)
    assert not dev.ok and dev.where == "step 2" and dev.value == pytest.approx(2 * tol.loss_rtol)
    assert not policy.loss_deviation(ref, [*ref[:3], float("nan")], tol).ok        # a NaN loss never passes
    assert not policy.loss_deviation(ref, ref[:3], tol).ok                          # nor a run that stopped early


@pytest.mark.parametrize("precision", list(policy.POLICY))
def test_param_deviation_fails_on_one_deviating_tensor_and_names_it(precision):
    tol = policy.tolerance(precision)
    rng = np.random.default_rng(0)
    ref = {"a.weight": rng.normal(0, 0.1, (16, 8)).astype(np.float32),
           "b.bias": rng.normal(0, 0.1, 8).astype(np.float32), "steps": np.asarray(3)}
    same = {k: v.copy() for k, v in ref.items()}
    assert policy.param_deviation(ref, same, tol).ok and policy.param_deviation(ref, same, tol).value == 0.0
    bad = {k: v.copy() for k, v in ref.items()}
    bad["b.bias"] = bad["b.bias"] + 3 * tol.param_rtol * np.sqrt(np.mean(ref["b.bias"] ** 2))
    dev = policy.param_deviation(ref, bad, tol)
    assert not dev.ok and dev.where == "b.bias" and dev.value == pytest.approx(3 * tol.param_rtol, rel=1e-3)
    small = {k: v.copy() for k, v in ref.items()}
    small["a.weight"] = small["a.weight"] * (1 + 0.5 * tol.param_rtol)
    assert policy.param_deviation(ref, small, tol).ok
    nan = {k: v.copy() for k, v in ref.items()}
    nan["a.weight"][0, 0] = np.nan
    assert not policy.param_deviation(ref, nan, tol).ok
    assert not policy.param_deviation(ref, {k: v for k, v in ref.items() if k != "b.bias"}, tol).ok
    assert not policy.param_deviation(ref, {**ref, "b.bias": ref["b.bias"][:4]}, tol).ok


def test_a_tensor_the_reference_itself_cannot_pin_down_gets_the_measured_noise_as_its_limit():
    """bf16: a key bias (zero true gradient) differs between the reference in bf16 and in fp32 by 10% of the floor;
    a target may differ from the bf16 reference by up to NOISE_FACTOR times that there, and only there."""
    tol = policy.tolerance("bf16-mixed")
    rng = np.random.default_rng(1)
    ref = {"w": rng.normal(0, 0.1, (16, 8)), "key.bias": rng.normal(0, 1e-3, 8)}
    shifted = lambda v, rel: v + rel * policy.PARAM_SCALE_FLOOR   # noqa: E731 (an RMS deviation of rel x the floor)
    ref32 = {"w": ref["w"], "key.bias": shifted(ref["key.bias"], 0.1)}
    near = {"w": ref["w"], "key.bias": shifted(ref["key.bias"], 0.25)}
    assert not policy.param_deviation(ref, near, tol).ok                  # without the fp32 reference: 0.25 > 0.03
    dev = policy.param_deviation(ref, near, tol, ref32)
    assert dev.ok and dev.where == "key.bias" and dev.limit == pytest.approx(0.1 * policy.NOISE_FACTOR)
    far = {"w": ref["w"], "key.bias": shifted(ref["key.bias"], 0.1 * policy.NOISE_FACTOR + 0.05)}
    assert not policy.param_deviation(ref, far, tol, ref32).ok
    drifted = {"w": ref["w"] * (1 + 3 * tol.param_rtol), "key.bias": ref["key.bias"]}   # the noise is not lent out
    dev = policy.param_deviation(ref, drifted, tol, ref32)
    assert not dev.ok and dev.where == "w" and dev.limit == tol.param_rtol


def test_the_loss_limit_widens_to_the_references_own_noise():
    """A small-batch BatchNorm ResNet in bf16 (the zoo's): the bf16 reference is 5.9% from its fp32 run at step 3,
    so targets may be NOISE_FACTOR x that from it; without the fp32 run the bound stays 1.6e-2."""
    tol = policy.tolerance("bf16-mixed")
    ref, ref32 = [2.68, 2.27, 2.13, 1.93], [2.68, 2.29, 2.14, 2.05]
    target = [2.68, 2.28, 2.17, 2.06]
    assert not policy.loss_deviation(ref, target, tol).ok
    dev = policy.loss_deviation(ref, target, tol, ref32)
    assert dev.ok and dev.limit == pytest.approx(policy.NOISE_FACTOR * 0.12 / 2.05) and dev.where == "step 3"
    assert not policy.loss_deviation(ref, [2.68, 2.28, 2.17, 2.60], tol, ref32).ok
    assert policy.loss_deviation(ref, ref, tol, ref).limit == tol.loss_rtol      # a quiet reference lends nothing


def test_custom_precisions_take_their_lowest_dtype_bound():
    assert policy.tolerance("params=float32,compute=bfloat16,output=float32") == policy.POLICY["bf16-mixed"]
    assert policy.tolerance("params=bfloat16,compute=bfloat16,output=float32") == policy.POLICY["bf16-true"]
    assert policy.tolerance("params=float32,compute=float16,output=float32") == policy.POLICY["fp16-mixed"]


def test_first_divergence_names_the_first_deviating_module_in_reference_order():
    ref = {"fc1": np.ones(4), "drop": np.ones(4), "fc2": np.ones(4)}
    assert first_divergence(ref, {k: v.copy() for k, v in ref.items()}, 1e-5) is None
    got = {"fc1": np.ones(4), "drop": np.ones(4) * 1.1, "fc2": np.ones(4) * 2}
    name, value = first_divergence(ref, got, 1e-5)
    assert name == "drop" and value == pytest.approx(0.1)
    assert first_divergence(ref, {"fc1": np.ones(4)}, 1e-5) == ("drop", float("inf"))


def test_in_fp32_a_key_bias_is_judged_against_the_references_own_noise_and_a_skewed_one_still_fails():
    """fp32 (docs/parity.md, "Parameters with no true gradient"): the reference from one ulp apart is 2.8e-4 (of
    the floor) from itself on a key bias; a target 3.3e-4 away passes, one skewed by 10x that noise fails."""
    tol = policy.tolerance("fp32")
    rng = np.random.default_rng(2)
    ref = {"w": rng.normal(0, 0.1, (16, 8)), "k.bias": rng.normal(0, 1e-4, 8)}
    sign = rng.choice([-1.0, 1.0], 8)
    noise = policy.QuietNoise({"w": ref["w"], "k.bias": ref["k.bias"] + sign * 2.8e-4 * policy.PARAM_SCALE_FLOOR},
                              {"k.bias": np.ones(8, bool)}, {"k.bias": "key bias"})
    moved = lambda rel: {"w": ref["w"], "k.bias": ref["k.bias"] - sign * rel * policy.PARAM_SCALE_FLOOR}  # noqa: E731
    assert not policy.param_deviation(ref, moved(3.3e-4), tol).ok
    dev = policy.param_deviation(ref, moved(3.3e-4), tol, noise=noise)
    assert dev.ok and dev.limit == pytest.approx(policy.NOISE_FACTOR * 2.8e-4) and "key bias; within" in dev.note
    dev = policy.param_deviation(ref, moved(10 * 2.8e-4), tol, noise=noise)
    assert not dev.ok and dev.where == "k.bias" and "beyond" in dev.note


def test_the_noise_floor_is_held_step_by_step():
    """A target that parts where the reference has not amplified anything yet is not lent later steps' noise."""
    tol = policy.tolerance("fp32")
    ref = [2.0] * 6
    own = [2.0, 2.0, 2.0, 2.0, 2.0 * (1 + 5e-5), 2.0]       # the reference parts from itself at step 4
    late = [2.0, 2.0, 2.0, 2.0, 2.0 * (1 + 1e-4), 2.0]      # 1e-4 at step 4: within 4x 5e-5
    early = [2.0 * (1 + 1e-4), 2.0, 2.0, 2.0, 2.0, 2.0]     # the same 1e-4 at step 0: beyond the bound there
    within = policy.loss_within_own_noise(ref, late, own, tol)
    assert within.ok and within.where == "step 4" and within.limit == pytest.approx(2e-4)
    beyond = policy.loss_within_own_noise(ref, early, own, tol)
    assert not beyond.ok and beyond.where == "step 0" and beyond.limit == tol.loss_rtol
    assert policy.loss_deviation(ref, early, tol, own).ok       # the whole-run rule would have lent it
