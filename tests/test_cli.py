"""The `xbridge` command as a user drives it: outputs, files, exit codes and one-line errors."""

from __future__ import annotations

import json

import pytest

from helpers import PROGRAMS, run_cli

pytestmark = pytest.mark.cli
MLP = str(PROGRAMS / "mlp.py")


def test_run_json_and_run_file(tmp_path):
    proc = run_cli("run", MLP, "--backend", "eager-cpu", "--steps", "6", "--warmup", "2", "--format", "json",
                   "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    written = json.loads((tmp_path / "out" / "run.json").read_text())
    assert written["steps"] == result["steps"] and len(result["steps"]) == 6
    assert result["target"] == "eager-cpu" and result["program"] == "mlp"
    assert result["config"]["optimizer"]["kind"] == "SGD" and len(result["config_hash"]) == 16
    assert set(result["summary"]) >= {"compile_s", "step_time_median_s", "step_time_p10_s", "step_time_p90_s",
                                      "samples_per_s", "tokens_per_s", "first_loss", "final_loss",
                                      "recompiles_after_warmup"}
    assert result["summary"]["timed_steps"] == 4
    assert "torch" in result["versions"] and result["machine"]["cpu_count"] >= 1
    assert proc.stderr == ""                                   # no progress bar off a terminal / in json mode


def test_run_human_summary_and_overrides():
    proc = run_cli("run", MLP, "--steps", "4", "--precision", "bf16-mixed", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert "mlp on eager-cpu (bf16-mixed, 1 device(s)" in proc.stdout
    assert "recompiles after warm-up" in proc.stdout and "loss first -> final" in proc.stdout


def test_backends_table_and_json():
    proc = run_cli("backends", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    rows = {row["target"]: row for row in json.loads(proc.stdout)}
    assert rows["eager-cpu"]["available"] and rows["eager-cpu"]["devices"] == 1
    assert "torch" in rows["eager-cpu"]["versions"]
    assert set(rows) >= {"eager-cpu", "eager-cuda", "inductor-cpu", "xla-cpu", "xla-tpu", "jax-cpu", "jax-tpu"}
    assert all(row["reason"] for row in rows.values() if not row["available"])
    human = run_cli("backends")
    assert human.returncode == 0 and "eager-cpu" in human.stdout and "available" in human.stdout


def test_inspect_prints_plan_and_flops():
    proc = run_cli("inspect", str(PROGRAMS / "gpt.py"), "--devices", "8", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["plan"]["mesh"] == {"data": 8, "model": 1} and info["plan"]["total_params"] == 3_346_944
    assert info["flops_per_step"] > 6 * 3_000_000 * 16 * 256          # at least 6 * weights * tokens
    names = [p["name"] for p in info["plan"]["params"]]
    assert "blocks.0.q.weight" in names and "head.weight" in names
    tp = json.loads(run_cli("inspect", MLP, "--devices", "8", "--mesh", "data=-1,model=2", "--format", "json").stdout)
    fc1 = next(p for p in tp["plan"]["params"] if p["name"] == "fc1.weight")
    assert tp["plan"]["mesh"] == {"data": 4, "model": 2} and fc1["shard_shape"] == [128, 64]
    human = run_cli("inspect", MLP, "--devices", "1")
    assert human.returncode == 0
    for fragment in ("parameters: 85,002", "GFLOP", "sharding plan", "fc1.weight", "fc1\\.(weight|bias)"):
        assert fragment in human.stdout, fragment


@pytest.mark.parametrize("command", ["run", "backends", "inspect"])
def test_help_has_an_example(command):
    proc = run_cli(command, "--help")
    assert proc.returncode == 0 and "Example: xbridge " + command in proc.stdout


def test_debug_env_shows_the_traceback():
    proc = run_cli("run", "missing.py", env={"XBRIDGE_DEBUG": "1"})
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ProgramError" in proc.stderr
