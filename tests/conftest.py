"""Shared fixtures: a tiny GPT and MLP built in-test (fast) and the shipped programs (helpers.py has the rest)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import helpers
from helpers import PROGRAMS, ROOT, user_env

# Hermetic runs: the session compiles into a cache folder of its own (it starts cold, and nothing is written to
# ~/.cache), and the frameworks' own cache variables do not send anything elsewhere. XBRIDGE_TEST_CACHE_DIR keeps a
# folder across sessions while iterating. Subprocesses inherit this environment; it holds no XLA_FLAGS of ours, so
# CLI tests take the user's path (`--devices N` alone).
# Under pytest-xdist (make test: scripts/test.sh) the workers inherit the folder the controlling process made here,
# so what one worker compiled another loads; the controller alone removes it at the end.
_WORKER = "PYTEST_XDIST_WORKER" in os.environ
_OWN_CACHE = "XBRIDGE_TEST_CACHE_DIR" not in os.environ and not _WORKER
if not _WORKER:
    os.environ["XBRIDGE_CACHE_DIR"] = os.environ.get("XBRIDGE_TEST_CACHE_DIR") or tempfile.mkdtemp(
        prefix="xbridge-test-cache-")
for _name in ("TORCHINDUCTOR_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR"):
    os.environ.pop(_name, None)
    helpers.SESSION_ENV.pop(_name, None)       # what user_env() restores
# Hugging Face datasets (the Records tests) caches under the same folder and never reaches for the network
os.environ["HF_DATASETS_CACHE"] = os.path.join(os.environ["XBRIDGE_CACHE_DIR"], "hf-datasets")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"


# Warm starts (xbridge/processes/warm.py): the controlling process starts a server per environment (this interpreter and
# the other environment's), each importing the frameworks once; every `xbridge` the tests start (helpers.run_cli) and
# every parity target is a fork of one, not a fresh interpreter (a small run: 1 s instead of 6). Started here, before
# any test, with the environment above; the workers inherit XBRIDGE_WARM_START.
_WARM: list[subprocess.Popen] = []
if not _WORKER and "XBRIDGE_WARM_START" not in os.environ:
    os.environ["XBRIDGE_WARM_START"] = tempfile.mkdtemp(prefix="xbridge-warm-")
    from xbridge.environments import configured

    for _python in dict.fromkeys([sys.executable, *(env.python for env in configured().values())]):
        # the server says on stderr which commands it refused, and why: XBRIDGE_TEST_WARM_LOG=FILE keeps that
        with open(os.environ.get("XBRIDGE_TEST_WARM_LOG") or os.devnull, "a") as _log:
            _WARM.append(subprocess.Popen([_python, "-m", "xbridge.processes.warm", os.environ["XBRIDGE_WARM_START"]],
                                          cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=_log,
                                          env=user_env()))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _OWN_CACHE:
        shutil.rmtree(os.environ["XBRIDGE_CACHE_DIR"], ignore_errors=True)
    for server in _WARM:
        server.terminate()
    for server in _WARM:
        server.wait(timeout=30)
    if _WARM:
        shutil.rmtree(os.environ["XBRIDGE_WARM_START"], ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _jax_devices_in_this_process():
    """In-process tests plan for up to 8 devices, and JAX fixes its virtual CPU device count when it first starts:
    ask for 8 in this process only (a backend never lowers what was asked for)."""
    try:
        import jax
    except ImportError:
        return
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")   # as the jax-cpu target does: libtpu (xbridge compile) stays unloaded


@pytest.fixture(autouse=True)
def _torchax_leaves_dynamo_working():
    """A test module that imports torchax itself (test_jax_backend's importorskip, at collection, in every worker)
    leaves torch.accelerator taking torchax's ``jax`` device for an accelerator with streams, and Dynamo on torch
    2.14 then fails in every later in-process inductor test of that worker. An xbridge process imports torchax only
    through the jax backend, which corrects that first (backends/jaxjit/patches.py): so does each test here."""
    if "torchax" in sys.modules:
        from xbridge.backends.jaxjit import patches

        patches.keep_dynamo_tracing()


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


# Each test's seconds in the last full serial run (bench/suite_time.py --durations, docs/testing.md): a test measured
# over SLOW_S is slow whether or not it says so (make test-fast leaves it out), and pytest-xdist's workers get the
# longest tests first. A test not in the file keeps its own markers and counts as 0 s.
DURATIONS = json.loads((Path(__file__).parent / "durations.json").read_text())
SLOW_S = 2.0


@pytest.hookimpl(tryfirst=True)     # before -m deselects by the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if DURATIONS.get(item.nodeid, 0.0) > SLOW_S and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)
    if importlib.util.find_spec("torch_xla") is None:     # .venv: these run in .venv-xla (scripts/test.sh)
        elsewhere = [item for item in items if item.get_closest_marker("xla_env") is not None]
        if elsewhere:
            config.hook.pytest_deselected(items=elsewhere)
            items[:] = [item for item in items if item.get_closest_marker("xla_env") is None]
    if _WORKER:     # every worker sorts alike, as xdist requires: the same collection everywhere
        items.sort(key=lambda item: -DURATIONS.get(item.nodeid, 0.0))
