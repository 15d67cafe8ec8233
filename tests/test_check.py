"""``xbridge check``: each construct of tests/fixtures/check_constructs.py found with its line and the verdict it
gives each target, a program with none clean everywhere, and the verdicts held against what a run does."""

from __future__ import annotations

import json

import pytest

from helpers import FIXTURES, PROGRAMS, one_error_line, run_cli

pytestmark = pytest.mark.cli
FIXTURE = FIXTURES / "check_constructs.py"
TARGETS = "eager-cpu,inductor-cpu,jax-cpu,xla-cpu"


def check(program: str, *args: str, targets: str = TARGETS) -> dict:
    proc = run_cli("check", program, "--backends", targets, "--format", "json", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def verdicts(record: dict) -> dict[str, str]:
    return {row["target"]: row["verdict"] for row in record["targets"]}


def findings(record: dict, target: str, severity: str) -> list[dict]:
    row = next(row for row in record["targets"] if row["target"] == target)
    return [f for f in row["findings"] if f["severity"] == severity]


def test_a_program_with_nothing_to_say_is_clean_on_every_target():
    record = check(str(PROGRAMS / "gpt.py"), "--backends", TARGETS + ",jax-tpu", "--devices", "4", "--mesh",
                   "data=-1,model=2")
    assert verdicts(record) == dict.fromkeys([*TARGETS.split(","), "jax-tpu"], "runs")
    assert record["traced_on"] == "meta" and record["mesh"] == {"data": 2, "model": 2}
    names = {op["name"] for op in record["operators"]}
    assert {"aten::mm", "aten::native_layer_norm", "aten::embedding_dense_backward"} <= names
    for row in record["targets"]:
        assert row["operators"].get("missing", 0) == 0 and row["operators"].get("host", 0) == 0, row
        assert sum(row["operators"].values()) == len(record["operators"])
    assert record["memory"]["total"] > record["memory"]["params"] > 0
    # the GPT's rules shard its projections; what no rule names (the position table, the norms) is replicated
    assert "pos" in record["unmatched"] and "blocks.0.q.weight" not in record["unmatched"]


def test_an_operator_one_stack_has_no_kernel_for():
    """torch.cdist(p=1): its backward has no torch_xla kernel (the CPU runs it, at every step); JAX differentiates
    the forward itself and never calls it."""
    record = check(f"{FIXTURE}:prototypes")
    assert verdicts(record) == {"eager-cpu": "runs", "inductor-cpu": "runs", "jax-cpu": "runs",
                                "xla-cpu": "runs-slow"}
    (slow,) = findings(record, "xla-cpu", "slow")
    assert slow["what"] == "aten::_cdist_backward" and "its inputs go to the host" in slow["why"]


def test_a_function_the_stack_lowers_whole_is_not_looked_up_by_its_operators():
    """torchax runs torch.linalg.det as one JAX function (its function table is looked up before the aten one), so
    aten::_linalg_det, in no torchax table, never reaches it: jax runs it (a run trains, and is not refused)."""
    record = check(f"{FIXTURE}:volumes", "--backends", "jax-cpu")
    assert verdicts(record) == {"jax-cpu": "runs"}
    (det,) = [op for op in record["operators"] if op["name"] == "aten::_linalg_det"]
    assert det["functions"] == ["torch._C._linalg.linalg_det"] and det["forward"] == 1, det
    proc = run_cli("run", f"{FIXTURE}:volumes", "--backend", "jax-cpu", "--steps", "2", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [step["loss"] for step in json.loads(proc.stdout)["steps"]]
    assert len(losses) == 2 and all(loss == loss for loss in losses)


def test_a_write_through_a_mask_is_no_data_dependent_shape():
    """``h[h > 4] = 4`` keeps h's shape (torchax: jnp.where): jax runs it, and run does not refuse it."""
    record = check(f"{FIXTURE}:clamped", "--backends", "jax-cpu")
    assert verdicts(record) == {"jax-cpu": "runs"}
    proc = run_cli("run", f"{FIXTURE}:clamped", "--backend", "jax-cpu", "--steps", "2", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("name,what,line", [("host_read", "aten::_local_scalar_dense", 67),
                                            ("masked", "boolean mask (aten::index.Tensor)", 89)])
def test_a_value_or_a_shape_the_host_must_know(name, what, line):
    """Traced on the CPU (the meta device has no values); jax and xla's one-graph step cannot stop for it, Dynamo
    breaks the graph there. A run says the same (tests/test_jax_backend.py and tests/test_xla_backend.py: their
    refusals)."""
    record = check(f"{FIXTURE}:{name}")
    assert record["traced_on"] == "cpu" and record["meta_failure"]
    assert verdicts(record) == {"eager-cpu": "runs", "inductor-cpu": "runs-slow", "jax-cpu": "fails",
                                "xla-cpu": "fails"}
    for target in ("jax-cpu", "xla-cpu"):
        first = findings(record, target, "fails")[0]
        assert first["what"] == what and first["where"].endswith(f"check_constructs.py:{line})"), first
    row = next(row for row in record["targets"] if row["target"] == "jax-cpu")
    assert row["summary"].startswith(f"will not run: {what} in ")


def test_the_verdict_is_what_a_run_does():
    """check's "fails" on jax is the run's refusal before anything is compiled (xbridge/check/before_run.py), exit
    2, with check's own words."""
    proc = run_cli("run", f"{FIXTURE}:host_read", "--backend", "jax-cpu", "--steps", "2")
    line = one_error_line(proc)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert line.startswith("error: program 'host-read' cannot run on jax-cpu: aten::_local_scalar_dense in "), line
    assert "check_constructs.py:67)" in line and "which JAX traces without values" in line, line


def test_random_draws_under_either_generator():
    native = check(f"{FIXTURE}:dropout")
    assert verdicts(native) == {"eager-cpu": "runs", "inductor-cpu": "differs", "jax-cpu": "differs",
                                "xla-cpu": "differs"}
    assert native["draws"] == [{"module": "(model)", "op": "dropout", "portable": True}]
    assert "--rng portable draws the same bits" in findings(native, "jax-cpu", "differs")[0]["why"]
    assert verdicts(check(f"{FIXTURE}:dropout", "--rng", "portable")) == dict.fromkeys(TARGETS.split(","), "runs")
    refused = check(f"{FIXTURE}:alpha_dropout")
    assert verdicts(refused) == dict.fromkeys(TARGETS.split(","), "fails")
    assert findings(refused, "eager-cpu", "fails")[0]["why"].startswith("--rng portable refuses it")


def test_a_draw_the_portable_sampler_replaces_is_not_the_stacks_operator():
    """torch_xla has no kernel for Tensor.cauchy_ (its CPU fallback stops the one-graph step: xla fails under --rng
    native); under --rng portable xbridge's sampler draws there and the stack never sees the operator."""
    draws = str(FIXTURES / "portable_draws.py")
    native = findings(check(draws, targets="xla-cpu"), "xla-cpu", "fails")
    assert [f["what"] for f in native] == ["aten::cauchy_", "aten::log_normal_", "aten::geometric_"], native
    portable = check(draws, "--rng", "portable", targets="xla-cpu")
    assert verdicts(portable) == {"xla-cpu": "runs"}, portable["targets"]


def test_a_user_function_is_named_and_the_table_reads():
    proc = run_cli("check", str(FIXTURES / "backward_only.py"), "--backends", "jax-cpu,xla-cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "autograd.Function OffCpuScaled at " in proc.stdout and "backward_only.py:14" in proc.stdout
    assert "jax-cpu" in proc.stdout and "runs" in proc.stdout and "memory per device (estimate)" in proc.stdout


def test_bad_check_input():
    proc = run_cli("check", str(PROGRAMS / "mlp.py"), "--backends", "jax")
    assert proc.returncode == 2 and "--backends 'jax': give BACKEND-DEVICE" in one_error_line(proc)
