"""Host state a forward reads (tests/fixtures/host_state.py; xbridge/torch/host_state.py), and how often xbridge
calls the loss (xbridge/forked.py).

Until 2026-12-07: check said "runs" on every target for all of these; jax baked the first draw or value into the
compiled step and trained another program without a word; Inductor handed a float drawn from Python's `random` to
the step as ~1e36 (pytorch/pytorch#198187); and every run called the loss twice on the meta device before step 0,
so a loss that counts its calls saw step 0 as its third call."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from helpers import FIXTURES, assert_check_agrees, error_line, run_cli

HOST = str(FIXTURES / "host_state.py")


def _verdicts(name: str) -> tuple[dict[str, str], dict[str, list[dict]]]:
    from xbridge.check.job import CheckOptions, check
    from xbridge.program_file import load_program

    record = check(load_program(f"{HOST}:{name}"), CheckOptions(targets=["eager-cpu", "inductor-cpu", "jax-cpu"]))
    rows = record.targets
    return ({row.target: row.verdict for row in rows},
            {row.target: [vars(f) for f in row.findings if not f.operator] for row in rows})


@pytest.mark.parametrize(("name", "expected", "line", "what"), [
    ("plain", {"eager-cpu": "runs", "inductor-cpu": "runs", "jax-cpu": "runs"}, None, None),
    ("counter", {"eager-cpu": "runs", "inductor-cpu": "runs", "jax-cpu": "fails"}, 50,
     r"a Python value that changes from call to call \((\d+), then (?!\1)\d+, in aten::add\.Tensor\)"),
    ("numpy_noise", {"eager-cpu": "runs", "inductor-cpu": "runs", "jax-cpu": "fails"}, 37,
     r"a draw from numpy's global generator \(np\.random\)"),
    ("python_noise", {"eager-cpu": "runs", "inductor-cpu": "fails", "jax-cpu": "fails"}, 39,
     r"a draw from Python's global generator \(random\)"),
    ("lazy_table", {"eager-cpu": "runs", "inductor-cpu": "runs", "jax-cpu": "fails"}, None,
     "a tensor the forward keeps on its module"),
    ("temperature", {"eager-cpu": "runs", "inductor-cpu": "differs", "jax-cpu": "fails"}, 54,
     r"a Python value that changes from call to call \(1\.0, then 1\.5, in aten::div\.Tensor\) after the data "
     r"source read the next batch"),
])
def test_check_finds_host_state_with_its_line(name, expected, line, what):
    verdicts, findings = _verdicts(name)
    assert verdicts == expected
    if what is None:
        assert not any(findings.values()), findings
        return
    if line is None:        # a tensor kept on the module (a table built at the first call): jax alone
        assert findings["inductor-cpu"] == [] and [(f["severity"], f["what"], f["where"]) for f in findings[
            "jax-cpu"]] == [("fails", what, "model.table")]
        return
    for target in ("inductor-cpu", "jax-cpu"):
        found = [f for f in findings[target] if re.fullmatch(what, f["what"])]
        if expected[target] == "runs" and name != "numpy_noise":     # (numpy's draws: a note, seeded)
            assert not found, findings[target]
            continue
        assert found and found[0]["where"].endswith(f"host_state.py:{line}"), findings[target]
        assert found[0]["severity"] == ("note" if expected[target] == "runs" else expected[target])


@pytest.mark.parametrize(("name", "target", "says"), [
    ("counter", "jax-cpu", "host_state.py:50: JAX traces the step once"),
    ("numpy_noise", "jax-cpu", "a draw from numpy's global generator (np.random) in "),
    ("python_noise", "inductor-cpu", "pytorch/pytorch#198187"),
    ("lazy_table", "jax-cpu", "a tensor the forward keeps on its module in model.table: JAX traces the forward more "
                              "than once"),
])
def test_a_run_refuses_host_state_its_stack_would_bake_or_garble(tmp_path, name, target, says):
    proc = run_cli("run", f"{HOST}:{name}", "--backend", target, "--steps", "2", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert says in error_line(proc) and f"cannot run on {target}" in error_line(proc)
    assert not (tmp_path / "out" / "run.json").exists()


@pytest.mark.slow
def test_the_loss_is_called_once_per_step_and_check_agrees_with_parity(tmp_path):
    """counted_loss adds its call count to the loss: step s must be call s on the reference and on Inductor (the
    checks before step 0 run in a forked child; before: the reference's losses were cross-entropy + 2, 3, 4); jax
    refuses it. numpy's global generator in the forward, seeded before step 0, draws eager's numbers on Inductor.
    check said so of each before. (A global the data source sets is left out: which step's value a forward sees
    is a race with the loading thread, on every stack.)"""
    proc = run_cli("parity", f"{HOST}:counter", "--backends", "inductor-cpu,jax-cpu", "--steps", "3",
                   "--out", str(tmp_path / "parity"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    record = json.loads((tmp_path / "parity" / "parity.json").read_text())
    losses = np.array(record["reference"]["losses"]) - np.arange(3)
    assert np.all((losses > 1.0) & (losses < 3.0)), record["reference"]["losses"]   # cross-entropy of 10 classes
    assert [row["verdict"] for row in record["targets"]] == ["pass", "error"]
    assert_check_agrees(f"{HOST}:counter", record)
    proc = run_cli("parity", f"{HOST}:numpy_noise", "--backends", "inductor-cpu", "--steps", "3",
                   "--out", str(tmp_path / "numpy"))
    record = json.loads((tmp_path / "numpy" / "parity.json").read_text())
    assert [row["verdict"] for row in record["targets"]] == ["pass"] and proc.returncode == 0
    assert_check_agrees(f"{HOST}:numpy_noise", record)


def test_a_user_error_in_the_loss_is_still_named_from_the_forked_check(tmp_path):
    """The meta check raises the user's own KeyError in the child; the parent prints the same line it did."""
    prog = tmp_path / "bad_key.py"
    prog.write_text((FIXTURES / "host_state.py").read_text().replace('batch["y"])\n\n\ndef counted',
                                                                     'batch["label"])\n\n\ndef counted'))
    proc = run_cli("run", str(prog), "--backend", "eager-cpu", "--steps", "1", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert error_line(proc).startswith("error: KeyError: 'label' raised in the program's loss at ") and \
        "bad_key.py:44 (in loss)" in error_line(proc)
