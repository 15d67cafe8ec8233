"""``--max-restarts N`` (xbridge/processes/supervisor.py, restarts.py): a job one of whose processes is killed
(SIGKILL, as a lost host: tests/fixtures/restart_fault.py, process 1 at step 6) is started again, every process,
from its newest committed checkpoint, and ends as the uninterrupted run does, bit for bit; the record holds each
step once and the restart; after N restarts it stops with one line."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES, error_line, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.cli]
FAULT = str(FIXTURES / "restart_fault.py")


def _run(tmp_path, name, fault, *extra):
    proc = run_cli("run", FAULT, "--backend", "jax-cpu", "--processes", "2", "--devices", "2", "--steps", "12",
                   "--checkpoint-dir", str(tmp_path / name), "--format", "json", *extra,
                   env={"XBRIDGE_TEST_FAULT": fault}, timeout=600)
    return proc


def test_a_killed_process_restarts_the_job_from_its_checkpoint_bit_for_bit(tmp_path):
    whole = _run(tmp_path, "whole", "off", "--checkpoint-every", "4")
    assert whole.returncode == 0, whole.stderr[-3000:]
    restarted = _run(tmp_path, "restarted", "once", "--checkpoint-every", "4", "--max-restarts", "1")
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert ("process 1 of 2 was killed by SIGKILL" in restarted.stderr
            and "restarting all 2 processes from checkpoint " in restarted.stderr
            and "step-00000004 (restart 1 of 1)" in restarted.stderr), restarted.stderr[-3000:]
    want, got = json.loads(whole.stdout), json.loads(restarted.stdout)
    assert [s["step"] for s in got["steps"]] == list(range(12)) and got["start_step"] == 0
    assert [s["loss"] for s in got["steps"]] == [s["loss"] for s in want["steps"]]      # bit for bit
    (restart,) = got["restarts"]
    assert restart["process"] == 1 and restart["status"] == "was killed by SIGKILL" and restart["from_step"] == 4
    assert 1 <= restart["steps_redone"] <= 2 and restart["after_s"] > 0     # step 6 is fetched while step 5 runs
    assert got["resumed_from"].endswith("step-00000004") and want["restarts"] == []


def test_a_process_killed_before_any_checkpoint_restarts_from_step_0(tmp_path):
    proc = _run(tmp_path, "early", "once", "--checkpoint-every", "8", "--max-restarts", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "from step 0 (no checkpoint yet) (restart 1 of 2)" in proc.stderr, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    assert [s["step"] for s in record["steps"]] == list(range(12)) and record["resumed_from"] is None
    assert [(r["from_step"], r["process"]) for r in record["restarts"]] == [(0, 1)]


def test_after_the_restarts_it_allows_the_job_stops_with_one_line(tmp_path):
    proc = _run(tmp_path, "always", "always", "--checkpoint-every", "4", "--max-restarts", "1")
    assert proc.returncode == 1
    line = error_line(proc)
    assert line.startswith("error: process 1 of 2 was killed by SIGKILL (its log: "), line
    assert line.endswith("(after 1 restart(s), the most --max-restarts 1 allows)"), line


def test_max_restarts_needs_processes_it_starts():
    proc = run_cli("run", FAULT, "--backend", "jax-cpu", "--steps", "2", "--max-restarts", "1")
    assert proc.returncode == 2
    assert "--max-restarts restarts the processes xbridge starts here: give --processes P" in error_line(proc)


@pytest.mark.parametrize("flags", [["--processes", "cluster"], ["--processes", "1"]])
def test_max_restarts_refused_where_xbridge_starts_no_process(flags):
    proc = run_cli("run", FAULT, "--backend", "jax-cpu", "--steps", "2", "--max-restarts", "1", *flags)
    assert proc.returncode == 2
    assert "a cluster's own launcher restarts the processes it starts" in error_line(proc)


def test_a_restart_resumes_in_place_of_what_conflicts_with_a_checkpoint(tmp_path):
    """The starting weights, the profiled steps and a resume of the command's own give way to the checkpoint; a
    step record cut short by the kill ends its line."""
    from xbridge.processes.supervisor import _end_line, _resuming, _value

    argv = ["run", "p.py", "--init-state", "w.npz", "--profile=steps=2:4", "--resume", "old", "--steps", "12"]
    assert _resuming(argv, tmp_path / "ckpt") == ["run", "p.py", "--steps", "12", "--resume", str(tmp_path / "ckpt")]
    assert _value(argv, "--resume") == "old" and _value(["--resume=a", "--resume", "b"], "--resume") == "b"
    log = tmp_path / "steps.jsonl"
    log.write_text('{"step": 0, "loss": 1.0, "time_s": 1.0}\n{"step": 1, "lo')
    _end_line(log)
    log.write_text(log.read_text() + '{"step": 1, "loss": 2.0, "time_s": 1.0}\n')
    from xbridge.processes.restarts import logged_steps

    assert [(r["step"], r["loss"]) for r in logged_steps(str(log))] == [(0, 1.0), (1, 2.0)]
