"""bf16-mixed means torch.autocast's CPU policy on every backend: op by op against eager autocast (output dtype and
value), including what real models do (lists to cat, their own float32 regions, attention with mixed inputs,
BatchNorm on bfloat16 activations), and the same check failing on the policies torch_xla and torchax ship with."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import ROOT, user_env

pytestmark = [pytest.mark.slow]
CHECK = ROOT / "tests" / "fixtures" / "autocast_check.py"
CASES = {"linear", "matmul", "bmm", "einsum", "sdpa_mixed_dtypes", "conv2d", "cat_list_promote", "stack_bf16",
         "softmax_bf16", "log_softmax_bf16", "pow_bf16", "max_pool2d_fp32", "batch_norm_bf16_input",
         "mse_loss_fp32_policy", "fp32_region", "explicit_float_then_matmul", "inplace_add", "float64_left_alone"}
# bfloat16 keeps 8 bits of mantissa: one rounding of a result is 2**-8 of its magnitude; a product's inputs and
# output are each rounded once
BF16_REL = 2e-2


def _check(backend: str, *extra: str) -> dict[str, dict]:
    proc = subprocess.run([sys.executable, str(CHECK), backend, *extra], capture_output=True, text=True,
                          timeout=300, env={**user_env(), "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == CASES
    return report


def _mismatches(report: dict[str, dict]) -> dict[str, str]:
    out = {}
    for name, row in report.items():
        if "error" in row:
            out[name] = row["error"]
        elif row["dtype"] != row["reference_dtype"]:
            out[name] = f"{row['dtype']} vs {row['reference_dtype']}"
        elif not row["max_rel_diff"] <= BF16_REL:
            out[name] = f"values differ by {row['max_rel_diff']:.2e}"
    return out


@pytest.mark.parametrize("backend", [pytest.param("xla", marks=pytest.mark.xla_env), "jax"])
def test_autocast_matches_eager_op_by_op(backend):
    found = _mismatches(_check(backend))
    if backend == "jax":
        # JAX runs without x64 (docs/backends/jax.md): float64 is float32 there, so autocast casts it
        assert found.pop("float64_left_alone") == "bfloat16 vs float64"
    assert found == {}


@pytest.mark.parametrize("backend,expected", [
    # torch_xla's own AutocastXLA list: no attention (mixed q/k/v fail), float32 softmax and pow, bfloat16 pooling
    pytest.param("xla", {"sdpa_mixed_dtypes", "softmax_bf16", "log_softmax_bf16", "pow_bf16", "max_pool2d_fp32",
             "batch_norm_bf16_input"}, marks=pytest.mark.xla_env),
    # torchax's table with a hook that ignores the model's float32 regions, and F.linear left to the aten table
    ("jax", {"linear", "fp32_region", "float64_left_alone"}),
])
def test_the_check_fails_on_the_policies_the_libraries_ship(backend, expected):
    assert set(_mismatches(_check(backend, "--broken"))) == expected
