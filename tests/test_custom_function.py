"""A user's own ``torch.autograd.Function`` (issue 39, item 1): on jax its forward and backward are one
``jax.custom_vjp`` (backends/jaxjit/custom_functions.py), so the user's gradient is the one trained with, as on
eager, inductor and xla. The programs are tests/fixtures/custom_functions.py: a straight-through estimator, a
gradient reversal, a Function saving several tensors with a non-tensor scale, a ``setup_context`` Function with an
``@once_differentiable`` backward, one that marks an output non-differentiable, and a backward that reads
``.item()`` (refused with one line naming the Function)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from helpers import FIXTURES, error_line, run_cli
from xbridge.environments import describe_all
from xbridge.errors import LoweringError
from xbridge.parity import policy as parity
from xbridge.run.loop import RunOptions
from xbridge.run.prepare import prepare
from xbridge.run.steps import train

jax = pytest.importorskip("jax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")
torchax = pytest.importorskip("torchax", reason="the jax backend needs torchax (scripts/setup.sh installs it)")
torch = pytest.importorskip("torch", reason="the jax backend lowers torch programs (pip install 'xbridge[jax]')")

from xbridge.backends.jaxjit import patches  # noqa: E402
from xbridge.program_file import load_program  # noqa: E402

# torchax's max(dim) asks jax for an int64 index (JAX runs without x64: int32, as documented)
pytestmark = pytest.mark.filterwarnings("ignore:Explicitly requested dtype:UserWarning")
FIXTURE = FIXTURES / "custom_functions.py"
user = sys.modules[load_program(f"{FIXTURE}:program").model.__module__]      # the user's module: its Functions
PROGRAMS = ["straight_through", "gradient_reversal", "scaled_linear", "once_differentiable_clamp", "max_with_index"]


def torch_grads(fn, *inputs):
    """Eager torch: the gradients of ``fn(*inputs)`` (a scalar) with respect to its float inputs."""
    tensors = [torch.tensor(x, requires_grad=np.issubdtype(x.dtype, np.floating)) for x in inputs]
    fn(*tensors).backward()
    return [None if t.grad is None else t.grad.numpy() for t in tensors if t.requires_grad]


def jax_grads(fn, *inputs, routed=True):
    """jax.grad of ``fn`` run by torchax, as the jax backend traces a loss: with the Functions routed to a custom_vjp
    for the trace (``routed``), or as torchax alone runs them."""
    env = torchax.default_env()
    floats = [i for i, x in enumerate(inputs) if np.issubdtype(x.dtype, np.floating)]

    def loss(arrays):
        values = [jax.numpy.asarray(x) for x in inputs]
        for i, a in zip(floats, arrays):
            values[i] = a
        with env, (patches.custom_functions() if routed else _nothing()):
            out = fn(*env.j2t_iso(values))
        return env.t2j_iso(out)

    key = env.param.prng      # a forward that draws leaves a key of the trace there (the executable restores it too)
    try:
        return [np.asarray(g) for g in jax.grad(loss)(tuple(jax.numpy.asarray(inputs[i]) for i in floats))]
    finally:
        env.param.prng = key


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _weights(*shape, seed=0):
    return np.random.default_rng([seed, *shape]).standard_normal(shape).astype(np.float32)


def test_before_the_change_jax_differentiated_the_straight_through_forward():
    """The defect: torchax ran the forward's operators and JAX differentiated round (zero almost everywhere); the
    user's backward (the identity) was never called. Routed, the gradient is the user's formula."""
    x, w = _weights(8, 16), _weights(4, 16)

    def fn(x, w):
        return (user.RoundSTE.apply(x, 4.0) @ w.t()).square().sum()

    quantised = np.round(x * 4.0) / 4.0
    formula = 2 * (quantised @ w.T) @ w       # d/dx through the identity: the user's gradient
    unrouted = jax_grads(fn, x, w, routed=False)[0]
    assert np.abs(unrouted).max() == 0.0      # what jax-cpu trained with before
    routed = jax_grads(fn, x, w)[0]
    np.testing.assert_allclose(routed, formula, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(routed, torch_grads(fn, x, w)[0], rtol=1e-5, atol=1e-5)


CASES = {
    "gradient reversal (a float argument)": (lambda x: (user.GradientReversal.apply(x, 0.5) ** 2).sum(), (8, 4)),
    "save_for_backward, a scale, needs_input_grad": (
        lambda x, w, b: ScaledSquare(user.ScaledLinear.apply(x, w, b, 0.5)), (8, 6), (5, 6), (5,)),
    "setup_context, defaults, @once_differentiable": (lambda x: (user.LeakyClamp.apply(x * 2, -0.5) ** 2).sum(),
                                                       (8, 4)),
    "a non-differentiable index output": (lambda x: _max_and_index(x), (4, 3, 8)),
}


def ScaledSquare(y):  # noqa: N802
    return (y * torch.arange(y.shape[-1], dtype=y.dtype, device=y.device)).square().sum()


def _max_and_index(x):
    values, index = user.MaxWithIndex.apply(x)
    return (values ** 2).sum() + (index.to(values.dtype) * values).sum()


@pytest.mark.parametrize("case", list(CASES))
def test_the_users_backward_gives_torchs_gradients(case):
    fn, *shapes = CASES[case]
    inputs = [_weights(*shape, seed=i) for i, shape in enumerate(shapes)]
    for got, want in zip(jax_grads(fn, *inputs), torch_grads(fn, *inputs), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ctx_corners_materialize_broadcast_none_and_a_random_forward():
    """``set_materialize_grads(False)`` gives None for an unused output, ``needs_input_grad`` is False for a
    constant, a gradient of a broadcast shape is summed
    to the input's, a None gradient is a zero, and a forward that draws (stochastic rounding) threads torchax's
    generator key out of the custom_vjp (no leaked tracer) while its gradient stays the user's."""
    seen, needs = [], []

    class Corners(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, bias):
            ctx.set_materialize_grads(False)
            noise = torch.rand_like(x)
            return torch.floor(x + noise) + bias, x * 0

        @staticmethod
        def backward(ctx, grad, unused):
            seen.append(unused)
            return grad * 3, grad         # the bias's gradient in the broadcast shape (8, 4)

    class NoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            needs.append(ctx.needs_input_grad)
            return x.sin()

        @staticmethod
        def backward(ctx, grad):
            return None

    def fn(x, b):
        y, _ = Corners.apply(x, b)
        # a draw after the Function reads the key it returned (a tracer of its own trace would fail here)
        return (y * 2).sum() + NoGrad.apply(b).sum() + NoGrad.apply(torch.zeros_like(b)).sum() \
            + 0 * torch.rand_like(b).sum()

    gx, gb = jax_grads(fn, _weights(8, 4), _weights(4))
    np.testing.assert_array_equal(gx, np.full((8, 4), 6.0, np.float32))
    np.testing.assert_array_equal(gb, np.full((4,), 16.0, np.float32))        # (8, 4) summed over the rows
    assert seen and all(s is None for s in seen)
    assert needs == [(True,), (False,)]        # a constant is not differentiated: needs_input_grad says so


