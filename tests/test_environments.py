"""Targets in the environment that has their framework (xbridge/environments.py): make setup's .venv (Python 3.12,
torch 2.14.1, jax 0.12) and .venv-xla (Python 3.11, torch 2.9.0 and torch_xla 2.9.0), registered as ``xla``. From
.venv, an xla target runs in .venv-xla's interpreter; TARGET@NAME picks an environment; every record names the
frameworks each row ran on; the same target in two environments is a pair in compare (speed ratio, parity)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import FIXTURES, PROGRAMS, ROOT, one_error_line, run_cli, xbridge_here

MLP = str(PROGRAMS / "mlp.py")
XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"
TODAY = "2.14.1"        # .venv's torch (scripts/pins.txt: pip's cap on this machine)
OLD = "2.9.0"           # .venv-xla's (torch_xla 2.9.0's)


def _torch(versions: dict[str, str]) -> str:
    return versions["torch"].split("+", 1)[0]


def test_the_environments_are_listed_with_their_frameworks_and_targets():
    proc = xbridge_here("environments", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    here, xla = rows["here"], rows["xla"]
    assert here["python"] == sys.executable and here["python_version"].startswith("3.12")
    assert "torch_xla" not in here["frameworks"] and {"eager-cpu", "inductor-cpu", "jax-cpu"} <= set(here["targets"])
    assert _torch(here["frameworks"]) == TODAY and here["frameworks"]["jax"].startswith("0.12.")
    assert xla["python_version"].startswith("3.11") and xla["frameworks"]["torch_xla"] == "2.9.0"
    assert _torch(xla["frameworks"]) == OLD and {"eager-cpu", "inductor-cpu", "xla-cpu"} <= set(xla["targets"])
    assert "xla-cpu" not in here["targets"]


def test_backends_names_where_each_target_runs():
    rows = {row["target"]: row for row in json.loads(xbridge_here("backends", "--format", "json").stdout)}
    assert rows["xla-cpu"]["available"] and rows["xla-cpu"]["environment"] == "xla"
    assert rows["jax-cpu"]["environment"] == "here" and rows["eager-cpu"]["environment"] == "here"
    assert rows["inductor-cpu@xla"]["available"] and _torch(rows["inductor-cpu@xla"]["versions"]) == OLD
    assert rows["xla-cuda"]["reason"].startswith("torch_xla 2.9 has no CUDA support")   # the reason from .venv-xla


@pytest.mark.slow
def test_an_xla_run_from_here_runs_in_its_environment_and_says_so():
    proc = run_cli("run", MLP, "--backend", "xla-cpu", "--steps", "2", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    assert record["target"] == "xla-cpu" and record["versions"]["torch_xla"] == "2.9.0"
    assert _torch(record["versions"]) == "2.9.0"
    old = run_cli("run", MLP, "--backend", "eager-cpu@xla", "--steps", "2", "--format", "json")
    assert old.returncode == 0, old.stderr[-2000:]
    assert _torch(json.loads(old.stdout)["versions"]) == OLD


@pytest.mark.slow
def test_compare_pairs_a_target_across_environments(tmp_path):
    """eager-cpu here (torch 2.14.1, Python 3.12) and eager-cpu@xla (torch 2.9.0, Python 3.11): the pair's speed
    ratio and parity. The program reads the Python standard library's text, which differs between the two Pythons:
    both read this interpreter's, from the weights this interpreter initialised (initial_weights.npz)."""
    out = tmp_path / "cmp"
    layered = str(FIXTURES / "layered.py")
    proc = run_cli("compare", layered, "--backends", "eager-cpu@xla", "--steps", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((out / "results.json").read_text())
    rows = {row["target"]: row for row in record["targets"]}
    assert set(rows) == {"eager-cpu", "eager-cpu@xla"}
    assert _torch(rows["eager-cpu@xla"]["result"]["versions"]) == OLD
    assert record["shared_init"] == {"eager-cpu": "here", "eager-cpu@xla": "xla"}
    assert (out / "initial_weights.npz").is_file()
    assert "initial weights: this interpreter's, for every target" in proc.stdout
    [pair] = record["version_pairs"]
    assert pair["baseline"] == "eager-cpu" and pair["other"] == "eager-cpu@xla" and pair["target"] == "eager-cpu"
    assert pair["changed"]["torch"][0].startswith(TODAY) and pair["changed"]["torch"][1].startswith(OLD)
    steps = rows["eager-cpu@xla"]["metrics"]["step_ms_median"] / rows["eager-cpu"]["metrics"]["step_ms_median"]
    assert pair["step_ratio"] == pytest.approx(steps)
    losses = [rows[t]["losses"] for t in ("eager-cpu", "eager-cpu@xla")]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)     # the same batches and weights, two torches
    assert pair["matches"] and pair["max_loss_dev"] <= pair["loss_limit"]
    assert "eager-cpu@xla against eager-cpu (torch " in proc.stdout and "losses match" in proc.stdout
    assert "--init-state" not in record["recommendation"]["command"]
    report = (out / "report.md").read_text()
    assert "The same target in two environments" in report and "- eager-cpu@xla: " in report
    assert "every target started from the weights of the interpreter that ran the compare" in report


