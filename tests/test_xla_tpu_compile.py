"""``xbridge compile --backend xla-tpu``: the steady-state train step torch_xla builds for the MLP, traced on virtual CPU
devices and compiled for a v5e-4 by libtpu's compile-only client (backends/xlaspmd/ahead_of_time.py), through the
CLI. Two compiles, about 30 s each on two cores. From .venv the command goes to .venv-xla, where torch_xla is
(xbridge/environments.py)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN, EVAL = "train step", "evaluation"


@functools.cache
def compiled(mesh: str | None) -> dict:
    cmd = [sys.executable, "-m", "xbridge", "compile", str(ROOT / "programs" / "mlp.py"), "--backend", "xla-tpu",
           "--topology", "v5e-4", "--format", "json", *(["--mesh", mesh] if mesh else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.cli
def test_the_train_step_compiles_per_chip_with_its_collectives_and_donation():
    report = compiled(None)
    assert report["target"] == "xla-tpu" and report["mesh"] == {"data": 4, "model": 1}
    assert report["topology"]["chips"] == 4 and report["versions"]["torch_xla"]
    train = report["per_chip"][TRAIN]
    assert train["refused"] is None and train["fits"]
    assert train["need_bytes"] > 0 and train["argument_bytes"] > 0 and train["code_bytes"] > 0
    assert train["flops"] > 0
    # the batch is split four ways: the gradients are all-reduced
    assert train["collectives"].get("all-reduce", {}).get("count", 0) >= 1
    # the steady-state step: the parameters and the momentum are donated (torch_xla's buffer_donor, restored)
    assert train["alias_bytes"] > 0.9 * (train["argument_bytes"] - 64 * 64 * 4)
    assert "initialisation" not in report["per_chip"]      # torch_xla has no program for it
    assert report["per_chip"][EVAL]["need_bytes"] > 0


@pytest.mark.slow
@pytest.mark.cli
def test_a_split_model_shrinks_the_parameters_per_chip():
    whole, split = compiled(None)["per_chip"][TRAIN], compiled("data=-1,model=2")["per_chip"][TRAIN]
    assert compiled("data=-1,model=2")["mesh"] == {"data": 2, "model": 2}
    # fc1 and fc2 (most of the MLP) are split over model=2: the parameters and their momentum about halve, while the
    # batch a chip gets doubles (64 x 65 numbers over 2 instead of 4)
    assert split["argument_bytes"] < 0.7 * whole["argument_bytes"]
    assert split["alias_bytes"] < 0.7 * whole["alias_bytes"]


def test_the_donated_parameters_are_read_from_the_module_header():
    from xbridge.backends.xlaspmd.ahead_of_time import donors

    header = ("HloModule xbridge-mlp.412, buffer_donor={ (0, {}), (2, {}), (10, {}) }, "
              "entry_computation_layout={(f32[16]{0}, f32[16]{0})->(f32[])}\n\nENTRY %main {}")
    assert donors(header) == [0, 2, 10]
    assert donors("HloModule SyncTensorsGraph.12, entry_computation_layout={()->(f32[])}\n") == []
