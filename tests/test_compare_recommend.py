"""compare's recommendation (xbridge/compare/recommend.py) over races whose figures are given: which target, why, the
command, the break-even step count, and the races that have none. The race itself: tests/test_compare.py."""

from __future__ import annotations

import shlex

import pytest

from xbridge.compare.recommend import recommend, run_command
from xbridge.compare.record import CompareRow, TargetMetrics

PROGRAM = "/home/me/prog.py"


def _row(target: str, step_ms: float, compile_s: float, dev: float | None = 0.0, limit: float = 1e-4,
         status: str = "ok", extra: tuple[str, ...] = ()) -> CompareRow:
    backend = target.split(":")[0]
    command = ["/venv/bin/python", "-m", "xbridge", "run", PROGRAM, "--backend", backend, "--steps", "20", "--warmup",
               "3", "--devices", "2", "--format", "json", "--out", f"/out/runs/{target}", *extra]
    if status != "ok":
        return CompareRow(target, 2, command, status, "exit code 1: RuntimeError: boom\ntraceback tail")
    metrics = TargetMetrics(
        compile_s=compile_s, compile_cache="cold", step_ms_median=step_ms, step_ms_p10=step_ms * 0.9,
        step_ms_p90=step_ms * 1.1, samples_per_s=1.0, tokens_per_s=1.0, achieved_tflops=1.0, peak_tflops=2.0,
        mfu=0.5, peak_source="measured", peak_host_rss_mib=100.0, device_peak_mib=None, recompiles=0,
        final_loss=2.0, max_loss_dev=dev, max_loss_dev_at="step 4", loss_parity=None if dev is None else dev <= limit)
    return CompareRow(target, 2, command, "ok", None, None, metrics, [2.0] * 20)


def test_the_fastest_target_within_the_limit_is_named_with_its_command_and_break_even():
    rows = [_row("eager-cpu", 100.0, 0.0), _row("inductor-cpu", 40.0, 30.0),
            _row("jax-cpu", 20.0, 12.0, dev=3e-2), _row("xla-cpu", 50.0, 8.0, extra=("--mesh", "data=-1"))]
    advice = recommend(rows, "eager-cpu", 20, "fp32", 1e-4)
    assert advice.target == "inductor-cpu"     # jax is faster but fails parity
    assert advice.speedup == pytest.approx(2.5)
    # 30 s more compile, 60 ms a step less: 500 steps repay it exactly; 501 is the first that is shorter overall
    assert advice.break_even_steps == 501
    assert advice.passing == ["inductor-cpu", "xla-cpu", "eager-cpu"]
    assert advice.excluded == {"jax-cpu": "fails parity: loss off by 3.00e-02 at step 4 (limit 1e-04)"}
    assert advice.command == f"xbridge run {PROGRAM} --backend inductor-cpu --devices 2"
    assert "2.50x" in advice.reason and "repaid from 501 steps on" in advice.reason
    assert "a run of this race's 20 steps is slower overall on it" in advice.reason


def test_a_compile_the_race_repays_and_one_that_costs_nothing():
    rows = [_row("eager-cpu", 100.0, 1.0), _row("xla-cpu", 50.0, 1.5, extra=("--mesh", "data=-1,model=2"))]
    advice = recommend(rows, "eager-cpu", 20, "bf16-mixed", 1e-2)
    assert advice.target == "xla-cpu" and advice.break_even_steps == 11
    assert "which this race's 20 steps repay" in advice.reason
    assert shlex.split(advice.command)[-2:] == ["--mesh", "data=-1,model=2"]     # the race's layout is kept
    quick = recommend([_row("eager-cpu", 100.0, 5.0), _row("jax-cpu", 50.0, 2.0)], "eager-cpu", 20, "fp32", 1e-4)
    assert quick.target == "jax-cpu" and quick.break_even_steps is None and "compile" not in quick.reason


def test_the_reference_when_it_is_fastest_and_none_when_nothing_else_passes():
    rows = [_row("eager-cpu", 10.0, 0.0), _row("jax-cpu", 20.0, 5.0)]
    advice = recommend(rows, "eager-cpu", 20, "fp32", 1e-4)
    assert advice.target == "eager-cpu" and advice.speedup == 1.0
    assert "the reference eager-cpu is the fastest" in advice.reason and "20.0 ms for jax-cpu" in advice.reason
    assert advice.command == f"xbridge run {PROGRAM} --backend eager-cpu --devices 2"
    rows = [_row("eager-cpu", 100.0, 0.0), _row("jax-cpu", 20.0, 5.0, dev=1.0), _row("xla-cpu", 0, 0, status="failed")]
    none = recommend(rows, "eager-cpu", 20, "fp32", 1e-4)
    assert none.target is None and none.command is None and none.passing == ["eager-cpu"]
    assert none.reason.startswith("no target but the reference eager-cpu passes parity at fp32 (jax-cpu fails parity")
    assert none.excluded["xla-cpu"] == "failed: exit code 1: RuntimeError: boom"


def test_no_recommendation_without_a_reference_that_finished():
    rows = [_row("eager-cpu", 0, 0, status="timeout"), _row("jax-cpu", 20.0, 5.0, dev=None)]
    advice = recommend(rows, "eager-cpu", 20, "fp32", 1e-4)
    assert advice.target is None
    assert advice.reason == ("no recommendation: the reference eager-cpu did not finish (exit code 1: RuntimeError: "
                             "boom), so no target's losses could be checked")


def test_the_command_keeps_a_variant_and_the_run_options_and_drops_compares_own():
    child = ["/v/python", "-m", "xbridge", "run", "my prog.py:small", "--backend", "xla-cpu", "--xla-mode", "openxla",
             "--steps", "6", "--warmup", "2", "--devices", "4", "--format", "json", "--out", "/o/runs/x",
             "--precision", "bf16-mixed", "--rng", "portable", "--tensorboard", "/tb/x", "--processes", "2",
             "--profile", "steps=3:5"]
    assert run_command(child, "xla-cpu:xla-mode=openxla") == (
        "xbridge run 'my prog.py:small' --backend xla-cpu --xla-mode openxla --devices 4 --precision bf16-mixed "
        "--rng portable --processes 2")
    # a target raced in another environment (its child started there with the bare target) names the environment
    there = ["/venv-xla/python", "-m", "xbridge", "run", "gpt.py", "--backend", "inductor-cpu", "--steps", "20"]
    assert run_command(there, "inductor-cpu@xla") == "xbridge run gpt.py --backend inductor-cpu@xla"
