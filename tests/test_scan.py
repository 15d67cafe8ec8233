"""Scan over layers (StepOptions(scan_layers=True)): on jax the step holds one traced layer whatever the depth,
results match eager's unrolled loop (the shipped GPT and an unmodified Hugging Face Llama), and what cannot be
scanned is refused with one line."""

from __future__ import annotations

import dataclasses
import runpy
import sys

import numpy as np
import pytest

import xbridge as xb
from helpers import FIXTURES, one_error_line, run_cli
from xbridge.run.loop import RunOptions, prepare, run

pytest.importorskip("torchax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")


def _gpt(tiny_gpt, layers, **step):
    gpt = sys.modules[tiny_gpt.loss.__module__]
    return tiny_gpt.replace(model=lambda: gpt.GPT(vocab=256, dim=32, layers=layers, heads=2, seq=32),
                            step=dataclasses.replace(tiny_gpt.step, **step))


def _losses(program, target, steps=3):
    return [s.loss for s in run(program, target, RunOptions(steps=steps, warmup=1)).steps]


def _dots(program):
    import jax

    exe = prepare(program, "jax-cpu", RunOptions(steps=1)).executable
    return str(jax.make_jaxpr(exe.jitted)(exe.state, exe.put(program.data.batch(0, program.seed)))).count("dot_general[")


def test_scanned_gpt_matches_eager_and_traces_one_layer(tiny_gpt):
    reference = _losses(_gpt(tiny_gpt, 4), "eager-cpu")
    assert _losses(_gpt(tiny_gpt, 4, scan_layers=True), "eager-cpu") == reference    # eager runs its loop
    for remat in ("none", "full"):
        scanned = _losses(_gpt(tiny_gpt, 4, scan_layers=True, remat=remat), "jax-cpu")
        np.testing.assert_allclose(scanned, reference, rtol=1e-5, err_msg=remat)
    # the traced step: its products do not grow with depth when scanned, and do when unrolled
    assert _dots(_gpt(tiny_gpt, 2, scan_layers=True)) == _dots(_gpt(tiny_gpt, 6, scan_layers=True))
    assert _dots(_gpt(tiny_gpt, 6)) > _dots(_gpt(tiny_gpt, 2))


def test_an_unmodified_hf_llama_scans_its_decoder_layers():
    pytest.importorskip("transformers")
    llama = runpy.run_path(str(FIXTURES / "hf_zoo.py"))["llama"]
    reference = _losses(llama, "eager-cpu")
    scanned = llama.replace(step=dataclasses.replace(llama.step, scan_layers=True))     # finds model.layers
    np.testing.assert_allclose(_losses(scanned, "jax-cpu"), reference, rtol=1e-5)


NETS = str(FIXTURES / "layer_nets.py")


@pytest.mark.parametrize("target", ["inductor-cpu", "xla-cpu"])
def test_scan_is_refused_where_it_is_not_built(target):
    proc = run_cli("run", f"{NETS}:scanned", "--backend", target, "--steps", "2")
    fragment = f"StepOptions scan_layers is not available on {target.removesuffix('-cpu') if 'inductor' in target else target} yet"
    assert proc.returncode == 2 and fragment in one_error_line(proc)


def test_a_mlp_of_identical_layers_scans_on_jax():
    from xbridge.program_file import load_program

    program = load_program(f"{NETS}:scanned")
    plain = program.replace(step=xb.StepOptions())
    np.testing.assert_allclose(_losses(program, "jax-cpu"), _losses(plain, "eager-cpu"), rtol=1e-5)
