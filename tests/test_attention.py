"""Which attention kernel ran, per backend, from the operators that carried each call out (not from a table), and a
forced kernel that runs or is refused before the first step."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from helpers import FIXTURES, PROGRAMS, one_error_line, run_cli
from xbridge.program_file import load_program
from xbridge.run.loop import RunOptions, run

LAYERED = str(FIXTURES / "layered.py")


def _step(program, **changes):
    return program.replace(step=dataclasses.replace(program.step, **changes))


def _kernels(program, target="eager-cpu", steps=2):
    record = run(program, target, RunOptions(steps=steps, warmup=1))
    return record.summary.attention, [s.loss for s in record.steps]


def test_each_call_is_named_by_the_kernel_torch_ran(tiny_gpt, mlp_program):
    assert _kernels(tiny_gpt)[0] == {"flash (CPU)": 2}          # CPU flash: no mask, no dropout
    layered = load_program(LAYERED)                              # dropout 0.1 on the attention weights
    assert _kernels(_step(layered, rng="native"))[0] == {"math": 3}     # no fused CPU kernel takes dropout
    assert _kernels(layered)[0] == {"math (--rng portable dropout)": 3}  # drawn by the portable generator
    assert _kernels(mlp_program)[0] == {}                        # no attention at all


def test_a_forced_kernel_is_the_one_that_runs(tiny_gpt):
    auto, auto_losses = _kernels(tiny_gpt)
    math, math_losses = _kernels(_step(tiny_gpt, attention="math"))
    flash, _ = _kernels(_step(tiny_gpt, attention="flash"))
    assert (auto, math, flash) == ({"flash (CPU)": 2}, {"math": 2}, {"flash (CPU)": 2})
    np.testing.assert_allclose(math_losses, auto_losses, rtol=1e-5)     # two kernels, one attention


def test_jax_reports_torchax_lowering(tiny_gpt):
    pytest.importorskip("torchax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")
    assert _kernels(tiny_gpt, "jax-cpu")[0] == {"math (torchax reference, XLA)": 2}
    assert _kernels(_step(tiny_gpt, attention="math"), "jax-cpu")[0] == {"math (torchax reference, XLA)": 2}


def test_xla_reports_the_math_form_and_refuses_a_fused_kernel():
    pytest.importorskip("torch_xla", reason="the xla backend is not installed (pip install 'xbridge[xla]')")
    proc = run_cli("run", LAYERED, "--backend", "xla-cpu", "--steps", "2", "--rng", "native", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["summary"]["attention"] == {"math (XLA)": 3}
    proc = run_cli("run", str(PROGRAMS / "gpt.py"), "--backend", "xla-cpu", "--attention", "flash", "--steps", "2")
    assert proc.returncode == 2
    assert "StepOptions attention='flash' is not available on xla-cpu" in one_error_line(proc)
