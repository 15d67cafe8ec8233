"""Shared fixtures: a tiny GPT and MLP built in-test (fast), the shipped programs, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# JAX reads its virtual CPU device count once, before it initialises: give the test process 8 (subprocesses
# inherit it). Backends only take what a test's plan asks for.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "programs"


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``xbridge ARGS`` in a fresh interpreter, as a user would."""
    full_env = {**os.environ, "XBRIDGE_DEBUG": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", "xbridge", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd or ROOT, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line a bad input must produce (and nothing that looks like a traceback)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="session")
def gpt_program():
    from xbridge.loader import load_program

    return load_program(str(PROGRAMS / "gpt.py"))


@pytest.fixture(scope="session")
def mlp_program():
    from xbridge.loader import load_program

    return load_program(str(PROGRAMS / "mlp.py"))


@pytest.fixture(scope="session")
def tiny_gpt(gpt_program):
    """The shipped GPT architecture at toy size (same code path, milliseconds per step)."""
    import xbridge as xb

    gpt_module = sys.modules[gpt_program.loss.__module__]
    return gpt_program.replace(
        name="tiny-gpt",
        model=lambda: gpt_module.GPT(vocab=256, dim=32, layers=2, heads=2, seq=32),
        data=xb.data.ByteText.python_stdlib(seq_len=33, batch_size=8),
        optimizer=xb.AdamW(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, schedule=xb.WarmupCosine(3, 50)),
    )
