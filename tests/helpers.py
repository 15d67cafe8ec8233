"""What tests share besides fixtures: paths, and running the installed ``xbridge`` command as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from xbridge.processes import warm

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "programs"
FIXTURES = ROOT / "tests" / "fixtures"

# Importing torch_xla or starting its runtime in the test process writes its own variables into os.environ
# (XLA_USE_SPMD, PJRT_DEVICE, XLA_FLAGS, LIBTPU_INIT_ARGS, ...), as does a backend configured in it (inductor's
# TORCHINDUCTOR_VEC_ISA_OK, --dump's TORCH_COMPILE_DEBUG). A command the tests start must not inherit them: a user's
# shell does not have them, XLA_USE_SPMD alone adds a deprecation warning to every xla run's stderr, and the warm
# server refuses a command whose TORCH* or JAX_* variables differ from its own (xbridge/processes/warm.py).
_FRAMEWORK_PREFIXES = ("XLA_", "PJRT_", "LIBTPU_", "TPU_", "PTXLA_", "TF_CPP_", "GRPC_", "NEURON_",
                       "ALLOW_MULTIPLE_LIBTPU_LOAD", "ENABLE_RUNTIME_UPTIME_TELEMETRY", "TORCH", "JAX_")
SESSION_ENV = dict(os.environ)


def user_env() -> dict[str, str]:
    """os.environ as a user's shell would hold it: the frameworks' variables as they were when the tests began."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(_FRAMEWORK_PREFIXES)}
    env.update({key: value for key, value in SESSION_ENV.items() if key.startswith(_FRAMEWORK_PREFIXES)})
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``xbridge ARGS`` in a process of its own, as a user would: a fork of the session's warm server of this
    interpreter (tests/conftest.py, xbridge/processes/warm.py: the frameworks imported already), or a fresh interpreter
    where none serves it (an environment that differs in what an interpreter fixes at start, e.g. PYTHONHASHSEED)."""
    full_env = {**user_env(), "XBRIDGE_DEBUG": "0", **(env or {})}
    cmd = [sys.executable, "-m", "xbridge", *args]
    return warm.capture(cmd, full_env, cwd=cwd or ROOT, timeout=timeout)


def xbridge_here(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``xbridge ARGS`` through the command's own entry point (``xbridge.cli.main``, what the console script calls)
    in this process: the same parsing, checks, records and error lines as :func:`run_cli`, without a new
    interpreter's start (torch's import alone is 2 s, torch_xla's 6). For what needs no process of its own: eager
    runs, inspect, check, the errors before compute. :func:`run_cli` keeps the boundary where the process is the
    point (the console script, a framework runtime's device count, signals, several processes). Output written by
    the frameworks' C++ code straight to file descriptor 2 is not captured here."""
    import contextlib
    import io

    from xbridge.cli import main

    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    out, err = io.StringIO(), io.StringIO()
    os.environ.update({"XBRIDGE_DEBUG": "0", **(env or {})})
    sys.argv = ["xbridge", *args]
    try:
        os.chdir(cwd or ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line a bad input must produce (and nothing that looks like a traceback)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a run that got as far as compiling (the stacks' own warnings may precede it)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files in ``directory``, by tag: (step, value) in write order. Read with
    the Event protobuf tensorboardX ships, over TFRecord framing (length, its CRC, the record, its CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


# What parity finds for a target, by what ``xbridge check`` said of it before (issue 55, item 8: check and parity
# agree): a construct check says fails is refused before compute (no result), one that differs trains with other
# numbers (FAIL), anything else passes.
PARITY_BY_CHECK = {"runs": "pass", "runs-slow": "pass", "differs": "FAIL", "fails": "error"}


def assert_check_agrees(program: str, record: dict, *options: str) -> None:
    """``xbridge check PROGRAM`` (with the ``options`` the parity run had: --rng, --precision, --devices) over the
    targets of a parity ``record`` (parity.json): each target's verdict there is the one check's verdict predicts."""
    targets = [row["target"] for row in record["targets"]]
    proc = run_cli("check", program, "--backends", ",".join(targets), "--format", "json", *options)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = {row["target"]: row for row in json.loads(proc.stdout)["targets"]}
    found = {row["target"]: row["verdict"] for row in record["targets"]}
    expected = {target: PARITY_BY_CHECK[said[target]["verdict"]] for target in targets}
    assert found == expected, {t: said[t]["summary"] for t in targets if found[t] != expected[t]}
