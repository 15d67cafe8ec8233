"""Scan over layers (StepOptions(scan_layers=True)): on jax and xla the step holds one traced layer whatever the
depth, on inductor the layers are one compile region traced once, results match eager's unrolled loop (the shipped GPT
and an unmodified Hugging Face Llama), and what cannot be scanned is refused with one line."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import numpy as np
import pytest

import xbridge as xb
from helpers import FIXTURES, one_error_line, run_cli
from xbridge.contract.capabilities import diagnostics
from xbridge.errors import ConfigError
from xbridge.run.loop import RunOptions, run
from xbridge.run.prepare import prepare

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


NETS = str(FIXTURES / "layer_nets.py")


SCANNED = str(FIXTURES / "scanned_gpt.py")
XLA_DOT = re.compile(r"= \w+\[[^\]]*\](?:\{[^}]*\})? dot\(")


def _xla_scanned(tmp_path, name, *extra):
    """One ``xbridge run`` of scanned_gpt.py:NAME on xla-cpu (a fresh process, as a user runs it): its losses, and
    the matrix products, while loops and instructions of the first train step's HLO module, as torch_xla handed it
    to XLA."""
    dump = tmp_path / name
    proc = run_cli("run", f"{SCANNED}:{name}", "--backend", "xla-cpu", "--steps", "4", "--warmup", "2",
                   "--format", "json", "--dump", str(dump), *extra)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    assert record["summary"]["recompiles_after_warmup"] == 0     # the traced layer is reused, not traced anew
    steps = sorted(p for p in dump.rglob("*before_optimizations.txt") if ".xbridge-" in p.name)   # the train step
    hlo = steps[0].read_text(errors="replace")
    return [s["loss"] for s in record["steps"]], len(XLA_DOT.findall(hlo)), hlo.count(" while("), hlo.count(" = ")


def test_xla_scans_the_layers_as_one_loop(tmp_path):
    """torch_xla's scan: the step's graph holds one layer in a While loop whatever the depth (the same number of
    matrix products at 2 and 6 layers; unrolled, 6 layers hold more), and the losses are eager's unrolled loop's.
    With remat='full' the backward loop recomputes the layer (more products in the same loops) and the losses stay
    eager's. The layers' parameters and Adam state are held stacked between steps, so the whole step (the update,
    clipping and the gradient norm too) is the same graph at 2 and 6 layers: with them per layer, the optimizer's
    part grew with depth (measured: 4518 and 8542 instructions, against 3289 at both now)."""
    from xbridge.program_file import load_program

    losses_6, dots_6, loops_6, size_6 = _xla_scanned(tmp_path, "layers_6")
    _, dots_2, _, size_2 = _xla_scanned(tmp_path, "layers_2")
    _, dots_unrolled, loops_unrolled, size_unrolled = _xla_scanned(tmp_path, "unrolled_6")
    losses_remat, dots_remat, loops_remat, _ = _xla_scanned(tmp_path, "remat")
    assert loops_6 >= 1 and loops_unrolled == 0 and loops_remat == loops_6
    assert dots_6 == dots_2 < dots_unrolled, (dots_2, dots_6, dots_unrolled)
    assert size_6 == size_2 < size_unrolled, (size_2, size_6, size_unrolled)
    assert dots_remat > dots_6, (dots_remat, dots_6)
    reference = _losses(load_program(f"{SCANNED}:unrolled_6"), "eager-cpu", steps=4)
    np.testing.assert_allclose(losses_6, reference, rtol=1e-5)
    np.testing.assert_allclose(losses_remat, reference, rtol=1e-5)


@pytest.mark.extended
@pytest.mark.slow
def test_xla_scanned_state_crosses_to_and_from_eager_by_eager_names(tmp_path):
    """The stacked parameters and Adam moments of a scanned xla run, split over model=2, are checkpointed under the
    eager names and resume an unrolled eager run, and the other way round; the layout names every layer."""
    from xbridge.program_file import load_program

    unrolled = load_program(f"{SCANNED}:unrolled_6")
    reference = _losses(unrolled, "eager-cpu", steps=6)
    xla = ("--backend", "xla-cpu", "--devices", "2", "--mesh", "data=-1,model=2", "--warmup", "1", "--format", "json")
    first = run_cli("run", f"{SCANNED}:layers_6", "--steps", "3", "--checkpoint-dir", str(tmp_path / "xla"), *xla)
    assert first.returncode == 0, first.stderr[-2000:]
    layout = json.loads(first.stdout)["layout"]
    assert layout["blocks.5.q.weight"]["shard_shapes"] == [[16, 32]] * 2 and "blocks.*.q.weight" not in layout
    resumed = run(unrolled, "eager-cpu", RunOptions(steps=6, warmup=1, resume=tmp_path / "xla"))
    np.testing.assert_allclose([s.loss for s in resumed.steps], reference[3:], rtol=2e-5)

    run(unrolled, "eager-cpu", RunOptions(steps=3, warmup=1, checkpoint_dir=tmp_path / "eager"))
    rest = run_cli("run", f"{SCANNED}:layers_6", "--steps", "6", "--resume", str(tmp_path / "eager"), *xla)
    assert rest.returncode == 0, rest.stderr[-2000:]
    np.testing.assert_allclose([s["loss"] for s in json.loads(rest.stdout)["steps"]], reference[3:], rtol=2e-5)


@pytest.mark.xla_env     # the check script runs torch_xla in its own process: this environment's interpreter
def test_xla_scan_reuses_its_lowered_loops_and_computes_what_torch_xla_does():
    """After its first call, each scan (the training step's forward and backward, the evaluation's forward) reuses
    the While loop lowered for it (backends/xlaspmd/layer_scan_loops.py) instead of lowering its layer again, over 2
    devices split model=2 and with the layers recomputed: nothing is compiled again after warm-up (a reused loop
    makes the graph the first call made), the losses and evaluation losses are those of torch_xla's scan as it
    ships, and the cached loops hold no tensor of a step (only the traced layer's scalar constants)."""
    import subprocess

    proc = subprocess.run([sys.executable, str(FIXTURES / "xla_scan_loops_check.py"), "remat"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 4 steps (forward and backward) and evaluations at steps 0, 2 and 4: the first call of each lowers
    assert out["evals"] == 3 and out["hits"] == 2 * (4 - 1) + (3 - 1) and out["hits_after"] == out["hits"], out
    assert out["recompiles"] == 0, out
    assert out["held"] and all(shape == [] for loop in out["held"] for shape in loop), out["held"]
    np.testing.assert_allclose(out["cached"], out["plain"], rtol=1e-6)


@pytest.mark.parametrize("name, extra, message", [
    ("dropout", (), "StepOptions scan_layers is not available on xla-cpu for layers that draw random numbers: "
                    "blocks.0 calls aten.native_dropout.default"),
    ("remat_dots", (), "StepOptions remat='dots' is not available on xla-cpu"),
    ("layers_2", ("--xla-mode", "openxla"), "StepOptions scan_layers is not available with --xla-mode openxla"),
])
def test_xla_refuses_what_its_scan_gets_wrong(name, extra, message):
    """Each measured failing (dropout: a crash inside the step), refused with one line and exit 2."""
    proc = run_cli("run", f"{SCANNED}:{name}", "--backend", "xla-cpu", "--steps", "2", *extra)
    assert proc.returncode == 2 and message in one_error_line(proc)


@pytest.mark.extended
@pytest.mark.slow
def test_an_unmodified_hf_llama_scanned_passes_parity_on_xla_and_jax_tensor_parallel(tmp_path):
    """Transformers' decoder layers take the mask, positions, position embeddings and a KV cache object besides the
    hidden states (its `model.layers` found without being named); scanned on 2 devices with Megatron's split over
    `model`, xla and jax match eager."""
    pytest.importorskip("transformers")
    proc = run_cli("parity", f"{FIXTURES / 'hf_zoo.py'}:llama_scanned", "--backends", "xla-cpu,jax-cpu",
                   "--steps", "4", "--devices", "2", "--format", "json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    verdicts = {r["target"]: r["verdict"] for r in json.loads(proc.stdout)["targets"]}
    assert verdicts == {"xla-cpu": "pass", "jax-cpu": "pass"}, proc.stdout[-2000:]


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


@pytest.mark.both_envs
def test_inductor_compiles_one_layer_and_reuses_it(tiny_gpt):
    """scan_layers on inductor: the layers are one nested compile region: the loss's graph calls one subgraph once
    per layer (unrolled: no subgraph); losses as eager's unrolled loop, with remat too (the checkpoint inside the
    region). With the portable generator it is refused: it came out wrong. On torch 2.14 (.venv) the region gives
    wrong losses and scan_layers is refused before anything compiles; torch 2.9 (.venv-xla) runs it."""
    import torch
    from packaging.version import Version

    from xbridge.backends.inductor import layer_scan

    if Version(torch.__version__).release[:2] != (2, 9):
        with pytest.raises(ConfigError, match=f"scan_layers is not available on inductor with torch "
                                              f"{Version(torch.__version__).base_version}: its nested compile region "
                                              "gives wrong losses there"):
            prepare(_gpt(tiny_gpt, 4, scan_layers=True), "inductor-cpu", RunOptions(steps=1))
        return
    layer_scan.refuse_where_wrong("2.9.0+cu128")        # the releases it was measured right on
    with pytest.raises(ConfigError, match="with torch 2.14.1: "):
        layer_scan.refuse_where_wrong("2.14.1+cu130")
    reference = _losses(_gpt(tiny_gpt, 4), "eager-cpu")
    for remat in ("none", "dots"):      # "full" too when it was written (2026-12-05); dots is the policy checkpoint
        scanned = _gpt(tiny_gpt, 4, scan_layers=True, remat=remat)
        np.testing.assert_allclose(_losses(scanned, "inductor-cpu"), reference, rtol=1e-5, err_msg=remat)
        assert _subgraph_calls(scanned) == (4, {"subgraph_0"}), remat
    assert _subgraph_calls(_gpt(tiny_gpt, 4)) == (0, set())
    with pytest.raises(ConfigError, match="scan_layers with rng='portable' is not available on inductor"):
        prepare(_gpt(tiny_gpt, 4, scan_layers=True, rng="portable"), "inductor-cpu", RunOptions(steps=1))


def test_a_mlp_of_identical_layers_scans_on_jax():
    from xbridge.program_file import load_program

    program = load_program(f"{NETS}:scanned")
    plain = program.replace(step=xb.StepOptions())
    np.testing.assert_allclose(_losses(program, "jax-cpu"), _losses(plain, "eager-cpu"), rtol=1e-5)


def _kernels(program, devices=1):
    """The number of fused kernels in the compiled train step (XLA:CPU compiles each on its own), and the
    executable."""
    exe = prepare(program, "jax-cpu", RunOptions(steps=1, devices=devices)).executable
    hlo = exe.jitted.lower(exe.state, exe.put(program.data.batch(0, program.seed))).compile().as_text()
    return hlo.count(" fusion("), exe


def test_jax_holds_the_scanned_layers_stacked(tmp_path, tiny_gpt):
    """The layers' parameters and Adam state are one stacked array per layer-relative name between steps, so the
    whole step (update, clipping, gradient norm, non-finite counts) compiles to the same kernels at 2 and 6 layers
    (unrolled they grow); the state crosses to and from eager under the eager names, the Adam moments included."""
    assert _kernels(_gpt(tiny_gpt, 2, scan_layers=True))[0] == _kernels(_gpt(tiny_gpt, 6, scan_layers=True))[0]
    assert _kernels(_gpt(tiny_gpt, 6))[0] > _kernels(_gpt(tiny_gpt, 2))[0]
    sharded = _gpt(tiny_gpt, 4, scan_layers=True).replace(mesh=xb.Mesh(data=-1, model=2))
    _, exe = _kernels(sharded, devices=4)
    assert exe.state["params"]["blocks.*.q.weight"].shape == (4, 32, 32)
    assert diagnostics(exe).layout()["blocks.3.q.weight"]["shard_shapes"] == [[16, 32]] * 4
    assert "blocks.2.up.weight" in exe.state_dict() and "blocks.*.up.weight" not in exe.state_dict()

    unrolled = _gpt(tiny_gpt, 4)
    reference = _losses(unrolled, "eager-cpu", steps=6)
    for first, second, devices in (("eager-cpu", "jax-cpu", 4), ("jax-cpu", "eager-cpu", 1)):
        ck = tmp_path / first
        run(sharded if first == "jax-cpu" else unrolled, first,
            RunOptions(steps=3, warmup=1, devices=4 if first == "jax-cpu" else 1, checkpoint_dir=ck))
        resumed = run(sharded if second == "jax-cpu" else unrolled, second,
                      RunOptions(steps=6, warmup=1, devices=devices, resume=ck))
        np.testing.assert_allclose([s.loss for s in resumed.steps], reference[3:], rtol=2e-5, err_msg=first)


@pytest.mark.extended
@pytest.mark.slow
def test_scanned_and_recomputed_layers_pass_parity_in_bf16_mixed(tmp_path):
    """The scanned GPT with remat='full' on every compiling backend against eager's loop, in bf16-mixed: losses,
    parameters, and the dtype every matrix product ran in (fp32: the loss checks above, per backend)."""
    proc = run_cli("parity", f"{SCANNED}:remat", "--backends", "inductor-cpu,jax-cpu,xla-cpu", "--precision",
                   "bf16-mixed", "--steps", "4", "--jobs", "2", "--format", "json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    assert {r["target"]: r["verdict"] for r in record["targets"]} == dict.fromkeys(
        ("inductor-cpu", "jax-cpu", "xla-cpu"), "pass")
    assert all(set(r["matmul_dtypes"]) == {"bfloat16"} for r in record["targets"]), record["targets"]
