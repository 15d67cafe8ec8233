"""``--max-restarts N`` (xbridge/processes/supervisor.py, restarts.py): a job one of whose processes is killed
(SIGKILL, as a lost host: tests/fixtures/restart_fault.py, process 1 at step 6: a JAX process, an inductor rank) is
started again, every process, from its newest committed checkpoint, and ends as the uninterrupted run does, bit for
bit; the record holds each step once and the restart; after N restarts it stops with one line. Under torchrun,
torchrun's own ``--max-restarts`` restarts the ranks and xbridge resumes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FIXTURES, ROOT, error_line, run_cli, user_env
from xbridge import checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.cli]
FAULT = str(FIXTURES / "restart_fault.py")


def _run(tmp_path, name, fault, *extra, signal="SIGKILL"):
    temporary = tmp_path / f"{name}-tmp"       # the run's temporary folder (TMPDIR), to see what it leaves there
    temporary.mkdir()
    proc = run_cli("run", FAULT, "--backend", "jax-cpu", "--processes", "2", "--devices", "2", "--steps", "12",
                   "--checkpoint-dir", str(tmp_path / name), "--format", "json", *extra,
                   env={"XBRIDGE_TEST_FAULT": fault, "TMPDIR": str(temporary), "XBRIDGE_TEST_FAULT_SIGNAL": signal},
                   timeout=600)
    return proc


def test_sigterm_ends_a_run_as_ctrl_c_does(tmp_path):
    """SIGTERM (what Slurm, Kubernetes and TPU maintenance send before a kill) to a run of one process: without
    checkpoints, one line and exit 143; with them, the step in flight finishes, its checkpoint is written, exit 143,
    the directory's lock is given back, and ``--max-restarts`` (the job's supervisor) resumes from that checkpoint
    and ends as the uninterrupted run does."""
    common = ("run", FAULT, "--backend", "eager-cpu", "--steps", "12", "--format", "json")
    fault = {"XBRIDGE_TEST_FAULT_PROCESSES": "any", "XBRIDGE_TEST_FAULT_SIGNAL": "SIGTERM"}
    bare = run_cli(*common, env={**fault, "XBRIDGE_TEST_FAULT": "always"})
    assert bare.returncode == 143 and "Traceback" not in bare.stderr, bare.stderr[-3000:]
    assert error_line(bare) == "error: terminated by SIGTERM"
    ck = tmp_path / "ck"
    stopped = run_cli(*common, "--checkpoint-dir", str(ck), "--checkpoint-every", "4",
                      env={**fault, "XBRIDGE_TEST_FAULT": "always"})
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    line = error_line(stopped)
    assert line.startswith("error: terminated by SIGTERM after step ") and f"--resume {ck}" in line, line
    step = int(line.split("after step ")[1].split()[0])
    # the signal comes while step 6's rows are read (prefetched during step 5); the step it stops after depends on
    # when the main thread handles it (after the step in flight, later under load)
    assert 5 <= step <= 8 and [s for s, _ in checkpoint.list_checkpoints(ck)] == [4, step]
    whole = run_cli(*common, env={"XBRIDGE_TEST_FAULT": "off"})
    restarted = run_cli(*common, "--checkpoint-dir", str(tmp_path / "again"), "--checkpoint-every", "4",
                        "--max-restarts", "1", env={**fault, "XBRIDGE_TEST_FAULT": "once"})
    assert whole.returncode == 0 and restarted.returncode == 0, restarted.stderr[-3000:]
    got = json.loads(restarted.stdout)
    assert [s["loss"] for s in got["steps"]] == [s["loss"] for s in json.loads(whole.stdout)["steps"]]
    (restart,) = got["restarts"]
    assert restart["status"] == "was terminated by SIGTERM" and 5 <= restart["from_step"] <= 8, restart


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
    # Nothing left in the temporary folder but the killed attempt's logs, which the restart's line names; the
    # processes' own temporary files (process 1's scratch folder, torch's) are in there, not beside it.
    assert [p.name for p in (tmp_path / "whole-tmp").iterdir()] == []
    (kept,) = (tmp_path / "restarted-tmp").iterdir()
    assert kept.name.startswith("xbridge-processes-") and f"(its log: {kept / 'process1.log'})" in restarted.stderr
    assert any((kept / "tmp").glob("xbridge-process1-*")), sorted(p.name for p in (kept / "tmp").iterdir())
    # SIGTERM to process 1 (maintenance, Slurm, Kubernetes) instead: the processes agree to stop after the step in
    # flight, write its checkpoint and exit 143; the restart resumes from that checkpoint, nothing redone
    termed = _run(tmp_path, "termed", "once", "--checkpoint-every", "4", "--max-restarts", "1",
                  signal="SIGTERM")
    assert termed.returncode == 0, termed.stderr[-3000:]
    got = json.loads(termed.stdout)
    assert [s["loss"] for s in got["steps"]] == [s["loss"] for s in want["steps"]]      # bit for bit
    (restart,) = got["restarts"]
    assert restart["status"] == "was terminated by SIGTERM" and restart["process"] is None, restart
    assert 5 <= restart["from_step"] <= 8 and restart["steps_redone"] == 0, restart
    assert f"terminated by SIGTERM after step {restart['from_step']} of 12" in termed.stderr, termed.stderr[-3000:]


@pytest.mark.extended
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


def test_a_killed_inductor_rank_restarts_the_job_from_its_checkpoint_bit_for_bit(tmp_path):
    """Inductor's rank 1 killed at step 6: restarted by xbridge's supervisor (the ranks xbridge starts, one
    supervised process), and by torchrun's own agent (torchrun --max-restarts, every rank resuming from the newest
    checkpoint); both end as the uninterrupted run, bit for bit, their records holding each step once."""
    common = ["run", FAULT, "--backend", "inductor-cpu", "--devices", "2", "--steps", "12", "--checkpoint-every",
              "4", "--format", "json"]
    whole = run_cli(*common, "--checkpoint-dir", str(tmp_path / "whole"), env={"XBRIDGE_TEST_FAULT": "off"})
    assert whole.returncode == 0, whole.stderr[-3000:]
    want = [s["loss"] for s in json.loads(whole.stdout)["steps"]]
    spawned = run_cli(*common, "--checkpoint-dir", str(tmp_path / "spawned"), "--max-restarts", "1",
                      env={"XBRIDGE_TEST_FAULT": "once"})
    assert spawned.returncode == 0, spawned.stderr[-3000:]
    assert ("inductor rank 1 was killed by SIGKILL" in spawned.stderr
            and "restarting the job from checkpoint " in spawned.stderr), spawned.stderr[-3000:]
    got = json.loads(spawned.stdout)
    assert [s["step"] for s in got["steps"]] == list(range(12)) and [s["loss"] for s in got["steps"]] == want
    (restart,) = got["restarts"]
    assert (restart["process"], restart["status"], restart["from_step"]) == (1, "was killed by SIGKILL", 4)
    assert Path(restart["message"].rpartition("its log: ")[2]).exists(), restart      # kept: the record names it
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               "2", "--max-restarts", "1", "-m", "xbridge", *common, "--checkpoint-dir",
                               str(tmp_path / "torchrun")], capture_output=True, text=True, cwd=ROOT, timeout=600,
                              env={**user_env(), "XBRIDGE_DEBUG": "0", "XBRIDGE_TEST_FAULT": "once"})
    assert torchrun.returncode == 0, torchrun.stderr[-3000:]
    assert "xbridge: torchrun restarted the job (1 time(s)); every rank resumes from checkpoint " \
        in torchrun.stderr, torchrun.stderr[-3000:]
    got = json.loads(torchrun.stdout)
    assert [s["step"] for s in got["steps"]] == list(range(12)) and [s["loss"] for s in got["steps"]] == want
    (restart,) = got["restarts"]
    assert restart["from_step"] == 4 and 1 <= restart["steps_redone"] <= 2 and restart["after_s"] > 0
    assert got["resumed_from"].endswith("step-00000004")


def test_max_restarts_refused_where_a_launcher_started_the_process():
    """A cluster's launcher or torchrun started this process: their own restarts apply, not xbridge's."""
    proc = run_cli("run", FAULT, "--backend", "jax-cpu", "--steps", "2", "--max-restarts", "1", "--processes",
                   "cluster")
    assert proc.returncode == 2
    assert error_line(proc).endswith("--max-restarts restarts the processes xbridge starts here; the cluster's "
                                     "launcher started this one: its own restarts apply (torchrun --max-restarts; "
                                     "docs/multi-process.md)")
    proc = run_cli("run", FAULT, "--backend", "inductor-cpu", "--steps", "2", "--max-restarts", "1",
                   env={"RANK": "0", "WORLD_SIZE": "1"})
    assert proc.returncode == 2
    assert "; torchrun started this one: its own restarts apply" in error_line(proc)


def test_a_restart_resumes_in_place_of_what_conflicts_with_a_checkpoint(tmp_path):
    """The starting weights, the profiled steps and a resume of the command's own give way to the checkpoint; a
    step record cut short by the kill ends its line."""
    from xbridge.processes.restarts import end_line
    from xbridge.processes.supervisor import _failure, _resuming, _value

    argv = ["run", "p.py", "--init-state", "w.npz", "--profile=steps=2:4", "--resume", "old", "--steps", "12"]
    assert _resuming(argv, tmp_path / "ckpt") == ["run", "p.py", "--steps", "12", "--resume", str(tmp_path / "ckpt")]
    assert _value(argv, "--resume") == "old" and _value(["--resume=a", "--resume", "b"], "--resume") == "b"
    log = tmp_path / "steps.jsonl"
    log.write_text('{"step": 0, "loss": 1.0, "time_s": 1.0}\n{"step": 1, "lo')
    end_line(log)
    log.write_text(log.read_text() + '{"step": 1, "loss": 2.0, "time_s": 1.0}\n')
    from xbridge.processes.restarts import logged_steps

    assert [(r["step"], r["loss"]) for r in logged_steps(str(log))] == [(0, 1.0), (1, 2.0)]
    assert _failure("process 1 of 2 was killed by SIGKILL (its log: x)") == (1, "was killed by SIGKILL")
    assert _failure("inductor rank 1 exited with code 1 during step_at; its log: x") == (1, "exited with code 1")
    assert _failure("RunError: the loss is NaN") == (0, None)
