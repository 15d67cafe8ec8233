"""Activation checkpointing (StepOptions(remat=...), --remat): the layers are really recomputed and keep less for the
backward pass, and no result changes, on every backend (dropout under --rng portable included)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from helpers import FIXTURES, PROGRAMS, one_error_line, run_cli
from xbridge.program_file import load_program
from xbridge.run.loop import RunOptions
from xbridge.run.prepare import prepare
from xbridge.run.steps import train

LAYERED = str(FIXTURES / "layered.py")


def _with(program, remat):
    return program.replace(step=dataclasses.replace(program.step, remat=remat))


def _train(program, target, steps=3):
    prepared = prepare(program, target, RunOptions(steps=steps))
    records = train(program, prepared, steps, 1)
    return records, prepared.executable


def _one_step_kept(program) -> tuple[int, list[int]]:
    """Bytes autograd keeps for the backward pass of one eager step (outside the checkpoints' own storage), and how
    often each layer's first projection ran during the step (forward and recomputation)."""
    exe = prepare(program, "eager-cpu", RunOptions(steps=1)).executable
    calls = [0] * len(exe.model.blocks)
    for i, layer in enumerate(exe.model.blocks):
        layer.q.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    kept = [0]

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        exe.step(program.data.batch(0, program.seed))
    return kept[0], calls


def test_remat_keeps_no_result_changed_and_recomputes_each_layer_on_eager():
    program = load_program(LAYERED)
    base, _ = _train(_with(program, "none"), "eager-cpu")
    for remat in ("full", "dots"):
        records, exe = _train(_with(program, remat), "eager-cpu")
        assert [r.loss for r in records] == [r.loss for r in base], remat       # bit for bit on one stack
        assert [r.metrics["grad_norm"] for r in records] == [r.metrics["grad_norm"] for r in base], remat
    native = program.replace(step=dataclasses.replace(program.step, rng="native"))
    kept_none, calls_none = _one_step_kept(_with(native, "none"))
    kept_full, calls_full = _one_step_kept(_with(native, "full"))
    _, calls_dots = _one_step_kept(_with(native, "dots"))
    assert calls_none == [1, 1, 1] and calls_full == [2, 2, 2] and calls_dots == [2, 2, 2]
    assert kept_full < kept_none / 3, (kept_full, kept_none)


def test_remat_on_jax_checkpoints_every_layer_and_changes_no_result():
    pytest.importorskip("torchax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")
    import jax

    program = load_program(LAYERED)
    reference, _ = _train(_with(program, "none"), "eager-cpu")
    for remat in ("full", "dots"):
        records, exe = _train(_with(program, remat), "jax-cpu")
        np.testing.assert_allclose([r.loss for r in records], [r.loss for r in reference], rtol=1e-5, err_msg=remat)
        np.testing.assert_allclose([r.metrics["grad_norm"] for r in records],
                                   [r.metrics["grad_norm"] for r in reference], rtol=1e-4, err_msg=remat)
    # the step's program holds one jax.checkpoint per layer (the last one traced: dots, with its policy)
    native = _with(program.replace(step=dataclasses.replace(program.step, rng="native")), "dots")
    _, exe = _train(native, "jax-cpu", steps=1)
    text = str(jax.make_jaxpr(exe.jitted)(exe.state, exe.put(native.data.batch(0, native.seed))))
    assert text.count("remat2[") >= 3 and "policy=<function dots_saveable" in text, text[:400]


def test_remat_on_xla_changes_no_result(tmp_path):
    """From .venv the xla run goes to .venv-xla: torch 2.9 there, the reference on this environment's torch."""
    program = load_program(LAYERED)
    reference, _ = _train(_with(program, "none"), "eager-cpu")
    proc = run_cli("run", LAYERED, "--backend", "xla-cpu", "--steps", "3", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [s["loss"] for s in json.loads(proc.stdout)["steps"]]
    np.testing.assert_allclose(losses, [r.loss for r in reference], rtol=1e-5)


@pytest.mark.slow
def test_parity_with_remat_at_two_devices(tmp_path):
    """inductor's two ranks (FSDP2 around the recomputed layers) and jax GSPMD over two devices (xla: above)."""
    proc = run_cli("parity", LAYERED, "--backends", "inductor-cpu,jax-cpu", "--devices", "2", "--steps", "3",
                   "--jobs", "2", "--format", "json", "--out", str(tmp_path))
    record = json.loads(proc.stdout)
    assert proc.returncode == 0 and record["passed"], [(r["target"], r.get("cause")) for r in record["targets"]]
    assert all(r["verdict"] == "pass" for r in record["targets"])


_LAYERED_WITH = ("import dataclasses, runpy\n"
                 f"program = runpy.run_path({LAYERED!r})['program']\n"
                 "program = program.replace(step=dataclasses.replace(program.step, {}))\n")
@pytest.mark.parametrize("source, target, fragment", [
    (_LAYERED_WITH.format("remat='dots'"), "xla-cpu", "StepOptions remat='dots' is not available on xla-cpu"),
    (_LAYERED_WITH.format("layers='blocks.0'"), "eager-cpu",
     "StepOptions layers='blocks.0' is a Block, not a non-empty nn.ModuleList"),
    (_LAYERED_WITH.format("layers='tower'"), "jax-cpu",
     "StepOptions layers='tower': the model (GPT) has no submodule 'tower'"),
], ids=["dots-on-xla", "not-a-list", "no-such-layers"])
def test_a_remat_that_cannot_run_is_refused_before_compute(tmp_path, source, target, fragment):
    program_file = tmp_path / "prog.py"
    program_file.write_text(source)
    proc = run_cli("run", str(program_file), "--backend", target, "--steps", "2")
    assert proc.returncode == 2 and fragment in one_error_line(proc)


def test_remat_under_dynamo_on_xla_is_refused():
    proc = run_cli("run", str(PROGRAMS / "gpt.py"), "--backend", "xla-cpu", "--xla-mode", "openxla", "--remat", "full",
                   "--steps", "2")
    fragment = "StepOptions remat='full' is not available with --xla-mode openxla on xla-cpu"
    assert proc.returncode == 2 and fragment in one_error_line(proc)
