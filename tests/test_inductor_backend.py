"""The Inductor backend: compiled loss and optimizer update, parity with eager, no recompiles, dumps, modes."""

from __future__ import annotations

import json

import pytest

from xbridge import parity
from xbridge.runloop import RunOptions, prepare, train
from conftest import PROGRAMS, one_error_line, run_cli

pytestmark = pytest.mark.cli


def _eager(program, steps):
    prepared = prepare(program, "eager-cpu", RunOptions(steps=steps))
    return [r["loss"] for r in train(program, prepared, steps, 1)], prepared.executable.state_dict()


@pytest.mark.slow
def test_schedule_accumulation_and_clipping_compile_once(tmp_path):
    """AdamW with warm-up + cosine (a new lr every step), grad accumulation and clipping: one compilation."""
    program_file = tmp_path / "prog.py"
    program_file.write_text(
        "import runpy\nimport xbridge as xb\n"
        f"program = runpy.run_path({str(PROGRAMS / 'mlp.py')!r})['program'].replace(\n"
        "    optimizer=xb.AdamW(lr=3e-3, weight_decay=0.1, schedule=xb.WarmupCosine(3, 10)),\n"
        "    step=xb.StepOptions(grad_accum=2, clip_grad_norm=1.0))\n")
    from xbridge.loader import load_program

    program = load_program(str(program_file))
    ref_losses, ref_state = _eager(program, 8)
    proc = run_cli("run", str(program_file), "--backend", "inductor-cpu", "--steps", "8", "--format", "json",
                   "--save-state", str(tmp_path / "state.npz"), "--dump", str(tmp_path / "dump"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    tol = parity.tolerance("fp32")
    assert parity.loss_deviation(ref_losses, [s["loss"] for s in result["steps"]], tol).ok
    import numpy as np

    with np.load(tmp_path / "state.npz") as data:
        assert parity.param_deviation(ref_state, {k: data[k] for k in data.files}, tol).ok
    assert result["summary"]["recompiles_after_warmup"] == 0
    assert any(p.endswith("output_code.py") for p in result["dumped"]), result["dumped"][:5]


def test_bad_compile_mode_and_devices():
    proc = run_cli("run", str(PROGRAMS / "mlp.py"), "--backend", "inductor-cpu", "--compile-mode", "fastest")
    assert proc.returncode == 2
    assert "--compile-mode 'fastest' is not a torch.compile mode" in one_error_line(proc)
    proc = run_cli("run", str(PROGRAMS / "mlp.py"), "--backend", "inductor-cpu", "--devices", "2")
    assert proc.returncode == 2
    assert "target inductor-cpu has 1 device(s) here, but --devices 2" in one_error_line(proc)
