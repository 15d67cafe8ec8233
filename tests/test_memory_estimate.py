"""``xbridge inspect``'s memory per device: parameters, gradients and optimizer state from the plan, and the
activations autograd keeps, measured on the meta device; checked against what a real eager step keeps on this
CPU (flash attention and the math path, remat none and full), byte for byte."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers import FIXTURES, PROGRAMS, xbridge_here
from xbridge.data.source import checked_batch
from xbridge.program_file import load_program
from xbridge.torch import memory_estimate, remat
from xbridge.torch.train import batch_to_torch, build_model, split_micro
from xbridge.torch.weights import initial_weights


def _with_remat(program, choice):
    return program.replace(step=dataclasses.replace(program.step, remat=choice))


def _kept_by_eager(program, batch, kernel):
    """What autograd keeps in a real forward on the CPU, counted as the estimate counts."""
    model = build_model(program, initial_weights(program), torch.device("cpu"))
    model.train()
    remat.apply(model, program, remat.torch_checkpoint(program.step.remat))
    counter = memory_estimate._Saved(model, 4)
    micro = split_micro(batch_to_torch(batch, torch.device("cpu"), program.precision), program.step.grad_accum)[0]
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), sdpa_kernel(kernel):
        program.loss(model, micro)
    return counter.total


@pytest.mark.parametrize("name,choice", [("gpt.py", "none"), ("gpt.py", "full"), ("moe.py", "none")])
def test_the_estimate_is_what_an_eager_step_keeps(name, choice):
    program = _with_remat(load_program(str(PROGRAMS / name)), choice)
    batch = checked_batch(program.data, 0, program.seed)
    found = memory_estimate.saved_bytes(program, batch)
    assert found.fused == _kept_by_eager(program, batch, SDPBackend.FLASH_ATTENTION)
    assert found.math == _kept_by_eager(program, batch, SDPBackend.MATH)
    if choice == "none":
        assert found.math > found.fused and found.layer == 0      # the S x S probabilities
    else:
        assert found.layer > 0


def _inspect(*args):
    proc = xbridge_here("inspect", *args, "--format", "json")     # the command in this process: no start-up
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_inspect_reports_each_part_per_device():
    gpt = str(PROGRAMS / "gpt.py")
    one = _inspect(gpt)["memory"]
    info = _inspect(gpt, "--devices", "4", "--mesh", "data=2,model=2")
    four = info["memory"]
    shard_elements = sum(math.prod(p["shard_shape"]) for p in info["plan"]["params"])
    assert four["params"] == info["plan"]["bytes_per_device"] == four["grads"] == shard_elements * 4
    assert four["optimizer"] == 2 * shard_elements * 4                       # AdamW: exp_avg, exp_avg_sq
    assert four["activations"] == one["activations"] // 2                    # the batch in 2 row blocks
    assert four["total"] == sum(four[k] for k in ("params", "grads", "optimizer", "activations", "recompute"))
    full = _inspect(gpt, "--remat", "full")["memory"]
    assert full["activations"] < one["activations"] / 4 and full["recompute"] > 0 and full["remat"] == "full"
    mlp = _inspect(str(PROGRAMS / "mlp.py"))["memory"]
    assert mlp["optimizer"] == mlp["params"]                                 # SGD: one momentum buffer
    frozen = _inspect(str(FIXTURES / "frozen.py"))["memory"]
    assert frozen["grads"] < frozen["params"]                                # frozen parameters get no gradient