@pytest.mark.slow
def test_parity_and_check_reach_xla_from_here(tmp_path):
    proc = run_cli("parity", MLP, "--backends", "xla-cpu", "--steps", "3", "--format", "json", "--out",
                   str(tmp_path / "p"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    [row] = record["targets"]
    assert row["verdict"] == "pass" and row["versions"]["torch_xla"] == "2.9.0"
    assert "torch_xla" not in record["reference"]["versions"] and "torch" in record["reference"]["versions"]
    human = run_cli("parity", MLP, "--backends", "xla-cpu", "--steps", "3", "--out", str(tmp_path / "h"))
    assert "frameworks" in human.stdout and "torch_xla 2.9.0" in human.stdout
    check = json.loads(xbridge_here("check", str(FIXTURES / "bad_programs.py") + ":complex_fft", "--backends",
                                    "eager-cpu,xla-cpu", "--format", "json").stdout)
    verdicts = {row["target"]: row for row in check["targets"]}
    assert verdicts["eager-cpu"]["verdict"] == "runs"
    assert verdicts["xla-cpu"]["verdict"] == "fails" and "torch_xla has no XLA kernel" in verdicts["xla-cpu"]["summary"]


def test_environment_names_and_interpreters_are_checked(tmp_path):
    listing = tmp_path / "environments.json"
    env = {"XBRIDGE_ENVIRONMENTS_FILE": str(listing)}
    proc = xbridge_here("environments", "add", "here", str(XLA_PYTHON), env=env)
    assert proc.returncode == 2 and "environment name 'here'" in one_error_line(proc)
    proc = xbridge_here("environments", "add", "old", str(tmp_path / "nope" / "python"), env=env)
    assert proc.returncode == 1 and "does not exist or is not executable" in one_error_line(proc)
    bare = Path(sys.base_prefix) / "bin" / "python3"      # an interpreter without xbridge
    proc = xbridge_here("environments", "add", "bare", str(bare), env=env)
    assert proc.returncode == 1 and f"environment 'bare' ({bare}) has no working xbridge" in one_error_line(proc)
    assert not listing.exists()                         # nothing written for a refused environment
    proc = xbridge_here("environments", "add", "torch29", str(XLA_PYTHON), "--format", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(listing.read_text()) == {"environments": {"torch29": str(XLA_PYTHON)}}
    assert {row["name"] for row in json.loads(proc.stdout)} == {"here", "torch29"}
    proc = xbridge_here("run", MLP, "--backend", "eager-cpu@nowhere", env=env)
    assert proc.returncode == 2 and one_error_line(proc).startswith(
        "error: environment 'nowhere' is not known (known: torch29)")
    proc = xbridge_here("environments", "remove", "torch29", env=env)
    assert proc.returncode == 0 and json.loads(listing.read_text()) == {"environments": {}}
    proc = xbridge_here("run", MLP, "--backend", "xla-cpu", env={**env, "XBRIDGE_ENVIRONMENTS": "broken"})
    assert proc.returncode == 2 and "XBRIDGE_ENVIRONMENTS: 'broken' is not NAME=PYTHON" in one_error_line(proc)
    missing = str(tmp_path / "gone" / "python")
    proc = xbridge_here("run", MLP, "--backend", "xla-cpu", env={**env, "XBRIDGE_ENVIRONMENTS": f"gone={missing}"})
    assert proc.returncode == 1
    assert one_error_line(proc) == (f"error: environment 'gone': its interpreter {missing} does not exist or is not "
                                    "executable (xbridge environments remove gone, or add it again)")
