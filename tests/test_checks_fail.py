"""Checks the product makes, shown to fail when they should: recompiles after warm-up are counted on every
compiling backend (not only xla, see test_xla_backend.py), and precision is asserted where it is applied: the
compiled graphs of bf16-mixed run their matmuls in bf16 on inductor and xla (jax: test_jax_backend.py), and the same
check reports float32 matmuls when autocast is not applied."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import PROGRAMS, ROOT, run_cli

pytestmark = [pytest.mark.cli, pytest.mark.slow]
HALF_BATCH_FIRST = ROOT / "tests" / "fixtures" / "half_batch_first.py"


@pytest.mark.parametrize("target,expected", [("jax-cpu", 1), ("inductor-cpu", None), ("eager-cpu", 0)])
def test_a_new_shape_after_warmup_is_a_counted_recompile(target, expected):
    proc = run_cli("run", str(HALF_BATCH_FIRST), "--backend", target, "--steps", "5", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)["summary"]
    if expected is None:        # Dynamo recompiles the loss (and the update) for the new batch size
        assert summary["recompiles_after_warmup"] >= 1, summary
        assert summary["recompile_reasons"] is not None
    else:
        assert summary["recompiles_after_warmup"] == expected, summary


# The matmul-like ops of a compiled graph and the dtype they run in.
# Inductor: the forward and backward graphs AOTAutograd hands it (fx_graph_readable.py / fx_graph_transformed.py),
# one line per op with its result annotated, e.g. `mm: "bf16[64, 256][256, 1]cpu" = torch.ops.aten.mm.default(...)`.
INDUCTOR_MATMUL = re.compile(r'"(\w+)\[[^"]*" = torch\.ops\.aten\.(mm|addmm|bmm|baddbmm)\.default\(')
# XLA: the HLO modules torch_xla hands to XLA (before XLA's own passes: XLA:CPU later computes bf16 dots in f32, a
# property of the CPU compiler, not of the precision policy), e.g. `%dot.3 = bf16[64,256]{1,0} dot(...)`.
XLA_DOT = re.compile(r"= (\w+)\[[^\]]*\](?:\{[^}]*\})? (dot|convolution)\(")


def matmul_dtypes(dump: Path, backend: str) -> dict[str, int]:
    """How many matmuls of each result dtype the dumped graphs of one run hold."""
    counts: dict[str, int] = {}
    if backend == "inductor":
        files, pattern = list(dump.rglob("fx_graph_readable.py")), INDUCTOR_MATMUL
    else:
        files, pattern = list(dump.rglob("*before_optimizations.txt")), XLA_DOT
    for path in files:
        for match in pattern.finditer(path.read_text(errors="replace")):
            counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


@pytest.mark.parametrize("target", ["inductor-cpu", "xla-cpu"])
def test_bf16_mixed_runs_matmuls_in_bf16_and_the_check_sees_fp32(tmp_path, target):
    seen = {}
    for precision in ("bf16-mixed", "fp32"):
        dump = tmp_path / precision
        proc = run_cli("run", str(PROGRAMS / "mlp.py"), "--backend", target, "--steps", "1", "--warmup", "0",
                       "--precision", precision, "--dump", str(dump))
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen[precision] = matmul_dtypes(dump, target.split("-")[0])
    assert seen["bf16-mixed"] and set(seen["bf16-mixed"]) == {"bf16"}, seen
    assert seen["fp32"] and set(seen["fp32"]) == {"f32"}, seen        # the check fails where autocast is absent
