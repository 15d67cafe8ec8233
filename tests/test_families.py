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
