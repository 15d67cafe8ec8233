"""The scanned layers' parameters held stacked (xbridge/torch/layer_stacks.py, xbridge/torch/layer_stacks.py): the
torch train step that xla runs, checked on the CPU with the scan as its Python loop, against the same model with its
parameters per layer: the same losses, state under the eager names in the model's order, optimizer state that
crosses both ways, and a non-finite gradient named by its layer."""

from __future__ import annotations

import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xbridge.torch.layer_scan import LayerScan  # noqa: E402
from xbridge.torch.layer_stacks import LayerStacks, StackedParams  # noqa: E402
from xbridge.torch.train import TrainStep, batch_to_torch, build_model  # noqa: E402
from xbridge.torch.weights import initial_weights, tensor_to_numpy  # noqa: E402


class _LoopScan(LayerScan):
    def scan(self, hidden, rest, kwargs):
        return self.loop(hidden, rest, kwargs)


@pytest.fixture()
def program(tiny_gpt):
    gpt = sys.modules[tiny_gpt.loss.__module__]
    return tiny_gpt.replace(model=lambda: gpt.GPT(vocab=256, dim=32, layers=4, heads=2, seq=32))


def _steps(program, stacked, weights=None):
    cpu = torch.device("cpu")
    model = build_model(program, initial_weights(program) if weights is None else weights, cpu)
    held = None
    if stacked:
        scanner = _LoopScan("blocks", model.blocks)
        specs = {n: (None,) * p.dim() for n, p in model.named_parameters()}
        held = StackedParams.hold(model, scanner, specs, lambda tensor, spec: None)
    return model, TrainStep(program, model, cpu, stacked=held), held


def _batch(program, step):
    return batch_to_torch(program.data.batch(step, program.seed), torch.device("cpu"), program.precision)


def test_stacked_parameters_train_as_the_per_layer_ones(program):
    plain_model, plain, _ = _steps(program, stacked=False)
    model, step, held = _steps(program, stacked=True)
    assert "blocks.*.q.weight" in dict(step.named_parameters()) and held.held["blocks.*.q.weight"].shape == (4, 32, 32)
    assert not any(n.startswith("blocks.2.") for n, _ in model.named_parameters())     # each weight held once
    for i in range(3):
        a, b = plain(_batch(program, i)), step(_batch(program, i))
        np.testing.assert_allclose([float(b[0]), float(b[1])], [float(a[0]), float(a[1])], rtol=1e-6)

    want = {n: tensor_to_numpy(v) for n, v in plain_model.state_dict().items()}
    got = held.state_dict(tensor_to_numpy)
    assert list(got) == list(want)                      # the eager names, in the model's order
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    exported, reference = step.export_state(), plain.export_state()
    assert set(exported) == set(reference) and "optim/blocks.3.up.weight/exp_avg_sq" in exported
    for name in reference:
        if name.startswith("optim/"):
            np.testing.assert_allclose(exported[name], reference[name], rtol=1e-4, atol=1e-9, err_msg=name)

    # the per-layer state loads into a stacked step (and the stacked into a per-layer one): the next steps agree
    _, fresh, _ = _steps(program, stacked=True, weights=want)
    fresh.import_state(reference)
    _, back, _ = _steps(program, stacked=False, weights=got)
    back.import_state(exported)
    losses = [float(s(_batch(program, 3))[0]) for s in (plain, fresh, back)]
    np.testing.assert_allclose(losses[1:], [losses[0]] * 2, rtol=1e-6)


def test_a_nonfinite_gradient_is_named_by_its_layer(program):
    _, step, held = _steps(program, stacked=True)
    step(_batch(program, 0))
    assert step.nonfinite_grads() == []
    held.held["blocks.*.up.weight"].grad[2, 0, 0] = float("nan")
    assert step.nonfinite_grads() == ["blocks.2.up.weight"]


def test_what_is_not_stacked():
    """Only parameters trained, untied, planned alike and not scalars in every layer form a group."""
    shapes = {f"b.{i}.{n}": s for i in range(2) for n, s in (("w", (2, 2)), ("s", ()), ("t", (2,)), ("p", (2,)))}
    specs = {n: ("model", None) if n == "b.1.p" else (None,) for n in shapes}
    trained = [n for n in shapes if n != "b.0.t"]
    stacks = LayerStacks.build("b", 2, ["w", "s", "t", "p"], trained, specs, shapes, aliased=set())
    assert list(stacks.groups) == ["b.*.w"]
    entries = {"optim/b.*.w/exp_avg": np.arange(8.0).reshape(2, 2, 2), "optim/b.*.w/step": np.array(3.0),
               "optim/x/step": np.array(1.0)}
    flat = stacks.unstack_entries(entries)
    assert sorted(flat) == ["optim/b.0.w/exp_avg", "optim/b.0.w/step", "optim/b.1.w/exp_avg", "optim/b.1.w/step",
                            "optim/x/step"]
    again = stacks.stack_entries(flat, {"b.*.w": (2, 2)}, np.stack)
    assert sorted(again) == sorted(entries) and all(np.array_equal(again[k], entries[k]) for k in entries)
    del flat["optim/b.1.w/exp_avg"]
    with pytest.raises(KeyError, match="optim/b.1.w/exp_avg"):
        stacks.stack_entries(flat, {"b.*.w": (2, 2)}, np.stack)
