"""xb.LossSum: a loss normalised by a count the data decides (only some rows labelled, a masked-LM mean) is the same
loss however the batch is split: over micro-batches (here, in-process), over devices and processes (the CLI tests,
every backend at 4 devices); without it, parity names the cause on the backends that average per-device losses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import ROOT, one_error_line, run_cli
from xbridge.program_file import load_program
from xbridge.torch.loss_split import split_losses
from xbridge.torch.train import TrainStep, batch_to_torch, build_model
from xbridge.torch.weights import initial_weights

COUNTED = str(ROOT / "tests" / "fixtures" / "counted_loss.py")


def _train(program, accum: int, steps: int = 3) -> tuple[list[float], dict[str, np.ndarray]]:
    import xbridge as xb

    program = program.replace(step=xb.StepOptions(grad_accum=accum))
    model = build_model(program, initial_weights(program), torch.device("cpu"))
    step = TrainStep(program, model, torch.device("cpu"))
    losses = [float(step(batch_to_torch(program.data.batch(s, program.seed), torch.device("cpu"),
                                        program.precision))[0]) for s in range(steps)]
    return losses, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def test_a_loss_sum_is_the_same_loss_over_any_number_of_micro_batches():
    program = load_program(COUNTED)
    one, params_one = _train(program, 1)
    four, params_four = _train(program, 4)
    np.testing.assert_allclose(four, one, rtol=1e-6)
    for name in params_one:
        np.testing.assert_allclose(params_four[name], params_one[name], rtol=1e-5, atol=1e-7)
    # the step's loss is the batch's total over its count, as the user would compute it by hand
    model = build_model(program, initial_weights(program), torch.device("cpu"))
    batch = program.data.batch(0, program.seed)
    with torch.no_grad():
        logits = model(torch.from_numpy(batch["x"]))
    labels = torch.from_numpy(batch["y"])
    by_hand = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    assert abs(one[0] - float(by_hand)) < 1e-6


def test_a_mean_over_each_micro_batch_is_not():
    """The same check on the mean loss fails: the test above can tell the two apart."""
    program = load_program(f"{COUNTED}:program_mean")
    one, _ = _train(program, 1)
    four, _ = _train(program, 4)
    assert abs(four[0] - one[0]) / one[0] > 1e-4


def test_the_split_check_tells_a_mean_from_a_loss_sum():
    for name, splits in (("program", True), ("program_mean", False)):
        program = load_program(f"{COUNTED}:{name}")
        found = split_losses(program, initial_weights(program), 4)
        assert (abs(found.split - found.whole) < 1e-6 * found.whole) is splits, (name, found)
        assert (found.worst_gradient()[1] < 1e-5) is splits, (name, found.worst_gradient())


@pytest.mark.cli
@pytest.mark.parametrize("target", ["eager-cpu", "jax-cpu"])
def test_a_loss_that_is_not_a_scalar_is_named(tmp_path, target):
    program = tmp_path / "vector_loss.py"
    program.write_text(
        "import torch.nn.functional as F\nfrom torch import nn\nimport xbridge as xb\n\n"
        "def loss(model, batch):\n"
        "    return xb.LossSum(F.cross_entropy(model(batch['x']), batch['y'], reduction='none'), 64)\n\n"
        "program = xb.Program(name='vector-loss', model=lambda: nn.Linear(64, 10), loss=loss,\n"
        "                     data=xb.data.Digits(batch_size=64), optimizer=xb.SGD(lr=0.1))\n")
    proc = run_cli("run", str(program), "--backend", target, "--steps", "2", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert one_error_line(proc) == ("error: the loss of program 'vector-loss' must return a 0-d tensor or "
                                    "xb.LossSum(total, count), got xb.LossSum whose total has shape (64,) (it must "
                                    "be a 0-d tensor)")


def _parity(tmp_path, program, backends, devices="4"):
    proc = run_cli("parity", program, "--devices", devices, "--steps", "4", "--backends", backends, "--jobs", "2",
                   "--format", "json", "--out", str(tmp_path))
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, {row["target"]: row for row in json.loads(proc.stdout)["targets"]}


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.cli
def test_a_loss_sum_matches_at_four_devices_on_every_backend(tmp_path):
    """Two micro-batches of 16 rows over 4 devices: each device's count differs; inductor's 4 ranks, jax's GSPMD and
    shard_map and torch_xla SPMD all take the global total over the global count."""
    code, rows = _parity(tmp_path, COUNTED, "inductor-cpu,jax-cpu,jax-cpu:sharding-mode=shard_map,xla-cpu")
    assert code == 0 and all(r["verdict"] == "pass" and r["devices"] == 4 for r in rows.values()), rows


@pytest.mark.slow
@pytest.mark.cli
def test_a_mean_loss_on_a_backend_that_averages_devices_fails_with_its_cause(tmp_path):
    code, rows = _parity(tmp_path, f"{COUNTED}:program_mean", "jax-cpu,jax-cpu:sharding-mode=shard_map")
    assert code == 1
    assert rows["jax-cpu"]["verdict"] == "pass" and "cause" not in rows["jax-cpu"]        # the global batch's loss
    local = rows["jax-cpu:sharding-mode=shard_map"]
    assert local["verdict"] == "FAIL" and local["first_failing_step"] == 0
    assert local["cause"].startswith("the loss does not survive a split batch: step 0's batch gives ")
    assert "as the mean of its 4 shards' losses" in local["cause"] and "xb.LossSum(total, count)" in local["cause"]


@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.parametrize("target", ["inductor-cpu", "xla-cpu"])
def test_a_step_whose_count_is_zero_is_one_line_on_the_compiled_torch_stacks(target):
    """The count comes back with the step's loss on every backend (eager and jax: tests/test_bad_input.py)."""
    proc = run_cli("run", f"{COUNTED}:no_labels", "--backend", target, "--steps", "3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert one_error_line(proc).startswith("error: step 1: the loss's xb.LossSum count is 0 over the whole batch")
