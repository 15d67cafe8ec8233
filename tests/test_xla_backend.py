"""The torch_xla backend against the eager reference. torch_xla's runtime is per process (PJRT_DEVICE,
CPU_NUM_DEVICES, SPMD over every device of the process), so each run is a real `xbridge run` subprocess; the
reference runs in this process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import xbridge as xb
from xbridge import parity, registry
from xbridge.errors import BackendUnavailable
from xbridge.runloop import RunOptions, prepare, train
from conftest import PROGRAMS, run_cli

pytestmark = pytest.mark.cli


def _eager(program, steps):
    prepared = prepare(program, "eager-cpu", RunOptions(steps=steps))
    losses = [r["loss"] for r in train(program, prepared, steps, min(2, steps - 1))]
    return losses, prepared.executable.state_dict()


def _xla(tmp_path, program_file, steps, devices, precision, *extra):
    mesh = "data=-1,model=2" if devices > 1 else "data=-1,model=1"
    proc = run_cli("run", str(program_file), "--backend", "xla-cpu", "--steps", str(steps), "--devices", str(devices),
                   "--mesh", mesh, "--precision", precision, "--format", "json",
                   "--save-state", str(tmp_path / "state.npz"), *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    with np.load(tmp_path / "state.npz", allow_pickle=False) as data:
        state = {k: data[k] for k in data.files}
    return result, state


@pytest.mark.slow
@pytest.mark.parametrize("name,steps,devices,precision", [("mlp", 20, 4, "bf16-mixed"), ("gpt", 3, 4, "fp32"),
                                                          ("mlp", 20, 1, "fp32")])
def test_parity_layout_and_recompiles(tmp_path, name, steps, devices, precision):
    """Shardings read back from torch_xla (tests/test_parity.py runs the full parity matrix)."""
    from xbridge.loader import load_program

    program = load_program(str(PROGRAMS / f"{name}.py")).replace(precision=precision)
    ref_losses, ref_state = _eager(program, steps)
    result, state = _xla(tmp_path, PROGRAMS / f"{name}.py", steps, devices, precision)
    tol = parity.tolerance(precision)
    loss_dev = parity.loss_deviation(ref_losses, [s["loss"] for s in result["steps"]], tol)
    param_dev = parity.param_deviation(ref_state, state, tol)
    assert loss_dev.ok, loss_dev
    assert param_dev.ok, param_dev
    assert result["summary"]["recompiles_after_warmup"] == 0
    assert result["mesh"] == ({"data": 2, "model": 2} if devices > 1 else {"data": 1, "model": 1})
    # the shardings torch_xla reports match the plan: every device holds a shard of the planned shape
    plan = xb.plan(program.replace(mesh=xb.Mesh(data=-1, model=2 if devices > 1 else 1)), devices)
    for p in plan.params:
        shapes = result["layout"][p.name]["shard_shapes"]
        assert len(shapes) == devices and {tuple(s) for s in shapes} == {p.shard_shape}, p.name
    if devices > 1:
        assert "devices=[" in result["layout"]["fc1.weight" if name == "mlp" else "blocks.0.q.weight"]["spec"]


def test_schedule_and_fp16_without_recompiles(tmp_path, mlp_program):
    """A warm-up + cosine schedule (new lr every step) and dynamic loss scaling still compile once."""
    fixture = tmp_path / "prog.py"
    fixture.write_text(
        "import runpy\nimport xbridge as xb\n"
        f"program = runpy.run_path({str(PROGRAMS / 'mlp.py')!r})['program'].replace(\n"
        "    optimizer=xb.AdamW(lr=3e-3, weight_decay=0.1, schedule=xb.WarmupCosine(3, 10)),\n"
        "    step=xb.StepOptions(grad_accum=2, clip_grad_norm=1.0))\n")
    from xbridge.loader import load_program

    program = load_program(str(fixture)).replace(precision="fp16-mixed")
    ref_losses, ref_state = _eager(program, 8)
    result, state = _xla(tmp_path, fixture, 8, 1, "fp16-mixed")
    tol = parity.tolerance("fp16-mixed")
    assert parity.loss_deviation(ref_losses, [s["loss"] for s in result["steps"]], tol).ok
    assert parity.param_deviation(ref_state, state, tol).ok
    assert result["summary"]["recompiles_after_warmup"] == 0
    assert [s["lr"] for s in result["steps"]] == pytest.approx([3e-3 * xb.WarmupCosine(3, 10).factor(t) for t in range(8)])


def test_dump_writes_the_compiled_hlo(tmp_path):
    proc = run_cli("run", str(PROGRAMS / "mlp.py"), "--backend", "xla-cpu", "--devices", "4", "--mesh",
                   "data=-1,model=2", "--steps", "3", "--dump", str(tmp_path), "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    dumped = json.loads(proc.stdout)["dumped"]
    step_modules = [p for p in dumped if "xbridge-mlp" in p and p.endswith("after_optimizations.txt")]
    assert step_modules, dumped
    text = Path(step_modules[0]).read_text()
    assert "HloModule" in text and "all-reduce" in text       # SPMD-partitioned over 4 devices


def test_xla_cuda_and_tpu_are_answered_with_reasons():
    _, backend = registry.resolve("xla-cpu")
    assert backend.unavailable_reason("cuda").startswith("torch_xla 2.9 has no CUDA support")
    with pytest.raises(BackendUnavailable, match="target xla-cuda is unavailable: torch_xla 2.9 has no CUDA support"):
        registry.resolve("xla-gpu")
    with pytest.raises(BackendUnavailable, match="target xla-tpu is unavailable: no TPU here"):
        registry.resolve("xla-tpu")
