"""The bad-input corpus: program files, flags, meshes, sharding rules, precisions, targets and checkpoints.

Each case runs the command (its entry point, in this process: ``helpers.xbridge_here``) and asserts the exit code, exactly one ``error:`` line naming the thing at fault,
no traceback, nothing on stdout, and that no file that existed before (a workspace holding checkpoints, results
and user files, and the test fixtures) was changed, removed or added to.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import PROGRAMS, ROOT, one_error_line, xbridge_here

pytestmark = pytest.mark.cli
FIXTURES = ROOT / "tests" / "fixtures"
MLP = str(PROGRAMS / "mlp.py")
GPT = str(PROGRAMS / "gpt.py")
BAD_DATA = str(FIXTURES / "bad_data.py")


def _rewrite(step_dir, change):
    """Rewrite model.safetensors through ``change(arrays)`` and keep the manifest consistent with it (valid
    checksums), so only the tensor check can catch the problem."""
    import safetensors.numpy

    path = step_dir / "model.safetensors"
    arrays = change(safetensors.numpy.load(path.read_bytes()))
    data = safetensors.numpy.save(arrays)
    path.write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["tensors"]["model.safetensors"] = {n: [str(a.dtype), list(a.shape)] for n, a in arrays.items()}
    _write_manifest(step_dir, manifest)


def _write_manifest(step_dir, manifest, commit=True):
    """Write ``manifest`` as the checkpoint's, with a matching COMMIT (as an editor that knows the format would)
    or, with ``commit=False``, leaving the old one (a hand edit)."""
    text = json.dumps(manifest).encode()
    (step_dir / "manifest.json").write_bytes(text)
    if commit:
        (step_dir / "COMMIT").write_text(f"sha256 {hashlib.sha256(text).hexdigest()}\n")


def _edit_manifest(step_dir, **fields):
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for key, value in fields.items():
        if key == "bytes":
            del manifest["files"]["model.safetensors"]["bytes"]
        else:
            manifest[key] = value
    _write_manifest(step_dir, manifest)


def _rewrite_train(step_dir, change):
    import safetensors.numpy

    path = step_dir / "train.safetensors"
    arrays = change(safetensors.numpy.load(path.read_bytes()))
    data = safetensors.numpy.save(arrays)
    path.write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"]["train.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _write_manifest(step_dir, manifest)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, mlp_program):
    from xbridge.run.loop import RunOptions, run

    ws = tmp_path_factory.mktemp("workspace")
    run(mlp_program, "eager-cpu", RunOptions(steps=4, warmup=1, checkpoint_dir=ws / "ck", checkpoint_every=2))
    last = ws / "ck" / "step-00000004"

    def variant(name):
        target = ws / name / last.name
        shutil.copytree(last, target)
        return target

    model = variant("truncated") / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-100])
    train = variant("corrupted") / "train.safetensors"
    data = bytearray(train.read_bytes())
    data[len(data) // 2] ^= 0xFF
    train.write_bytes(bytes(data))
    _rewrite(variant("missing"), lambda a: {k: v for k, v in a.items() if k != "fc1.bias"})
    _rewrite(variant("reshaped"), lambda a: {**a, "fc1.weight": np.ascontiguousarray(a["fc1.weight"][:, :-1])})
    (variant("badjson") / "manifest.json").write_text("{not json")
    edited = variant("edited") / "manifest.json"
    edited.write_text(edited.read_text().replace('"step": 4', '"step": 2'))      # by hand: COMMIT not updated
    _edit_manifest(variant("restepped"), step=2)
    _edit_manifest(variant("fractional"), step=2.7)
    _edit_manifest(variant("wordstep"), step="abc")
    _edit_manifest(variant("nobytes"), bytes=None)
    _edit_manifest(variant("nulltensors"), tensors=None)
    (variant("nocommit") / "COMMIT").unlink()
    _rewrite(variant("int8"), lambda a: {**a, "fc1.weight": a["fc1.weight"].astype(np.int8)})
    _rewrite_train(variant("updates"), lambda a: {**a, "loop/updates": np.array(3, dtype=np.int64)})
    (ws / "linked").mkdir()
    (ws / "linked" / last.name).symlink_to(last, target_is_directory=True)
    (ws / "empty").mkdir()
    (ws / "afile.txt").write_text("keep me")
    (ws / "out").mkdir()
    (ws / "out" / "run.json").write_text('{"mine": true}')
    (ws / "out" / "results.csv").write_text("mine\n")
    (ws / "out" / "parity.json").write_text('{"mine": true}')
    np.savez(ws / "other.npz", w=np.zeros(3, np.float32))
    np.save(ws / "one.npy", np.zeros(3, np.float32))
    _data_files(ws)
    return ws


def _data_files(ws):
    """Token files for bad_data.py, and a checkpoint of its token program whose file then changes."""
    import os

    from xbridge.program_file import load_program
    from xbridge.run.loop import RunOptions, run

    rng = np.random.default_rng(0)
    rng.integers(0, 256, 4096).astype(np.uint16).tofile(ws / "tokens.bin")
    (ws / "empty.bin").write_bytes(b"")
    np.array([1, 2, 300, 4] * 64, dtype=np.uint16).tofile(ws / "big_ids.bin")
    (ws / "odd.bin").write_bytes(b"\x01\x02\x03")
    np.savez(ws / "mismatched.npz", x=np.zeros((10, 64), np.float32), y=np.zeros(9, np.int64))
    cwd = os.getcwd()
    os.chdir(ws)
    try:
        program = load_program(f"{FIXTURES / 'bad_data.py'}:tokens")
        run(program, "eager-cpu", RunOptions(steps=2, warmup=1, checkpoint_dir=ws / "ck_tokens"))
    finally:
        os.chdir(cwd)
    rng.integers(0, 256, 4096).astype(np.uint16).tofile(ws / "tokens.bin")   # same size, new content


def snapshot(*roots):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


CK = "{ws}/ck"
BAD_INPUTS = [  # (arguments, a literal fragment of the one error line); {ws} is the workspace
    # program files
    (["run", "missing.py"], "program file 'missing.py' does not exist"),
    (["run", str(FIXTURES / "syntax_error.py")], "has a syntax error at line 3"),
    (["run", str(FIXTURES / "no_program.py")], "defines no `program`; add `program = xb.Program(...)`"),
    (["run", str(FIXTURES / "wrong_type.py")], "wrong_type.py' is a dict, not an xb.Program"),
    (["run", str(FIXTURES / "raises.py")], "raised RuntimeError at import (raises.py:1): the dataset path"),
    (["run", str(FIXTURES / "bad_optimizer.py")], "bad_optimizer.py: AdamW lr must be a number > 0, got -1.0"),
    (["run", MLP + ":other"], "mlp.py' defines no `other`; add `other = xb.Program(...)`"),
    (["run", "{ws}/empty:program"], "program path '{ws}/empty' is not a file"),
    # flags
    (["run", MLP, "--steps", "0"], "--steps must be >= 1, got 0"),
    (["run", MLP, "--steps", "3", "--warmup", "3"], "--warmup must be in [0, steps)"),
    (["run", MLP, "--devices", "0"], "--devices must be >= 1, got 0"),
    (["run", MLP, "--seed", "-1"], "Program 'mlp': seed must be an int in [0, 2**63), got -1"),
    (["run", MLP, "--format", "yaml"], "Invalid value for '--format'"),
    (["run", MLP, "--stesp", "3"], "No such option: --stesp"),
    (["run", MLP, "--sharding-mode", "gspmd"], "target eager-cpu takes no --sharding-mode"),
    (["run", MLP, "--backend", "jax-cpu", "--sharding-mode"], "option --sharding-mode needs a value (gspmd, shard_map)"),
    (["run", MLP, "--backend", "jax-cpu", "--shardng-mode", "gspmd"], "No such option: --shardng-mode. Did you mean --sharding-mode?"),
    (["run", MLP, "--backend", "jax-cpu", "--sharding-mode", "pmap"], "--sharding-mode 'pmap' is not a choice of target jax-cpu; use one of gspmd, shard_map"),
    (["run", MLP, "--backend", "inductor-cpu", "--compile-mode", "fast"], "--compile-mode 'fast' is not a choice of target inductor-cpu; use one of default, reduce-overhead, max-autotune"),
    (["run", MLP, "--backend", "xla-cpu", "--xla-mode", "fast"], "--xla-mode 'fast' is not a choice of target xla-cpu; use one of lazy, openxla"),
    (["run", MLP, "--init-state", "{ws}/nothere.npz"], "--init-state '{ws}/nothere.npz' does not exist"),
    (["run", MLP, "--init-state", "{ws}/other.npz"], "the --init-state file is missing tensor 'fc1.weight' of program 'mlp'"),
    (["run", MLP, "--steps", "2", "--out", "{ws}/afile.txt"], "--out '{ws}/afile.txt' exists and is not a directory"),
    (["run", MLP, "--steps", "2", "--out", "{ws}/out"], "--out: '{ws}/out/run.json' exists and xbridge did not write it; xbridge never replaces a file of yours"),
    (["run", MLP, "--steps", "2", "--save-state", "{ws}/other.npz"], "--save-state: '{ws}/other.npz' exists and xbridge did not write it"),
    (["run", MLP, "--steps", "2", "--trace-modules", "{ws}/afile.txt"], "--trace-modules: '{ws}/afile.txt' exists and xbridge did not write it"),
    (["compare", MLP, "--backends", "eager-cpu", "--out", "{ws}/out"], "--out: '{ws}/out/results.csv' exists and xbridge did not write it"),
    (["parity", MLP, "--backends", "eager-cpu", "--out", "{ws}/out"], "--out: '{ws}/out/parity.json' exists and xbridge did not write it"),
    (["compare", MLP, "--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
    (["run", MLP, "--steps", "2", "--out", ""], "--out is given an empty value; give a path (. for the current folder)"),
    (["compare", MLP, "--backends", "eager-cpu", "--out="], "--out is given an empty value; give a path (. for the current folder)"),
    (["run", MLP, "--steps", "2", "--checkpoint-dir", ""], "--checkpoint-dir is given an empty value; give a path (. for the current folder)"),
    # processes
    (["run", MLP, "--backend", "jax-cpu", "--processes", "0"], "--processes must be a count >= 1 or 'cluster', got 0"),
    (["run", MLP, "--backend", "jax-cpu", "--processes", "two"], "--processes must be a count >= 1 or 'cluster', got 'two'"),
    (["run", MLP, "--backend", "xla-cpu", "--processes", "2"], "--processes: torch_xla 2.9 runs SPMD over several processes only on a TPU pod"),
    (["run", MLP, "--backend", "inductor-cpu", "--processes", "2"], "--processes: inductor starts its own processes, one per device"),
    (["run", MLP, "--processes", "2"], "--processes: the eager backend runs in one process; several processes are for jax targets"),
    (["parity", MLP, "--processes", "0"], "--processes must be >= 1, got 0"),
    # meshes and sharding rules
    (["run", str(FIXTURES / "bad_mesh.py"), "--backend", "jax-cpu"], "mesh (data=2 x model=2) has 4 devices but 1 are in use"),
    (["inspect", MLP, "--mesh", "data=x"], "--mesh part 'data=x' of 'data=x' is not NAME=SIZE"),
    (["inspect", MLP, "--mesh", "data=2,data=2"], "mesh axis 'data' appears twice"),
    (["inspect", MLP, "--devices", "8", "--mesh", "data=-1,model=3"], "mesh (data=-1 x model=3) cannot fill 8 devices"),
    (["inspect", str(FIXTURES / "bad_rule.py")], "sharding rule 'encoder\\..*' (spec ('model',)) matches no parameter"),
    (["inspect", GPT, "--devices", "3", "--mesh", "data=1,model=3"],
     "parameter 'blocks.0.q.weight' of shape (256, 256) (rule '.*\\.(q|k|v|up)\\.weight', spec ('model', None)): "
     "dimension 0 (256) is not divisible by mesh axis 'model' (size 3)"),
    # precisions
    (["run", MLP, "--precision", "fp8"], "unknown precision 'fp8'; use one of fp32, bf16-mixed"),
    (["run", MLP, "--precision", "params=float8"], "precision 'params=float8' lacks compute"),
    # targets
    (["run", MLP, "--backend", "tpu-jax"], "unknown target 'tpu-jax'; known targets: eager-cpu, "),
    (["run", MLP, "--backend", "jax-tpu"], "target jax-tpu is unavailable: no TPU chip on this machine's PCI bus"),
    (["run", MLP, "--backend", "xla-cuda"], "target xla-cuda is unavailable: torch_xla 2.9 has no CUDA support"),
    (["run", MLP, "--devices", "4"], "target eager-cpu has 1 device(s) here, but --devices 4"),
    (["parity", MLP, "--backends", "nope-cpu"], "unknown target 'nope-cpu'"),
    # checkpoints
    (["run", GPT, "--resume", CK], "checkpoint '{ws}/ck/step-00000004' belongs to another program config (program 'mlp'"),
    (["run", MLP, "--resume", "{ws}/truncated"], "model.safetensors' is truncated or padded"),
    (["run", MLP, "--resume", "{ws}/corrupted"], "train.safetensors' is corrupted: its SHA-256 differs"),
    (["run", MLP, "--resume", "{ws}/missing"], "is missing tensor 'fc1.bias' of program 'mlp'"),
    (["run", MLP, "--resume", "{ws}/reshaped"], "tensor 'fc1.weight' in checkpoint '{ws}/reshaped/step-00000004' has "
                                                "shape (256, 63), program 'mlp' expects (256, 64)"),
    (["run", MLP, "--resume", "{ws}/badjson"], "checkpoint manifest '{ws}/badjson/step-00000004/manifest.json' cannot be read"),
    (["run", MLP, "--resume", "{ws}/nothere"], "--resume '{ws}/nothere' does not exist"),
    (["run", MLP, "--resume", "{ws}/empty"], "--resume '{ws}/empty' holds no checkpoint"),
    (["run", MLP, "--resume", CK, "--steps", "4"], "is at step 4 and --steps 4 is the total to reach"),
    (["run", MLP, "--resume", CK, "--init-state", "{ws}/other.npz"], "--resume and --init-state both give the starting weights"),
    (["run", MLP, "--checkpoint-dir", CK], "--checkpoint-dir '{ws}/ck' already holds checkpoints up to step 4"),
    (["run", MLP, "--checkpoint-dir", "{ws}/afile.txt"], "--checkpoint-dir '{ws}/afile.txt' exists and is not a directory"),
    (["run", MLP, "--checkpoint-dir", "{ws}/afile.txt/ck"], "--checkpoint-dir '{ws}/afile.txt/ck' cannot be created"),
    (["run", MLP, "--checkpoint-dir", "/proc/xbridge-ck"], "--checkpoint-dir '/proc/xbridge-ck' cannot be created"),
    (["run", MLP, "--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir DIR"),
    (["run", MLP, "--checkpoint-every", "0", "--checkpoint-dir", "{ws}/new"], "--checkpoint-every must be >= 1, got 0"),
    (["run", MLP, "--keep", "0", "--checkpoint-dir", "{ws}/new"], "--keep must be >= 1, got 0"),
    (["run", MLP, "--resume", "{ws}/edited"], "manifest.json' was changed after it was written (its SHA-256 differs from COMMIT's)"),
    (["run", MLP, "--resume", "{ws}/restepped"], "step-00000004' says step 2 in its manifest, its directory name says 4"),
    (["run", MLP, "--resume", "{ws}/fractional"], "manifest.json': 'step' must be a whole number >= 0, got 2.7"),
    (["run", MLP, "--resume", "{ws}/wordstep"], "manifest.json': 'step' must be a whole number >= 0, got 'abc'"),
    (["run", MLP, "--resume", "{ws}/nobytes"], "'files' entry 'model.safetensors' must hold an integer 'bytes' and a string 'sha256'"),
    (["run", MLP, "--resume", "{ws}/nulltensors"], "manifest.json': 'tensors' must be an object, got NoneType"),
    (["run", MLP, "--resume", "{ws}/nocommit"], "step-00000004' has no COMMIT file: it was not completely written"),
    (["run", MLP, "--resume", "{ws}/int8"], "tensor 'fc1.weight' in checkpoint '{ws}/int8/step-00000004' is int8; program 'mlp' stores it as float32"),
    (["run", MLP, "--resume", "{ws}/updates"], "says step 4 in its manifest, but its optimizer has made 3 updates"),
    (["run", MLP, "--resume", "{ws}/linked"], "checkpoint '{ws}/linked/step-00000004' is a symbolic link; xbridge deletes old checkpoints"),
    (["run", MLP, "--checkpoint-dir", "{ws}/linked"], "--checkpoint-dir '{ws}/linked': step-00000004 is a symbolic link"),
    # programs that cannot train, or that fail in the user's own code: refused before the first step
    (["run", str(FIXTURES / "bad_programs.py") + ":detached_loss"], "the loss of program 'detached-loss' does not depend on any trainable parameter"),
    (["run", str(FIXTURES / "bad_programs.py") + ":detached_loss", "--backend", "jax-cpu"], "the loss of program 'detached-loss' does not depend on any trainable parameter"),
    (["run", str(FIXTURES / "bad_programs.py") + ":integer_loss"], "the loss of program 'integer-loss' must be a floating tensor, got torch.int64"),
    (["run", str(FIXTURES / "bad_programs.py") + ":vector_loss"], "the loss of program 'vector-loss' must return a 0-d tensor or xb.LossSum(total, count), got shape (64,)"),
    (["run", str(FIXTURES / "bad_programs.py") + ":missing_key"], "KeyError: 'tokens' raised in the program's loss at "),
    (["run", str(FIXTURES / "bad_programs.py") + ":missing_key", "--backend", "xla-cpu"], "bad_programs.py:27 (in wrong_key)"),
    (["run", str(FIXTURES / "bad_programs.py") + ":no_parameters"], "the model of program 'no-parameters' has no trainable parameter"),
    (["run", str(FIXTURES / "bad_programs.py") + ":model_raises"], "RuntimeError: config.json not found next to the program raised in the program's model builder at "),
    (["run", str(FIXTURES / "bad_programs.py") + ":data_raises"], "No such file or directory: 'shards/shard-00000.npz' raised in the program's data source at "),
    (["parity", str(FIXTURES / "bad_programs.py") + ":model_raises", "--backends", "jax-cpu"], "bad_programs.py:35 (in broken_model)"),
    (["run", str(FIXTURES / "exits.py")], "exits.py' called sys.exit(0) at import"),
    (["run", str(FIXTURES / "exits_with_message.py")], "called sys.exit('config missing') at import"),
    # output paths: checked before any work
    (["run", MLP, "--save-state", "{ws}/empty"], "--save-state '{ws}/empty' is a directory; give a file name"),
    (["run", MLP, "--save-state", "{ws}/afile.txt/state.npz"], "'{ws}/afile.txt' is not a directory"),
    (["run", MLP, "--trace-modules", "/proc/xbridge-trace.npz"], "--trace-modules '/proc/xbridge-trace.npz' is not writable: /proc refuses new files"),
    (["run", MLP, "--dump", "{ws}/afile.txt"], "--dump '{ws}/afile.txt' exists and is not a directory"),
    (["run", MLP, "--out", "{ws}/" + "x" * 300], "is longer than the 255 bytes a file name may have"),
    (["run", MLP, "--seed", str(2 ** 64)], "seed must be an int in [0, 2**63), got 18446744073709551616"),
    (["run", MLP, "--profile", "steps=1:2"], "--profile needs --out DIR (the trace is written under DIR/profile)"),
    (["run", MLP, "--profile", "5:8", "--out", "{ws}/new"], "--profile '5:8' is not steps=A:B"),
    (["compare", MLP, "--profile", "steps=3:30", "--steps", "5"], "--profile 'steps=3:30': the steps must satisfy A < B <= --steps (5)"),
    (["run", MLP, "--init-state", "{ws}/one.npy"], "--init-state '{ws}/one.npy' is a single array (.npy); give an .npz"),
    # data: a batch that changes, files that are wrong, a file that changed since the checkpoint
    (["run", BAD_DATA + ":missing_key", "--steps", "3"], "data Spoiled, step 2: batch key 'y' is missing (step 0 had it)"),
    (["run", BAD_DATA + ":extra_key", "--steps", "3"], "data Spoiled, step 2: batch key 'w' is new (step 0 had keys ['x', 'y'])"),
    (["run", BAD_DATA + ":dtype_change", "--steps", "3"], "data Spoiled, step 2: key 'x' is float64, it was float32 at step 0"),
    (["run", BAD_DATA + ":shape_change", "--steps", "3"], "data Spoiled, step 2: key 'x' has shape [64, 32], it was [64, 64] at step 0"),
    (["run", BAD_DATA + ":not_array", "--steps", "3"], "data Spoiled, step 2: key 'y' is a list, not a numpy array"),
    (["run", BAD_DATA + ":not_dict", "--steps", "3"], "data Spoiled, step 2: batch() returned list, not a dict of arrays"),
    (["run", BAD_DATA + ":short_batch", "--steps", "3"], "data Spoiled, step 2: key 'x' has shape [10, 64], it was [64, 64] at step 0"),
    (["run", str(FIXTURES / "bad_programs.py") + ":float_loss", "--steps", "2"], "got a Python float (float(), .item() or .tolist() took the value off the tensor, and with it the gradient: return the tensor itself)"),
    (["run", str(FIXTURES / "bad_programs.py") + ":float_loss", "--steps", "2", "--backend", "jax-cpu"], "the loss of program 'float-loss' takes a Python value from a tensor ("),
    (["run", str(FIXTURES / "bad_programs.py") + ":huge_labels", "--steps", "2"], "data HugeLabels, step 0: key 'y' holds 9223372036854775813 at index (3,), beyond int64"),
    (["run", str(FIXTURES / "counted_loss.py") + ":no_labels", "--steps", "3"], "step 1: the loss's xb.LossSum count is 0 over the whole batch"),
    (["run", str(FIXTURES / "counted_loss.py") + ":negative_count", "--backend", "jax-cpu"], "step 0: the loss's xb.LossSum count is negative over the whole batch"),
    (["run", str(FIXTURES / "bad_programs.py") + ":no_such_layers"], "StepOptions layers='blocks': the model (Linear) has no submodule 'blocks'"),
    (["run", str(FIXTURES / "bad_programs.py") + ":no_such_layers", "--backend", "jax-cpu"], "StepOptions layers='blocks': the model (Linear) has no submodule 'blocks'"),
    (["run", BAD_DATA + ":described_array"], "data Described.describe(): field 'mean' is not JSON (type ndarray)"),
    (["run", BAD_DATA + ":huge_labels", "--backend", "jax-cpu", "--steps", "3"], "data Spoiled, step 1: key 'y' holds the int64 value 2147483648, outside int32, which the jax targets compute integers in"),
    (["run", BAD_DATA + ":reserved_key", "--backend", "jax-cpu"], "data Spoiled, step 0: batch key 'xbridge.rng' is reserved for --rng portable; rename it"),
    (["run", BAD_DATA + ":empty_file"], "bad_data.py: TokenFile: data file 'empty.bin' is empty"),
    (["run", BAD_DATA + ":big_ids"], "bad_data.py: TokenFile 'big_ids.bin': token id 300 is outside the vocabulary (vocab_size 256)"),
    (["run", BAD_DATA + ":odd_size"], "bad_data.py: TokenFile 'odd.bin': 3 bytes is not a whole number of uint16 tokens"),
    (["run", BAD_DATA + ":mismatched_arrays"], "bad_data.py: Arrays: arrays have different numbers of examples {'x': 10, 'y': 9}"),
    (["run", BAD_DATA + ":tokens", "--resume", "{ws}/ck_tokens", "--steps", "4"],
     "ck_tokens/step-00000002': data 'tokens.bin' changed since it was saved (fingerprint "),
    # flags that need another flag, empty lists, choices
    (["run", MLP, "--keep", "2"], "--keep needs --checkpoint-dir DIR"),
    (["run", MLP, "--allow-config-change"], "--allow-config-change needs --resume CHECKPOINT"),
    (["compare", MLP, "--backends", ""], "--backends names no target; give some"),
    (["parity", MLP, "--backends", " , "], "--backends names no target; give some"),
    (["run", MLP, "--rng", "philox"], "--rng must be one of native, portable, got 'philox'"),
    (["run", MLP, "--remat", "some"], "--remat must be one of none, full, dots, got 'some'"),
    (["run", MLP, "--attention", "fast"], "--attention must be one of auto, math, flash, efficient, cudnn, got 'fast'"),
    (["run", GPT, "--attention", "efficient"], "StepOptions attention='efficient' cannot run on eager-cpu for the attention calls of program 'gpt'"),
    (["run", str(FIXTURES / "layered.py"), "--attention", "flash", "--rng", "native"], "Both fused kernels do not support non-zero dropout.; use attention='auto'"),
    (["run", GPT, "--backend", "jax-cpu", "--attention", "flash"], "StepOptions attention='flash' is not available on jax-cpu: the Pallas flash attention kernel runs on TPUs only; use attention='auto' or 'math' here, or the target jax-tpu"),
    (["run", GPT, "--backend", "jax-cpu", "--attention", "efficient"], "StepOptions attention='efficient' is not available on jax-cpu: torchax 0.0.13 lowers"),
    (["run", GPT, "--backend", "jax-cpu", "--attention", "cudnn"], "StepOptions attention='cudnn' is not available on jax-cpu: jax.nn.dot_product_attention(implementation='cudnn') runs on NVIDIA GPUs only"),
    (["run", MLP, "--remat", "full"], "StepOptions remat: the model (MLP) has no nn.ModuleList of layers of one class"),
    (["run", str(FIXTURES / "layer_nets.py") + ":remat_batchnorm"], "StepOptions remat/scan_layers: layers.0.1 is a BatchNorm1d that updates its running statistics"),
    (["run", str(FIXTURES / "layer_nets.py") + ":scanned_portable", "--backend", "jax-cpu"], "StepOptions scan_layers with rng='portable' is not available on jax"),
    (["run", str(FIXTURES / "layer_nets.py") + ":scanned_different", "--backend", "jax-cpu"], "StepOptions scan_layers: layers.1 differs from layers.0 in its class, parameters or buffers"),
    (["run", str(FIXTURES / "layer_nets.py") + ":scanned_with_work_between", "--backend", "jax-cpu"], "StepOptions scan_layers: layers.1 was not called on the output of layers.0"),
    (["compare", MLP, "--backends", "jax-cpu", "--reference", "xla-cpu"],
     "--reference 'xla-cpu': the reference must be an eager target"),
    (["compare", MLP, "--steps", "1"], "compare needs --steps >= 2 and 0 < --warmup < --steps, got 1 and 0"),
    (["compare", MLP, "--backends", "xla-cpu:xla-mode=lazy:xla-mode=openxla"],
     "target variant 'xla-cpu:xla-mode=lazy:xla-mode=openxla': xla-mode is given twice ('lazy' and 'openxla')"),
]


@pytest.mark.parametrize("args,fragment", BAD_INPUTS, ids=[f"{i:02d}-{a[-1][-24:]}" for i, (a, _) in enumerate(BAD_INPUTS)])
def test_bad_input_one_line_exit_2_nothing_changed(args, fragment, workspace):
    before = snapshot(workspace, FIXTURES)
    proc = xbridge_here(*[a.replace("{ws}", str(workspace)) for a in args], cwd=workspace)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    line = one_error_line(proc)
    assert fragment.replace("{ws}", str(workspace)) in line, line
    assert proc.stdout == ""
    assert snapshot(workspace, FIXTURES) == before
    assert not (workspace / "new").exists()


def test_a_second_command_writing_one_out_folder_is_refused(tmp_path):
    """Two commands given one --out at once would lose a record: the second is refused before any work, naming
    the first's process; once that one has ended, the folder is free again."""
    import subprocess
    import sys

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from xbridge.files import claim\nclaim(Path(sys.argv[1]), '--out')\n"
                               "print('held', flush=True)\ntime.sleep(120)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for command in (["run", MLP, "--steps", "2"], ["compare", MLP, "--backends", "eager-cpu", "--steps", "2"]):
            proc = xbridge_here(*command, "--out", str(out))
            assert proc.returncode == 2 and one_error_line(proc) == (
                f"error: --out {str(out)!r} is being written by another xbridge command; give each command its own "
                "folder"), proc.stderr
        assert not (out / "run.json").exists()
    finally:
        holder.kill()
        holder.communicate()
    proc = xbridge_here("run", MLP, "--steps", "2", "--out", str(out))
    assert proc.returncode == 0 and (out / "run.json").is_file(), proc.stderr


