"""Checkpoints: the format, bit-exact resume, cross-backend and cross-mesh resume, crash safety under SIGKILL,
Ctrl-C, and a non-finite loss."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import xbridge as xb
from helpers import PROGRAMS, ROOT, one_error_line, run_cli, user_env
from xbridge import checkpoint
from xbridge.errors import CheckpointError, RunError
from xbridge.files import read_npz
from xbridge.parity import policy as parity
from xbridge.run.loop import RunOptions, run

MLP = str(PROGRAMS / "mlp.py")
DIVERGES = str(ROOT / "tests" / "fixtures" / "diverges.py")


def losses(result):
    return result.losses if hasattr(result, "losses") else [s["loss"] for s in result["steps"]]


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_format_is_safetensors_and_a_manifest(tmp_path, mlp_program):
    result = run(mlp_program, "eager-cpu", RunOptions(steps=5, warmup=1, checkpoint_dir=tmp_path / "ck",
                                                      checkpoint_every=2, keep=2))
    # every 2 steps and at the end; --keep 2 leaves the newest two
    assert result.checkpoints == [str(tmp_path / "ck" / f"step-{s:08d}") for s in (2, 4, 5)]
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path / "ck")] == [4, 5]
    path = tmp_path / "ck" / "step-00000005"
    assert sorted(p.name for p in path.iterdir()) == ["COMMIT", "manifest.json", "model.safetensors",
                                                      "train.safetensors"]
    assert (path / "COMMIT").read_text() == f"sha256 {sha(path / 'manifest.json')}\n"    # written last
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "xbridge-checkpoint" and manifest["step"] == 5
    assert manifest["data"] == {"next_batch": 5, "seed": 0, "batch_size": 64}
    assert manifest["config_hash"] == mlp_program.config_hash and manifest["precision"] == "fp32"
    assert manifest["target"] == "eager-cpu" and "torch" in manifest["versions"]
    assert manifest["rng"] == ["rng/torch_cpu"]
    for name in ("model.safetensors", "train.safetensors"):
        assert manifest["files"][name] == {"bytes": (path / name).stat().st_size, "sha256": sha(path / name)}
        # safetensors: an 8-byte little-endian header length, a JSON header, raw bytes; nothing to unpickle
        data = (path / name).read_bytes()
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        assert set(header) - {"__metadata__"} == set(manifest["tensors"][name])
    loaded = checkpoint.load(path, mlp_program)
    assert set(loaded.weights) == set(manifest["tensors"]["model.safetensors"]) and loaded.step == 5
    assert sorted(loaded.train) == ["loop/updates", *sorted(f"optim/{n}/momentum_buffer" for n in (
        "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "out.bias", "out.weight")), "rng/torch_cpu"]
    assert int(loaded.train["loop/updates"]) == 5
    assert not list(tmp_path.joinpath("ck").glob(".tmp-*"))


@pytest.mark.parametrize("target,which,devices,precision", [
    ("eager-cpu", "mlp", 1, "fp32"), ("eager-cpu", "gpt", 1, "fp32"), ("jax-cpu", "gpt", 4, "fp32"),
    ("eager-cpu", "gpt", 1, "bf16-true"), ("jax-cpu", "mlp", 1, "fp16-mixed"), ("inductor-cpu", "mlp", 1, "fp32"),
    ("inductor-cpu", "mlp", 1, "fp16-mixed"),
    pytest.param("inductor-cpu", "gpt", 1, "bf16-true", marks=pytest.mark.extended)])
def test_resume_is_bit_exact_on_the_same_backend(tmp_path, target, which, devices, precision, mlp_program, tiny_gpt):
    """bf16 parameters and Adam state go through float32 in the file and back; fp16 carries the loss scale."""
    program = {"mlp": mlp_program, "gpt": tiny_gpt}[which].replace(precision=precision)
    common = dict(warmup=1, devices=devices)
    full = run(program, target, RunOptions(steps=8, state_out=tmp_path / "full.npz", **common))
    first = run(program, target, RunOptions(steps=5, checkpoint_dir=tmp_path / "ck", checkpoint_every=3, **common))
    rest = run(program, target, RunOptions(steps=8, resume=tmp_path / "ck", state_out=tmp_path / "rest.npz",
                                           **common))
    assert rest.start_step == 5 and rest.resumed_from == str(tmp_path / "ck" / "step-00000005")
    assert [s.step for s in rest.steps] == [5, 6, 7]
    assert losses(first) + losses(rest) == losses(full)          # bit for bit
    a, b = read_npz(tmp_path / "full.npz", "full"), read_npz(tmp_path / "rest.npz", "rest")
    assert all(np.array_equal(a[n], b[n]) for n in a)


@pytest.mark.slow   # subprocesses: torch_xla runs in its own process, as users run it
def test_resume_is_bit_exact_on_xla(tmp_path):
    common = ("--backend", "xla-cpu", "--devices", "2", "--mesh", "data=-1,model=2", "--warmup", "1", "--format",
              "json")
    full = run_cli("run", MLP, "--steps", "6", "--save-state", str(tmp_path / "full.npz"), *common)
    first = run_cli("run", MLP, "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck"), *common)
    rest = run_cli("run", MLP, "--steps", "6", "--resume", str(tmp_path / "ck"), "--save-state",
                   str(tmp_path / "rest.npz"), *common)
    for proc in (full, first, rest):
        assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(p.stdout) for p in (full, first, rest)]
    assert losses(records[1]) + losses(records[2]) == losses(records[0])       # bit for bit
    a, b = read_npz(tmp_path / "full.npz", "full"), read_npz(tmp_path / "rest.npz", "rest")
    assert all(np.array_equal(a[n], b[n]) for n in a)


def _within_policy(resumed, reference, program, state=None, reference_state=None):
    """Losses (and, given, final parameters) of a run resumed on another backend against an uninterrupted one."""
    tol = parity.tolerance(program.precision)
    ref = reference[-len(resumed):]
    deviation = max(abs(x - y) / abs(y) for x, y in zip(resumed, ref))
    assert deviation <= tol.loss_rtol, (deviation, resumed, ref)
    if state is not None:
        params = parity.param_deviation(reference_state, state, tol)
        assert params.ok, params


def test_adamw_state_crosses_from_eager_to_jax_on_another_mesh(tmp_path, tiny_gpt):
    """Written unsharded by eager, resumed by jax with the weights and Adam state sharded over model=2."""
    reference = losses(run(tiny_gpt, "eager-cpu", RunOptions(steps=8, warmup=1, state_out=tmp_path / "ref.npz")))
    run(tiny_gpt, "eager-cpu", RunOptions(steps=4, warmup=1, checkpoint_dir=tmp_path / "ck"))
    sharded = tiny_gpt.replace(mesh=xb.Mesh(data=-1, model=2))
    resumed = run(sharded, "jax-cpu", RunOptions(steps=8, warmup=1, devices=4, resume=tmp_path / "ck",
                                                  state_out=tmp_path / "out.npz"))
    _within_policy(losses(resumed), reference, tiny_gpt, read_npz(tmp_path / "out.npz", "out"),
                   read_npz(tmp_path / "ref.npz", "ref"))
    q = resumed.layout["blocks.0.q.weight"]
    # as the runtime reports it: jax writes PartitionSpec('model', None) up to 0.9.0 and P('model', None) since 0.9.1
    assert q["spec"] in ("PartitionSpec('model', None)", "P('model', None)") and q["shard_shapes"][0] == [16, 32]


@pytest.mark.slow   # subprocesses
@pytest.mark.parametrize("first,second", [
    (["inductor-cpu"], ["jax-cpu", "--devices", "4", "--mesh", "data=2,model=2"]),
    (["jax-cpu", "--devices", "2"], ["xla-cpu", "--devices", "4", "--mesh", "data=2,model=2"]),
])
def test_resume_on_another_backend_and_mesh(tmp_path, first, second, mlp_program):
    reference = losses(run(mlp_program, "eager-cpu", RunOptions(steps=8, warmup=1,
                                                                state_out=tmp_path / "ref.npz")))
    ck = str(tmp_path / "ck")
    written = run_cli("run", MLP, "--steps", "4", "--warmup", "1", "--checkpoint-dir", ck, "--format", "json",
                      "--backend", *first)
    assert written.returncode == 0, written.stderr
    resumed = run_cli("run", MLP, "--steps", "8", "--warmup", "1", "--resume", ck, "--format", "json",
                      "--save-state", str(tmp_path / "out.npz"), "--backend", *second)
    assert resumed.returncode == 0, resumed.stderr
    record = json.loads(resumed.stdout)
    assert record["start_step"] == 4 and record["config_changes"] == ["mesh"]
    _within_policy(losses(record), reference, mlp_program, read_npz(tmp_path / "out.npz", "out"),
                   read_npz(tmp_path / "ref.npz", "ref"))
    assert record["layout"]["fc1.weight"]["shard_shapes"][0] == [128, 64]        # resharded: model=2


KILL_PHASES = ["tmp-created", "model-half", "model-written", "train-half", "manifest-half", "before-rename",
               "renamed"]


@pytest.mark.slow   # subprocesses
@pytest.mark.parametrize("phase", KILL_PHASES)
def test_sigkill_during_a_save_leaves_a_loadable_checkpoint(tmp_path, phase, mlp_program):
    ck = tmp_path / "ck"
    args = ("run", MLP, "--steps", "6", "--checkpoint-every", "2", "--checkpoint-dir", str(ck))
    killed = subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "kill_during_save.py"), f"{phase}@2",
                             *args], capture_output=True, text=True, cwd=ROOT, timeout=600)   # the save of step 4
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    latest = checkpoint.locate(ck)
    expected = 4 if phase == "renamed" else 2
    assert checkpoint.load(latest, mlp_program).step == expected
    assert bool(list(ck.glob(".tmp-*"))) == (phase != "renamed")
    if phase == "model-half":   # and the run continues from it exactly
        resumed = run_cli("run", MLP, "--steps", "6", "--resume", str(ck), "--checkpoint-dir", str(ck),
                          "--checkpoint-every", "2", "--format", "json")
        assert resumed.returncode == 0, resumed.stderr
        full = run(mlp_program, "eager-cpu", RunOptions(steps=6, warmup=1))
        assert losses(json.loads(resumed.stdout)) == losses(full)[2:]
        assert not list(ck.glob(".tmp-*"))          # the next save removed what the killed one left


@pytest.mark.slow   # subprocesses
@pytest.mark.parametrize("target", ["eager-cpu", "jax-cpu", "inductor-cpu", "xla-cpu"])
def test_ctrl_c_writes_a_final_checkpoint_and_exits_cleanly(tmp_path, mlp_program, target):
    ck = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "-m", "xbridge", "run", MLP, "--backend", target, "--steps", "100000",
                             "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--keep", "2"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**user_env(), "XBRIDGE_DEBUG": "0"})
    try:
        deadline = time.monotonic() + 300
        while not any(step >= 3 for step, _ in checkpoint.list_checkpoints(ck)):   # --keep 2 prunes old ones
            assert proc.poll() is None and time.monotonic() < deadline, "no third checkpoint"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    error = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "interrupted after step " in error[0] and "--resume" in error[0], stderr
    step = int(error[0].split("interrupted after step ")[1].split()[0])
    assert step >= 3 and f"step-{step:08d}" in error[0]
    assert checkpoint.load(checkpoint.locate(ck), mlp_program).step == step


@pytest.mark.slow   # subprocesses
def test_nan_loss_names_the_step_and_gradient_and_keeps_the_last_good_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    proc = run_cli("run", DIVERGES, "--steps", "20", "--checkpoint-every", "1", "--checkpoint-dir", str(ck))
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert line.startswith("error: loss became nan at step 6 on eager-cpu; first non-finite gradient: "
                           "'fc1.weight' (6 parameter(s) in all); the last good checkpoint is "), line
    assert str(ck / "step-00000006") in line
    from xbridge.program_file import load_program

    good = checkpoint.load(ck / "step-00000006", load_program(DIVERGES))
    assert all(np.isfinite(a).all() for a in good.weights.values())
    assert [s for s, _ in checkpoint.list_checkpoints(ck)] == [4, 5, 6]


@pytest.mark.slow   # subprocesses
@pytest.mark.parametrize("target", ["jax-cpu", "inductor-cpu", "xla-cpu"])
def test_nan_loss_names_the_gradient_on_a_compiled_backend(target):
    proc = run_cli("run", DIVERGES, "--steps", "20", "--backend", target)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]   # torch's warnings above
    assert "first non-finite gradient: 'fc1.weight'" in line and f"on {target}" in line, line


def test_a_nonfinite_state_is_never_saved(tmp_path, mlp_program):
    writer = checkpoint.Writer(tmp_path / "ck", keep=3, start_step=0)
    info = checkpoint.manifest_info(mlp_program, "eager-cpu", 1, {"data": 1}, 1, {})
    writer.save(1, {"w": np.ones(3, np.float32)}, {"loop/updates": np.array(1)}, info)
    with pytest.raises(RunError, match=r"not saving step 2: 'w' holds NaN or Inf; the last good checkpoint is .*step-00000001"):
        writer.save(2, {"w": np.array([1, np.nan, 0], np.float32)}, {"loop/updates": np.array(2)}, info)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path / "ck")] == [1]


def test_step_numbers_of_any_width_resume_the_newest_and_prune(tmp_path, mlp_program):
    """Step 100,000,000 and later is a nine-digit folder: it is a checkpoint like the others, the newest one
    resumes, and --keep prunes the older ones."""
    ck = tmp_path / "ck"
    writer = checkpoint.Writer(ck, keep=2, start_step=99_999_998)
    for step in (99_999_999, 100_000_000, 100_000_001):
        info = checkpoint.manifest_info(mlp_program, "eager-cpu", 1, {"data": 1}, step, {})
        writer.save(step, {"w": np.full(3, step % 7, np.float32)}, {"loop/updates": np.array(step)}, info)
    assert [s for s, _ in checkpoint.list_checkpoints(ck)] == [100_000_000, 100_000_001]
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-100000000", "step-100000001"]
    newest = checkpoint.locate(ck)
    assert newest.name == "step-100000001"
    assert json.loads((newest / "manifest.json").read_text())["step"] == 100_000_001


def test_allow_config_change_loads_another_config(tmp_path, mlp_program):
    run(mlp_program, "eager-cpu", RunOptions(steps=2, warmup=1, checkpoint_dir=tmp_path / "ck"))
    changed = mlp_program.replace(optimizer=xb.SGD(lr=0.01, momentum=0.9))
    with pytest.raises(CheckpointError, match="belongs to another program config .* pass --allow-config-change"):
        run(changed, "eager-cpu", RunOptions(steps=4, warmup=1, resume=tmp_path / "ck"))
    result = run(changed, "eager-cpu", RunOptions(steps=4, warmup=1, resume=tmp_path / "ck", allow_config_change=True))
    assert result.start_step == 2 and result.config_changes == ["optimizer"]


def test_a_second_writer_is_refused_up_front(tmp_path):
    """One run at a time per checkpoint directory: a second is refused before its first step (and, once the first is
    done, may write there)."""
    ck = tmp_path / "ck"
    first = checkpoint.Writer(ck, 3, 0)
    first.lock()
    proc = run_cli("run", MLP, "--steps", "2", "--checkpoint-dir", str(ck))
    assert proc.returncode == 2
    assert one_error_line(proc) == (f"error: --checkpoint-dir {str(ck)!r} is in use by another run (pid {os.getpid()}); "
                                    "give each run its own checkpoint directory")
    assert not checkpoint.list_checkpoints(ck)
    first.release()
    assert run_cli("run", MLP, "--steps", "2", "--checkpoint-dir", str(ck)).returncode == 0
    assert [step for step, _ in checkpoint.list_checkpoints(ck)] == [2]


def test_only_the_temporary_folders_of_dead_saves_are_removed(tmp_path, mlp_program):
    ck = tmp_path / "ck"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = ck / f".tmp-step-00000002-{int(dead.stdout)}"             # its process is gone
    live = ck / f".tmp-step-00000002-{os.getppid()}"                  # a live process's save in progress
    for folder in (stale, live):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"half")
    run(mlp_program, "eager-cpu", RunOptions(steps=2, warmup=1, checkpoint_dir=ck))
    assert not stale.exists() and (live / "model.safetensors").read_bytes() == b"half"


def test_a_save_that_fails_leaves_no_temporary_folder_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    """Disk full during the second save: one line naming the directory and the cause (exit 1), the first checkpoint
    intact, nothing half-written left behind."""
    ck = tmp_path / "ck"
    writer = checkpoint.Writer(ck, 3, 0)
    writer.lock()
    state = {"w": np.ones(3, np.float32)}
    train = {"loop/updates": np.array(2, np.int64)}
    first = writer.save(2, state, train, {})
    original = checkpoint.writer.write_file

    def full(path, data):
        if path.name == checkpoint.TRAIN_FILE:
            raise OSError(28, "No space left on device")
        return original(path, data)

    monkeypatch.setattr(checkpoint.writer, "write_file", full)
    with pytest.raises(RunError) as failed:
        writer.save(4, state, {"loop/updates": np.array(4, np.int64)}, {})
    assert str(failed.value) == (f"checkpoint of step 4 could not be written to {str(ck)!r}: No space left on device; "
                                 f"the last good checkpoint is {first}")
    assert not list(ck.glob(".tmp-*")) and [s for s, _ in checkpoint.list_checkpoints(ck)] == [2]
    writer.release()
