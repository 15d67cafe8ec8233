"""Scan over layers (StepOptions(scan_layers=True)): on jax the step holds one traced layer whatever the depth, on
inductor the layers are one compile region traced once, results match eager's unrolled loop (the shipped GPT and an unmodified Hugging Face Llama), and what cannot be
scanned is refused with one line."""

from __future__ import annotations

import dataclasses
import runpy
import sys

import numpy as np
import pytest

import xbridge as xb
from helpers import FIXTURES, one_error_line, run_cli
from xbridge.errors import ConfigError
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


def test_scan_is_refused_where_it_is_not_built():
    proc = run_cli("run", f"{NETS}:scanned", "--backend", "xla-cpu", "--steps", "2")
    assert proc.returncode == 2 and "StepOptions scan_layers is not available on xla-cpu yet" in one_error_line(proc)


def _subgraph_calls(program):
    """The inductor executable's model as its init left it, its loss traced by torch.compile (Dynamo, then
    AOTAutograd without Inductor): the invoke_subgraph calls of the one graph, and which subgraphs they run."""
    import torch
    from torch._dynamo.backends.registry import lookup_backend

    model = prepare(program, "inductor-cpu", RunOptions(steps=1)).executable.model
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    batch = {k: torch.from_numpy(v) for k, v in program.data.batch(0, program.seed).items()}
    torch.compile(lambda b: program.loss(model, b), backend=capture)(batch).backward()
    assert len(graphs) == 1                     # one graph: the loss, forward and backward
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    return len(calls), {n.args[0].target for n in calls}


def test_inductor_compiles_one_layer_and_reuses_it(tiny_gpt):
    """scan_layers on inductor: the layers are one nested compile region: the loss's graph calls one subgraph once
    per layer (unrolled: no subgraph); losses as eager's unrolled loop. With remat or the portable generator it is
    refused: both came out wrong."""
    reference = _losses(_gpt(tiny_gpt, 4), "eager-cpu")
    np.testing.assert_allclose(_losses(_gpt(tiny_gpt, 4, scan_layers=True), "inductor-cpu"), reference, rtol=1e-5)
    assert _subgraph_calls(_gpt(tiny_gpt, 4, scan_layers=True)) == (4, {"subgraph_0"})
    assert _subgraph_calls(_gpt(tiny_gpt, 4)) == (0, set())
    with pytest.raises(ConfigError, match=r"scan_layers with remat='full' is not available on inductor: torch 2\.9"):
        prepare(_gpt(tiny_gpt, 4, scan_layers=True, remat="full"), "inductor-cpu", RunOptions(steps=1))
    with pytest.raises(ConfigError, match="scan_layers with rng='portable' is not available on inductor"):
        prepare(_gpt(tiny_gpt, 4, scan_layers=True, rng="portable"), "inductor-cpu", RunOptions(steps=1))


def test_a_mlp_of_identical_layers_scans_on_jax():
    from xbridge.program_file import load_program

    program = load_program(f"{NETS}:scanned")
    plain = program.replace(step=xb.StepOptions())
    np.testing.assert_allclose(_losses(program, "jax-cpu"), _losses(plain, "eager-cpu"), rtol=1e-5)
