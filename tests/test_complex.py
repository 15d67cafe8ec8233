"""Complex parameters (tests/fixtures/fno.py: the Fourier neural operator's spectral weights, ``torch.cfloat``):
kept complex by the model's setup under every precision, trained alike on eager, inductor and jax (torch's gradient
convention and torch.optim's treatment of a complex parameter as its real and imaginary parts), checkpointed as
complex arrays and resumed on another backend; refused before compute on xla-cpu, which has no FFT here.

Until 2026-12-07 the setup cast every complex tensor to float32: the imaginary part was dropped on every backend,
eager included, with exit 0."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import FIXTURES, assert_check_agrees, run_cli, xbridge_here

FNO = str(FIXTURES / "fno.py")


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "params=bfloat16,compute=bfloat16,output=float32"])
def test_complex_parameters_stay_complex_under_every_precision(precision):
    import torch

    from xbridge.program_file import load_program
    from xbridge.torch.model_setup import build_model
    from xbridge.torch.weights import initial_weights

    program = load_program(FNO).replace(precision=precision)
    weights = initial_weights(program)
    assert weights["conv0.weights1"].dtype == np.complex64 and np.abs(weights["conv0.weights1"].imag).max() > 0
    model = build_model(program, weights, torch.device("cpu"))
    spectral = model.conv0.weights1
    assert spectral.dtype == torch.complex64
    np.testing.assert_array_equal(spectral.detach().numpy(), weights["conv0.weights1"])
    assert model.fc0.weight.dtype == getattr(torch, program.precision.params)


@pytest.mark.slow   # a parity of three targets
def test_an_fno_with_complex_weights_passes_parity_and_xla_refuses_it_before_compute(tmp_path):
    proc = run_cli("parity", FNO, "--steps", "6", "--backends", "inductor-cpu,jax-cpu,xla-cpu", "--format", "json",
                   "--out", str(tmp_path / "parity"), "--jobs", "2")
    record = json.loads(proc.stdout)
    rows = {r["target"]: r for r in record["targets"]}
    for target in ("inductor-cpu", "jax-cpu"):
        row = rows[target]
        assert row["verdict"] == "pass", (target, row.get("error"), row.get("max_loss_dev"), row.get("max_param_dev"))
        assert row["max_param_dev"] < 1e-5        # the complex weights themselves, imaginary parts included
    xla = rows["xla-cpu"]
    assert xla["verdict"] == "error" and "aten::_fft_r2c in conv0 (" in xla["error"], xla
    assert proc.returncode == 1
    assert_check_agrees(FNO, record)
    # check says the same before any run, and why
    checked = xbridge_here("check", FNO, "--backends", "jax-cpu,xla-cpu", "--format", "json")
    verdicts = {v["target"]: v for v in json.loads(checked.stdout)["targets"]}
    assert verdicts["jax-cpu"]["verdict"] == "runs", verdicts["jax-cpu"]
    assert verdicts["xla-cpu"]["verdict"] != "runs" and "aten::_fft_r2c" in json.dumps(verdicts["xla-cpu"])


@pytest.mark.slow   # two runs in their own processes
def test_a_jax_checkpoint_of_complex_weights_resumes_on_eager_as_one_run(tmp_path):
    """SGD with momentum: the momentum buffer of a complex parameter crosses backends as torch stores it (complex),
    and the resumed run's losses are the uninterrupted run's."""
    ck = tmp_path / "ck"
    first = run_cli("run", f"{FNO}:sgd", "--backend", "jax-cpu", "--steps", "3", "--checkpoint-dir", str(ck),
                    "--format", "json")
    assert first.returncode == 0, first.stderr[-2000:]
    import safetensors.numpy

    train = safetensors.numpy.load_file(str(ck / "step-00000003" / "train.safetensors"))
    assert train["optim/conv0.weights1/momentum_buffer"].dtype == np.complex64
    resumed = xbridge_here("run", f"{FNO}:sgd", "--steps", "5", "--resume", str(ck), "--format", "json")
    whole = xbridge_here("run", f"{FNO}:sgd", "--steps", "5", "--format", "json")
    assert resumed.returncode == 0 and whole.returncode == 0, resumed.stderr
    losses = [s["loss"] for s in json.loads(first.stdout)["steps"] + json.loads(resumed.stdout)["steps"]]
    np.testing.assert_allclose(losses, [s["loss"] for s in json.loads(whole.stdout)["steps"]], rtol=2e-6)
