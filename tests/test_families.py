"""Programs beyond the zoo (tests/fixtures/families.py): a loss whose shape the data decides is refused with one line
naming its file and line on the stacks that compile the step as one static graph, before the step computes."""

from __future__ import annotations

import pytest

from helpers import FIXTURES, error_line, run_cli

MASKED = f"{FIXTURES / 'families.py'}:masked"


@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.parametrize("target,says", [
    ("jax-cpu", "computes a shape or a Python value from tensor data (NonConcreteBooleanIndexError"),
    ("xla-cpu", "needs a value computed inside the step on the host at "),
])
def test_boolean_indexing_in_the_loss_is_one_line_where_the_step_is_one_graph(target, says):
    proc = run_cli("run", MASKED, "--backend", target, "--steps", "2")
    assert proc.returncode == 1, proc.stderr
    line = error_line(proc)
    assert says in line and "masked-mlp" in line, line
    if target == "xla-cpu":
        assert "families.py:" in line and "(in masked_loss, the program's loss)" in line, line
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
    one-graph step refuses ("Unexpected execution happens inside the compiled function"); the line used to blame a
    data-dependent shape. It names the operator and the line (jax and eager train it: the same losses, by hand)."""
    proc = run_cli("run", f"{FIXTURES / 'bad_programs.py'}:complex_fft", "--backend", "xla-cpu", "--steps", "2")
    assert proc.returncode == 1, proc.stderr
    line = error_line(proc)
    assert "program 'complex-fft' calls aten::_fft_c2c at " in line and "bad_programs.py:" in line, line
    assert "which torch_xla 2.9.0 has no XLA kernel for (it falls back to the CPU)" in line, line