def test_outside_a_traced_loss_apply_is_torchs_own():
    """The routing lasts while a loss is traced: torch's classmethod is put back, and an eager call inside the block
    (no torchax tensor) still goes to torch's autograd."""
    before = torch.autograd.Function.__dict__["apply"]
    with patches.custom_functions():
        assert torch.autograd.Function.__dict__["apply"] is not before
        x = torch.ones(3, requires_grad=True)
        user.GradientReversal.apply(x, 2.0).sum().backward()
    assert torch.autograd.Function.__dict__["apply"] is before
    assert x.grad.tolist() == [-2.0, -2.0, -2.0]


def _run(program, target, steps=3):
    prepared = prepare(program, target, RunOptions(steps=steps, warmup=1))
    return prepared, [r.loss for r in train(program, prepared, steps, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name", PROGRAMS)
def test_jax_trains_each_function_as_eager_does(name):
    """In-process parity on jax-cpu, fp32 policy, 3 steps (the parameter behind the Function included)."""
    program = getattr(user, name)
    ref, ref_losses = _run(program, "eager-cpu")
    got, losses = _run(program, "jax-cpu")
    tol = parity.tolerance(program.precision)
    loss_dev = parity.loss_deviation(ref_losses, losses, tol)
    param_dev = parity.param_deviation(ref.executable.state_dict(), got.executable.state_dict(), tol)
    assert loss_dev.ok, f"loss deviates {loss_dev.value:.3g} > {tol.loss_rtol} at {loss_dev.where}"
    assert param_dev.ok, f"parameter {param_dev.where} deviates {param_dev.value:.3g} > {tol.param_rtol}"


@pytest.mark.slow
@pytest.mark.cli
def test_parity_on_every_backend(tmp_path):
    """``xbridge parity`` of the five Functions in one model against eager on inductor-cpu and xla-cpu (they used
    the user's backward already; jax-cpu, which now does, is checked per Function in-process above)."""
    targets = ["inductor-cpu", "xla-cpu"]     # one process each, two at a time
    for row in describe_all():      # here, or in the environment that has it (.venv-xla)
        if row["target"] in targets and not row["available"]:
            pytest.skip(f"{row['target']} is unavailable here: {row['reason']}")
    proc = run_cli("parity", f"{FIXTURE}:every_function", "--backends", ",".join(targets),
                   "--steps", "3", "--jobs", "2", "--format", "json", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    assert sorted(row["target"] for row in record["targets"]) == sorted(targets)
    for row in record["targets"]:
        assert row["verdict"] == "pass", row


def test_a_backward_that_reads_a_value_is_refused_at_init_naming_the_function():
    """``.item()`` in a backward: one line naming the Function's class, file and line, raised while the executable
    traces the loss at init (before any step)."""
    with pytest.raises(LoweringError) as info:
        prepare(user.item_in_backward, "jax-cpu", RunOptions(steps=2, warmup=1))
    message = str(info.value)
    line = _line_of("limit = grad.abs().max().item()")
    assert "\n" not in message and info.value.exit_code == 1
    assert "the backward of torch.autograd.Function ItemInBackward (" in message
    assert f"custom_functions.py:{line})" in message and "ConcretizationTypeError" in message


@pytest.mark.slow
@pytest.mark.cli
def test_cli_refusal_is_one_error_line_exit_1(tmp_path):
    proc = run_cli("run", f"{FIXTURE}:item_in_backward", "--backend", "jax-cpu",
                   "--steps", "2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = error_line(proc)
    assert "torch.autograd.Function ItemInBackward" in line
    assert f"custom_functions.py:{_line_of('limit = grad.abs().max().item()')})" in line


def _line_of(text):
    lines = FIXTURE.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)
