"""Framework warnings that say nothing to an xbridge user are dropped, and only those (xbridge/run/framework_noise.py).
Each check runs the framework's own code path in a fresh interpreter, first without the filter (the warning is
there), then with it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import user_env

TORCH_XLA = "import torch_xla.runtime as xr; print(xr.device_type())"   # what transformers' availability check does


def _stderr(code: str, silenced: bool) -> str:
    prefix = "from xbridge.run import framework_noise; framework_noise.silence()\n" if silenced else ""
    env = {k: v for k, v in user_env().items() if k != "PJRT_DEVICE"}
    proc = subprocess.run([sys.executable, "-c", prefix + code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.slow
@pytest.mark.xla_env
def test_torch_xlas_default_device_warning_is_dropped():
    assert "Defaulting to PJRT_DEVICE=CPU" in _stderr(TORCH_XLA, silenced=False)
    assert "Defaulting to PJRT_DEVICE=CPU" not in _stderr(TORCH_XLA, silenced=True)


def test_only_the_listed_messages_are_dropped():
    code = ("import logging\nlogging.warning('Defaulting to PJRT_DEVICE=CPU')\nlogging.warning('kept: root')\n"
            "log = logging.getLogger('torch.utils.cpp_extension')\n"
            "log.warning(\"No CUDA runtime is found, using CUDA_HOME='%s'\", '/usr/local/cuda')\n"
            "log.warning('kept: cpp_extension')\n"
            "log = logging.getLogger('torch._dynamo.variables.torch')\n"
            "log.warning('Profiler function %s will be ignored', \"<class 'record_function'>\")\n")
    quiet = _stderr(code, silenced=True)
    assert "Defaulting" not in quiet and "No CUDA runtime" not in quiet and "Profiler function" not in quiet
    assert "kept: root" in quiet and "kept: cpp_extension" in quiet
    assert "No CUDA runtime is found" in _stderr(code, silenced=False)


def test_native_lines_are_dropped_by_fragment_and_the_rest_kept():
    code = ("import os\nfrom xbridge.run.framework_noise import native_lines_dropped\n"
            "with native_lines_dropped(('drop me',)):\n"
            "    os.write(2, b'kept: one\\nplease drop me now\\nkept: two\\n')\n"
            "os.write(2, b'after: drop me stays outside the block\\n')\n")
    assert _stderr(code, silenced=False) == "kept: one\nkept: two\nafter: drop me stays outside the block\n"


@pytest.mark.slow
def test_jaxs_profiler_tensorflow_lines_are_dropped():
    """jaxlib 0.7's profiler logs the TensorFlow line twice per trace, and the jax stack's trace drops it; jaxlib
    0.12's (make setup's .venv) no longer logs it, and the trace still writes its file and no such line."""
    jax = pytest.importorskip("jax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")
    from packaging.version import Version

    work = "import jax, pathlib, tempfile\nd = tempfile.mkdtemp()\n"
    raw = work + "jax.profiler.start_trace(d)\njax.numpy.ones(3).block_until_ready()\njax.profiler.stop_trace()\n"
    quiet = (work + "from xbridge.backends.jaxjit.capabilities import _trace\n"
             "with _trace(pathlib.Path(d)):\n    jax.numpy.ones(3).block_until_ready()\n"
             "assert list(pathlib.Path(d).rglob('*.xplane.pb'))\n")
    line = "Can't import tensorflow.python.profiler.trace"
    assert _stderr(raw, silenced=False).count(line) == (2 if Version(jax.__version__) < Version("0.8") else 0)
    assert line not in _stderr(quiet, silenced=False)


@pytest.mark.slow
def test_native_stdout_reaches_stderr_and_the_json_stays_whole(tmp_path):
    """What native code prints on file descriptor 1 during a run (jaxlib 0.12's Gloo does, in every process of a
    job) no longer lands in the middle of `--format json`: it reaches stderr, less Gloo's connection lines, and
    stdout is the run's JSON alone. The program writes to descriptor 1 as native code would, from its loss."""
    import json

    from helpers import PROGRAMS, run_cli

    program = tmp_path / "prints.py"
    program.write_text(
        "import os, runpy\n"
        f"mlp = runpy.run_path({str(PROGRAMS / 'mlp.py')!r})\n"
        "def loss(model, batch):\n"
        "    os.write(1, b'[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\\n')\n"
        "    os.write(1, b'native says hello\\n')\n"
        "    return mlp['loss'](model, batch)\n"
        "program = mlp['program'].replace(loss=loss)\n")
    proc = run_cli("run", str(program), "--backend", "eager-cpu", "--steps", "2", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["summary"]["timed_steps"] == 1      # stdout: the JSON and nothing else
    assert "native says hello" in proc.stderr and "[Gloo]" not in proc.stderr + proc.stdout
