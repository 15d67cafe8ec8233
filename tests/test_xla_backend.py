"""The torch_xla backend against the eager reference. torch_xla's runtime is per process (PJRT_DEVICE,
CPU_NUM_DEVICES, SPMD over every device of the process), so each run is a real `xbridge run` subprocess; the
reference runs in this process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import xbridge as xb
from helpers import FIXTURES, PROGRAMS, ROOT, one_error_line, run_cli, user_env
from xbridge.contract import registry
from xbridge.errors import BackendUnavailable
from xbridge.parity import policy as parity
from xbridge.run.loop import RunOptions
from xbridge.run.prepare import prepare
from xbridge.run.steps import train

# In .venv-xla (scripts/test.sh's xla leg): the eager reference in this process on torch 2.9, as torch_xla's own
pytestmark = [pytest.mark.cli, pytest.mark.xla_env]


def _eager(program, steps):
    prepared = prepare(program, "eager-cpu", RunOptions(steps=steps))
    losses = [r.loss for r in train(program, prepared, steps, min(2, steps - 1))]
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
@pytest.mark.parametrize("name,steps,devices,precision,mode", [
    ("mlp", 20, 4, "bf16-mixed", "lazy"), pytest.param("gpt", 3, 4, "fp32", "lazy", marks=pytest.mark.extended), ("mlp", 20, 1, "fp32", "lazy"),
    # Dynamo capture (torch.compile(backend="openxla")) of the same programs, SPMD on 1 and 4 devices
    ("mlp", 20, 4, "fp32", "openxla"), ("gpt", 3, 4, "fp32", "openxla"), ("mlp", 20, 1, "bf16-mixed", "openxla")])
def test_parity_layout_and_recompiles(tmp_path, name, steps, devices, precision, mode):
    """Shardings read back from torch_xla (tests/test_parity.py runs the full parity matrix)."""
    from xbridge.program_file import load_program

    program = load_program(str(PROGRAMS / f"{name}.py")).replace(precision=precision)
    ref_losses, ref_state = _eager(program, steps)
    result, state = _xla(tmp_path, PROGRAMS / f"{name}.py", steps, devices, precision, "--xla-mode", mode)
    tol = parity.tolerance(precision)
    loss_dev = parity.loss_deviation(ref_losses, [s["loss"] for s in result["steps"]], tol)
    param_dev = parity.param_deviation(ref_state, state, tol)
    assert loss_dev.ok, loss_dev
    assert param_dev.ok, param_dev
    if mode == "openxla" and precision == "fp32":
        # Tighter than the policy on purpose: measured 1.4e-7 (GPT) and 2.3e-7 (MLP). Without the fresh inputs of
        # fresh_input_loss, torch_xla 2.9's SPMD input matching freezes the LayerNorm weights the backward reads at
        # their step-0 values: 1.5e-5 on the GPT after 3 steps, inside the policy's 1e-4, but a wrong gradient.
        assert param_dev.value < 2e-6, param_dev
    assert result["summary"]["recompiles_after_warmup"] == 0
    assert result["mesh"] == ({"data": 2, "model": 2} if devices > 1 else {"data": 1, "model": 1})
    # the shardings torch_xla reports match the plan: every device holds a shard of the planned shape
    plan = xb.plan(program.replace(mesh=xb.Mesh(data=-1, model=2 if devices > 1 else 1)), devices)
    for p in plan.params:
        shapes = result["layout"][p.name]["shard_shapes"]
        assert len(shapes) == devices and {tuple(s) for s in shapes} == {p.shard_shape}, p.name
    if devices > 1:
        assert "devices=[" in result["layout"]["fc1.weight" if name == "mlp" else "blocks.0.q.weight"]["spec"]


@pytest.mark.parametrize("mode", ["lazy", "openxla"])
def test_schedule_and_fp16_without_recompiles(tmp_path, mlp_program, mode):
    """A warm-up + cosine schedule (new lr every step), gradient accumulation, clipping and dynamic loss scaling
    still compile once, in both modes."""
    fixture = tmp_path / "prog.py"
    fixture.write_text(
        "import xbridge as xb\nfrom xbridge.program_file import load_program\n"
        f"program = load_program({str(PROGRAMS / 'mlp.py')!r}).replace(\n"
        "    optimizer=xb.AdamW(lr=3e-3, weight_decay=0.1, schedule=xb.WarmupCosine(3, 10)),\n"
        "    step=xb.StepOptions(grad_accum=2, clip_grad_norm=1.0))\n")
    from xbridge.program_file import load_program

    program = load_program(str(fixture)).replace(precision="fp16-mixed")
    ref_losses, ref_state = _eager(program, 8)
    result, state = _xla(tmp_path, fixture, 8, 1, "fp16-mixed", "--xla-mode", mode)
    tol = parity.tolerance("fp16-mixed")
    assert parity.loss_deviation(ref_losses, [s["loss"] for s in result["steps"]], tol).ok
    assert parity.param_deviation(ref_state, state, tol).ok
    assert result["summary"]["recompiles_after_warmup"] == 0
    assert [s["lr"] for s in result["steps"]] == pytest.approx([3e-3 * xb.WarmupCosine(3, 10).factor(t) for t in range(8)])


@pytest.mark.parametrize("mode", ["lazy", "openxla"])
def test_recompile_after_warmup_is_counted_with_its_cause(tmp_path, mode):
    """A new batch shape after warm-up: counted, and summarised from torch_xla's compilation analysis (and
    Dynamo's guard failure in openxla mode), one line per cause with its count. Checkpoints are not recompiles."""
    fixture = ROOT / "tests" / "fixtures" / "half_batch_first.py"
    # checkpoints after warm-up copy sharded arrays to the host, which compiles programs of its own: not counted
    proc = run_cli("run", str(fixture), "--backend", "xla-cpu", "--steps", "5", "--devices", "4", "--mesh",
                   "data=-1,model=2", "--xla-mode", mode, "--format", "json", "--checkpoint-every", "2",
                   "--checkpoint-dir", str(tmp_path / "ck"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)["summary"]
    reasons = summary["recompile_reasons"]
    assert all(line.count("\n") == 0 for line in reasons), reasons
    if mode == "lazy":
        # one step graph, traced again for the new shape
        assert summary["recompiles_after_warmup"] == 1
        assert reasons == ["xla compile x1: torch_xla.compile (graph 'xbridge-mlp')"], reasons
    else:
        # Dynamo captures the loss again (its guard on the batch shape fails) and XLA compiles the new forward and
        # backward graphs; the update's graph does not see the batch (the optimizer state is built before the first
        # step, optimizer_state.create_state), so it is not compiled again
        assert summary["recompiles_after_warmup"] == 3
        assert "dynamo recompile x1: the loss: tensor 'batch['x']' size mismatch at index 0. expected 32, actual 64" \
            in reasons, reasons
        assert ("xla compile x2: dynamo is compiling a FX graph to HLO (graph 'xbridge-mlp', in torch_xla's Dynamo "
                "bridge (extract_graph_helper))") in reasons, reasons
        assert len(reasons) == 2, reasons
    assert not any("no cause recorded" in line for line in reasons), reasons


def test_xla_mode_is_checked(tmp_path):
    proc = run_cli("run", str(PROGRAMS / "mlp.py"), "--backend", "xla-cpu", "--steps", "2", "--xla-mode", "dynamo")
    assert "--xla-mode 'dynamo' is not a choice of target xla-cpu; use one of lazy, openxla" in one_error_line(proc)
    proc = run_cli("run", str(PROGRAMS / "mlp.py"), "--backend", "eager-cpu", "--steps", "2", "--xla-mode", "openxla")
    assert "takes no --xla-mode" in one_error_line(proc)
    # Dynamo must import the module of the code it traces: runpy's "<run_path>" is refused in one line
    fixture = tmp_path / "via_runpy.py"
    fixture.write_text(f"import runpy\nprogram = runpy.run_path({str(PROGRAMS / 'mlp.py')!r})['program']\n")
    proc = run_cli("run", str(fixture), "--backend", "xla-cpu", "--steps", "2", "--xla-mode", "openxla")
    assert "the program's loss comes from module '<run_path>', which Dynamo cannot import" in one_error_line(proc)


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


def test_xbridge_kernels_for_grouped_mm_and_histc_match_torch():
    """torch_xla 2.9 has no _grouped_mm (it crashes), runs histc and _embedding_bag on the CPU (histc: floats only)
    and updates BatchNorm's running variance with the biased variance: xbridge's kernels
    (backends/xlaspmd/ops.py) against torch's own, forward and backward."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "xla_ops_check.py")],
                          capture_output=True, text=True, timeout=300, env={**user_env(), "PJRT_DEVICE": "CPU"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    bags = {f"embedding_bag_{name}{grad}" for name in ("sum", "mean", "max", "weighted", "last_offset")
            for grad in ("", "_grad")}
    assert set(diffs) == {"forward", "grad_a", "grad_b", "histc_int", "histc_float_range", "batch_norm",
                          "batch_norm_grad", "batch_norm_running_var", "batch_norm_running_mean", *bags}
    assert all(value <= 1e-5 for value in diffs.values()), diffs


@pytest.mark.cli
@pytest.mark.parametrize("program,says", [
    ("bad_programs.py:no_such_layers", "StepOptions layers='blocks': the model (Linear) has no submodule 'blocks'"),
    ("bad_data.py:reserved_key", "data Spoiled, step 0: batch key 'xbridge.rng' is reserved for --rng portable"),
])
def test_the_checks_every_backend_makes_hold_on_xla(program, says):
    """The same lines as eager and jax give (tests/test_bad_input.py, in its process); xla's in a fresh interpreter:
    torch_xla's runtime, once started in the test process, changes its environment for the tests after it."""
    proc = run_cli("run", str(FIXTURES / program), "--backend", "xla-cpu", "--steps", "2")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in one_error_line(proc)
