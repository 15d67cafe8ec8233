"""The `xbridge` command as a user drives it: outputs, files, exit codes and one-line errors."""

from __future__ import annotations

import json
import re

import pytest

from helpers import PROGRAMS, run_cli, xbridge_here

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
    proc = run_cli("run", MLP, "--steps", "4", "--precision", "bf16-mixed", "--seed", "3", "--matmul-dtypes")
    assert proc.returncode == 0, proc.stderr
    assert "mlp on eager-cpu (bf16-mixed, 1 device(s)" in proc.stdout
    assert "recompiles after warm-up" in proc.stdout and "loss first -> final" in proc.stdout
    assert re.search(r"matrix products by dtype \(forward\) +│ +bfloat16 x3 │", proc.stdout), proc.stdout


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
    """In this process (the command's entry point; the installed command itself: the tests above and below)."""
    proc = xbridge_here("inspect", str(PROGRAMS / "gpt.py"), "--devices", "8", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["plan"]["mesh"] == {"data": 8, "model": 1} and info["plan"]["total_params"] == 3_346_944
    assert info["flops_per_step"] > 6 * 3_000_000 * 16 * 256          # at least 6 * weights * tokens
    names = [p["name"] for p in info["plan"]["params"]]
    assert "blocks.0.q.weight" in names and "head.weight" in names
    tp = json.loads(xbridge_here("inspect", MLP, "--devices", "8", "--mesh", "data=-1,model=2", "--format", "json").stdout)
    fc1 = next(p for p in tp["plan"]["params"] if p["name"] == "fc1.weight")
    assert tp["plan"]["mesh"] == {"data": 4, "model": 2} and fc1["shard_shape"] == [128, 64]
    human = xbridge_here("inspect", MLP, "--devices", "1")
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


def test_a_program_in_latin_1_under_a_folder_with_a_colon_runs(tmp_path):
    """A PEP 263 coding line is honoured as `python FILE` honours it, and a ':' in an existing path is part of
    the path (FILE.py:NAME is split only when the whole text is not a file)."""
    folder = tmp_path / "exp:1"
    folder.mkdir()
    source = (PROGRAMS / "mlp.py").read_text().replace('"""A multilayer', '"""Un r\u00e9seau: a multilayer', 1)
    (folder / "prog.py").write_bytes(b"# -*- coding: latin-1 -*-\n" + source.encode("latin-1"))
    for ref in (str(folder / "prog.py"), f"{folder / 'prog.py'}:program"):
        proc = run_cli("run", ref, "--steps", "2", "--format", "json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["program"] == "mlp"


@pytest.mark.slow   # an xla-cpu run
def test_a_program_imports_a_module_beside_it(tmp_path):
    """The program's folder is on sys.path, as it is for `python prog.py`: `from netdef import Net` works, here
    and in a target's own interpreter (xla-cpu runs in .venv-xla), whatever the current folder."""
    folder = tmp_path / "experiment"
    folder.mkdir()
    (folder / "netdef.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Sequential):\n"
        "    def __init__(self):\n        super().__init__(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))\n")
    (folder / "prog.py").write_text(
        "import torch.nn.functional as F\nimport xbridge as xb\nfrom netdef import Net\n\n"
        "program = xb.Program(name='beside', model=Net, data=xb.data.Digits(batch_size=32), optimizer=xb.SGD(lr=0.1),\n"
        "                     loss=lambda model, batch: F.cross_entropy(model(batch['x']), batch['y']))\n")
    losses = {}
    for target in ("eager-cpu", "xla-cpu"):
        proc = run_cli("run", str(folder / "prog.py"), "--backend", target, "--steps", "3", "--format", "json",
                       cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        losses[target] = [s["loss"] for s in json.loads(proc.stdout)["steps"]]
    assert losses["xla-cpu"] == pytest.approx(losses["eager-cpu"], rel=1e-5)


@pytest.mark.parametrize("failure,line", [
    (OSError(28, "No space left on device", "/data/out/run.json"),
     "error: No space left on device on '/data/out/run.json' (errno 28); free the resource or choose another path "
     "(XBRIDGE_DEBUG=1 shows the traceback)"),
    (MemoryError(), "error: out of host memory (MemoryError); use a smaller model or batch, fewer --jobs, or a "
                    "machine with more memory"),
])
def test_an_environment_failure_is_one_line_and_exit_1(monkeypatch, capsys, failure, line):
    """Disk full or out of memory in the middle of a run: the resource named, exit 1 (the program is not at fault)."""
    from xbridge.cli import main
    from xbridge.run import loop

    def fails(*args, **kwargs):
        raise failure

    monkeypatch.setenv("XBRIDGE_DEBUG", "0")
    monkeypatch.setattr(loop, "run", fails)
    with pytest.raises(SystemExit) as exited:
        main(["run", MLP, "--steps", "2", "--format", "json"])
    assert exited.value.code == 1
    assert capsys.readouterr().err.strip() == line


def test_the_progress_bar_says_compiling_until_the_first_step_then_loss_and_throughput():
    import io

    from rich.console import Console

    from xbridge.cli.progress import progress_bar
    from xbridge.run.record import StepRecord

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=160)
    with progress_bar(True, total=3, label="mlp on jax-cpu", tokens_per_step=640, console=console) as tick:
        assert tick is not None
        tick(0, StepRecord(0, 2.3125, 0.5))
        tick(1, StepRecord(1, 2.25, 0.01))
    shown = screen.getvalue()
    assert "preparing and compiling (the first step)" in shown
    assert "loss 2.2500, 64,000 tokens/s" in shown and "2/3" in shown
    with progress_bar(False, total=3, label="x") as tick:      # --format json: nothing
        assert tick is None
