"""Programs beyond the zoo (tests/fixtures/families.py): a loss whose shape the data decides is refused with one line
naming its file and line on the stacks that compile the step as one static graph, before the step computes."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES, error_line, run_cli

MASKED = f"{FIXTURES / 'families.py'}:masked"
EVERY = "inductor-cpu,jax-cpu,xla-cpu"


@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.parametrize("target,says", [
    ("jax-cpu", "gives a shape that depends on the values, which JAX's static shapes cannot trace"),
    ("xla-cpu", "gives a shape that depends on the values; torch_xla compiles the step as one graph"),
])
def test_boolean_indexing_in_the_loss_is_one_line_where_the_step_is_one_graph(target, says):
    """Refused before anything is compiled (xbridge/check/before_run.py: check's own verdict), exit 2."""
    proc = run_cli("run", MASKED, "--backend", target, "--steps", "2")
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc)
    assert line.startswith(f"error: program 'masked-mlp' cannot run on {target}: boolean mask (aten::index.Tensor) "
                           "in (loss) (") and "families.py:87)" in line and says in line, line
    assert "step 0" not in proc.stdout        # nothing was trained


@pytest.mark.slow
@pytest.mark.cli
def test_boolean_indexing_trains_on_inductor():
    proc = run_cli("run", MASKED, "--backend", "inductor-cpu", "--steps", "2", "--format", "json")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
@pytest.mark.cli
def test_an_operator_torch_xla_runs_on_the_cpu_is_named():
    """A complex FFT: torch_xla 2.9 has no XLA kernel for aten::_fft_c2c and falls back to the CPU, which the
    one-graph step refuses ("Unexpected execution happens inside the compiled function"). Refused before compute,
    naming the operator and the line (jax and eager train it: the same losses, by hand)."""
    proc = run_cli("run", f"{FIXTURES / 'bad_programs.py'}:complex_fft", "--backend", "xla-cpu", "--steps", "2")
    assert proc.returncode == 2, proc.stderr
    line = error_line(proc)
    assert "program 'complex-fft' cannot run on xla-cpu: aten::_fft_c2c in (model) (" in line, line
    assert "bad_programs.py:70)" in line and "torch_xla has no XLA kernel for it and runs it on the CPU" in line, line


@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.parametrize("name,rng,noisy,targets", [
    # timm's DropPath (an in-place bernoulli_) and dropout; the key bias of either block (whichever's noise is the
    # larger: blocks.0 on CI at stop 49, blocks.1 here on 2026-12-05)
    ("vit", "portable", "attn.qkv.bias", EVERY),
    pytest.param("unet", "portable", "to_k.bias", "jax-cpu,xla-cpu", marks=pytest.mark.extended),      # DDPM: the noise and the timesteps drawn in the loss
    pytest.param("lstm", "native", None, EVERY, marks=pytest.mark.extended),   # nn.LSTM, tied decoder, gradient clipping
])
def test_a_family_passes_parity_across_the_targets(tmp_path, name, rng, noisy, targets):
    """Unmodified timm and diffusers models (random init, small configs) and torch's recurrent layers train alike
    on every CPU target. The ViT's and the UNet's attention key biases have no true gradient (softmax ignores a
    constant added to every key): they are judged against eager's own noise, named in the row; every other tensor
    keeps its limit. (Suite time: the UNet on inductor-cpu, 100 s of Inductor compile alone, and the GRU LM on every
    target passed in the full run of 2026-12-05 and left the suite then.)"""
    proc = run_cli("parity", f"{FIXTURES / 'families.py'}:{name}", "--backends", targets,
                   "--steps", "5", "--rng", rng, "--jobs", "2", "--format", "json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    assert record["rng"] == rng and record["random_draws"] == [] and record["passed"]
    assert [row["target"] for row in record["targets"]] == targets.split(",")
    for row in record["targets"]:
        assert row["verdict"] == "pass" and row["max_loss_dev"] <= 1e-5, row
        if noisy is None:
            assert row["max_param_dev"] <= row["param_limit"] == 1e-4 and not row.get("max_param_dev_note"), row
        elif row["max_param_dev"] > 1e-4:      # only a tensor with no true gradient may pass above the plain limit
            # named as a key bias where the quiet elements are exactly it; in the fused q/k/v bias some of the others are
            # quiet too after 5 steps (50 of 96 in blocks.1 here), and the note then counts them
            assert noisy in row["max_param_dev_at"] and "true gradient ~0" in row["max_param_dev_note"], row
