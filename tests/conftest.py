"""Shared fixtures: a tiny GPT and MLP built in-test (fast) and the shipped programs (helpers.py has the rest)."""

from __future__ import annotations

import os
import sys

import pytest

# JAX reads its virtual CPU device count once, before it initialises: give the test process 8 (subprocesses
# inherit it). Backends only take what a test's plan asks for.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from helpers import PROGRAMS


@pytest.fixture(scope="session")
def gpt_program():
    from xbridge.program_file import load_program

    return load_program(str(PROGRAMS / "gpt.py"))


@pytest.fixture(scope="session")
def mlp_program():
    from xbridge.program_file import load_program

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
