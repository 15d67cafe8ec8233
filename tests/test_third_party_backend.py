"""A backend nobody here wrote into xbridge/: tests/fixtures/third_party/toy_xbridge_plugin.py, written from
docs/adding-a-backend.md alone and installed as its own distribution (a dist-info folder with an entry point on
PYTHONPATH), runs `xbridge run` with its own declared option, a compare variant and `xbridge parity`."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from helpers import PROGRAMS, ROOT, one_error_line, run_cli

pytestmark = [pytest.mark.cli, pytest.mark.slow]
MLP = str(PROGRAMS / "mlp.py")


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    shutil.copy(ROOT / "tests" / "fixtures" / "third_party" / "toy_xbridge_plugin.py", site)
    info = site / "toy_xbridge_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-xbridge-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[xbridge.backends]\ntoy = toy_xbridge_plugin:ToyBackend\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_listed_with_its_option(plugin_env):
    proc = run_cli("backends", "--format", "json", env=plugin_env)
    assert proc.returncode == 0, proc.stderr
    rows = {row["target"]: row for row in json.loads(proc.stdout)}
    assert rows["toy-cpu"]["available"], rows["toy-cpu"]
    helptext = run_cli("run", "--help", env=plugin_env).stdout
    assert "--update {optim|foreach|skewed-export} (toy only; default optim)" in helptext


def test_run_takes_its_declared_option_and_the_core_checks_it(plugin_env):
    proc = run_cli("run", MLP, "--backend", "toy-cpu", "--steps", "4", "--update", "foreach", "--format", "json",
                   env=plugin_env)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["target"] == "toy-cpu" and record["backend_options"] == {"update": "foreach"}
    assert len(record["steps"]) == 4 and record["steps"][-1]["loss"] < record["steps"][0]["loss"]
    assert record["summary"]["recompiles_after_warmup"] == 0          # Diagnostics' defaults
    assert record["device_kind"] == "toy CPU"                         # the one Diagnostics method it overrides
    bad = run_cli("run", MLP, "--backend", "toy-cpu", "--update", "fused", env=plugin_env)
    assert bad.returncode == 2
    assert "--update 'fused' is not a choice of target toy-cpu; use one of optim, foreach, skewed-export" \
        in one_error_line(bad)
    other = run_cli("run", MLP, "--backend", "eager-cpu", "--update", "optim", env=plugin_env)
    assert other.returncode == 2 and "target eager-cpu takes no --update" in one_error_line(other)


def test_a_capability_it_lacks_is_one_line(plugin_env, tmp_path):
    """No Probes: --trace-modules (what parity --bisect uses) is refused with one line naming the executable."""
    proc = run_cli("run", MLP, "--backend", "toy-cpu", "--steps", "2", "--trace-modules", str(tmp_path / "t.npz"),
                   env=plugin_env)
    assert proc.returncode == 1
    assert "ToyExecutable cannot record module outputs (--trace-modules, parity --bisect)" in one_error_line(proc)


def test_parity_of_both_variants_against_eager(plugin_env, tmp_path):
    proc = run_cli("parity", MLP, "--backends", "toy-cpu,toy-cpu:update=foreach", "--steps", "5", "--format", "json",
                   "--out", str(tmp_path), "--jobs", "2", env=plugin_env)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    rows = {row["target"]: row for row in record["targets"]}
    assert set(rows) == {"toy-cpu", "toy-cpu:update=foreach"}
    for row in rows.values():
        assert row["verdict"] == "pass" and row["max_loss_dev"] <= record["tolerance"]["loss_rtol"], row


def test_parity_catches_a_wrong_parameter_when_every_loss_matches(plugin_env, tmp_path):
    """The loss check alone would pass this backend: only the parameter comparison sees the skewed export, and the
    verdict names the parameter."""
    proc = run_cli("parity", MLP, "--backends", "toy-cpu:update=skewed-export", "--steps", "3", "--format", "json",
                   "--out", str(tmp_path), env=plugin_env)
    assert proc.returncode == 1, proc.stderr
    (row,) = json.loads(proc.stdout)["targets"]
    assert row["verdict"] == "FAIL" and row["first_failing_step"] is None and row["max_loss_dev"] < 1e-6, row
    assert row["max_param_dev_at"] == "out.bias" and row["max_param_dev"] > row["param_limit"], row
    assert row["noise_floor"]["within"] is False      # beyond the reference's own noise, measured (docs/parity.md)
    assert row["max_param_dev"] > 4 * row["noise_floor"]["params"]