@pytest.mark.parametrize("args", [["cache"], ["cache", "--clear", "inductor"]])
def test_a_cache_folder_that_is_a_file_is_refused(tmp_path, args):
    """XBRIDGE_CACHE_DIR naming a file: `cache` said "no cache yet" and `cache --clear` nothing, both exit 0."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    proc = xbridge_here(*args, env={"XBRIDGE_CACHE_DIR": str(afile)})
    assert proc.returncode == 2 and one_error_line(proc) == (
        f"error: XBRIDGE_CACHE_DIR {str(afile)!r} is a file, not a folder; point it at a folder (made if missing) or "
        "remove the file"), proc.stderr
    assert afile.read_text() == "mine"


def test_a_program_under_a_path_that_is_not_utf8_runs(tmp_path):
    """A folder name in another encoding (bytes that are not UTF-8): the program's module name hashed its path with
    str.encode, which refuses the surrogates Python decodes such bytes to (a raw UnicodeEncodeError)."""
    import os

    folder = Path(os.fsdecode(bytes(tmp_path) + b"/d\xff"))
    folder.mkdir()
    shutil.copy(MLP, folder / "p.py")
    proc = xbridge_here("run", str(folder / "p.py"), "--steps", "2", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["program"] == "mlp"


def test_the_corpus_is_large_and_distinct():
    assert len(BAD_INPUTS) >= 90
    assert len({tuple(a) for a, _ in BAD_INPUTS}) == len(BAD_INPUTS)


def test_run_options_are_checked_once_and_never_change():
    """The Python API's options: refused when built (the CLI's message), the warm-up default filled in, and frozen."""
    import dataclasses

    from xbridge.errors import ConfigError
    from xbridge.run.loop import RunOptions

    with pytest.raises(ConfigError, match=r"--warmup must be in \[0, steps\) = \[0, 3\), got 3"):
        RunOptions(steps=3, warmup=3)
    options = RunOptions(steps=1)
    assert options.warmup == 0 and RunOptions(steps=10).warmup == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.steps = 5     # type: ignore[misc]
