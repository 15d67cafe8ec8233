"""Which attention kernel ran, per backend, from the operators that carried each call out (not from a table), and a
forced kernel that runs or is refused before the first step."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from helpers import FIXTURES, PROGRAMS, one_error_line, run_cli
from xbridge.program_file import load_program
from xbridge.run.loop import RunOptions, run

LAYERED = str(FIXTURES / "layered.py")


def _step(program, **changes):
    return program.replace(step=dataclasses.replace(program.step, **changes))


def _kernels(program, target="eager-cpu", steps=2):
    record = run(program, target, RunOptions(steps=steps, warmup=1))
    return record.summary.attention, [s.loss for s in record.steps]


def test_each_call_is_named_by_the_kernel_torch_ran(tiny_gpt, mlp_program):
    assert _kernels(tiny_gpt)[0] == {"flash (CPU)": 2}          # CPU flash: no mask, no dropout
    layered = load_program(LAYERED)                              # dropout 0.1 on the attention weights
    assert _kernels(_step(layered, rng="native"))[0] == {"math": 3}     # no fused CPU kernel takes dropout
    assert _kernels(layered)[0] == {"math (--rng portable dropout)": 3}  # drawn by the portable generator
    assert _kernels(mlp_program)[0] == {}                        # no attention at all


def test_a_forced_kernel_is_the_one_that_runs(tiny_gpt):
    auto, auto_losses = _kernels(tiny_gpt)
    math, math_losses = _kernels(_step(tiny_gpt, attention="math"))
    flash, _ = _kernels(_step(tiny_gpt, attention="flash"))
    assert (auto, math, flash) == ({"flash (CPU)": 2}, {"math": 2}, {"flash (CPU)": 2})
    np.testing.assert_allclose(math_losses, auto_losses, rtol=1e-5)     # two kernels, one attention


def test_jax_reports_torchax_lowering(tiny_gpt):
    pytest.importorskip("torchax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")
    assert _kernels(tiny_gpt, "jax-cpu")[0] == {"math (torchax reference, XLA)": 2}
    assert _kernels(_step(tiny_gpt, attention="math"), "jax-cpu")[0] == {"math (torchax reference, XLA)": 2}


def _attention_case(case, length=6):
    """Random inputs of one attention call (torch tensors) and its keyword arguments, for ``case``."""
    import torch

    gen = torch.Generator().manual_seed(0)
    kv_heads = 2 if case == "grouped_query" else 4
    q = torch.randn(2, 4, length, 8, generator=gen, dtype=torch.float32)
    k, v = (torch.randn(2, kv_heads, length, 8, generator=gen, dtype=torch.float32) for _ in range(2))
    kwargs: dict = {"is_causal": case in ("causal", "long"), "enable_gqa": case == "grouped_query",
                    "scale": 0.3 if case == "scale" else None}
    if case == "bool_mask":
        kwargs["attn_mask"] = torch.rand(length, length, generator=gen) > 0.3
        kwargs["attn_mask"][:, 0] = True                      # every row attends somewhere
    if case == "float_mask":
        kwargs["attn_mask"] = torch.randn(2, 1, length, length, generator=gen, dtype=torch.float32)
    cotangent = torch.randn(2, 4, length, 8, generator=gen, dtype=torch.float32)
    return (q, k, v), kwargs, cotangent


def _matches_torch(inputs, kwargs, cotangent, attention, rtol, atol):
    """``attention(q, k, v, mask)`` in JAX, forward and the three input gradients, against torch's own."""
    import jax
    import torch.nn.functional as F

    leaves = [t.clone().requires_grad_() for t in inputs]
    expected = F.scaled_dot_product_attention(*leaves, **kwargs)
    expected.backward(cotangent)
    kwargs = dict(kwargs)
    mask = kwargs.pop("attn_mask", None)
    jmask = None if mask is None else jax.numpy.asarray(mask.numpy())
    out, pullback = jax.vjp(lambda *qkv: attention(*qkv, jmask, **kwargs),
                            *(jax.numpy.asarray(t.numpy()) for t in inputs))
    grads = pullback(jax.numpy.asarray(cotangent.numpy()))
    np.testing.assert_allclose(np.asarray(out), expected.detach().numpy(), rtol=rtol, atol=atol)
    for got, leaf in zip(grads, leaves):
        np.testing.assert_allclose(np.asarray(got), leaf.grad.numpy(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", ["causal", "bool_mask", "float_mask", "grouped_query", "scale"])
def test_jax_routes_attention_to_jax_nn_as_torch_computes_it(case):
    """The translation behind --attention cudnn on jax (torch's layout, masks, grouped-query heads and scale into
    jax.nn.dot_product_attention), run through its XLA implementation, which CPUs have: forward and the three input
    gradients equal torch's own attention on random inputs (cuDNN itself needs an NVIDIA GPU)."""
    pytest.importorskip("torchax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")
    import functools

    from xbridge.backends.jaxjit.attention import dot_product_attention

    # float32 on both sides (JAX's XLA attention takes its softmax in float32 whatever the input dtype)
    _matches_torch(*_attention_case(case), functools.partial(dot_product_attention, implementation="xla"),
                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["causal", "bool_mask", "float_mask", "grouped_query", "scale", "long"])
def test_jax_routes_attention_to_the_pallas_tpu_kernel_as_torch_computes_it(case):
    """The translation behind --attention flash on jax-tpu, run through the Pallas TPU flash attention kernel itself
    in Pallas's TPU interpret mode (the kernel's own program, executed on the CPU): forward and the three input
    gradients equal torch's attention. One tile of 128 positions each way, and ``long``: 256 positions, two tiles
    each way, causal (the tile above the diagonal skipped)."""
    pytest.importorskip("torchax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")
    from jax.experimental.pallas import tpu as pltpu

    from xbridge.backends.jaxjit.attention import pallas_flash_attention

    with pltpu.force_tpu_interpret_mode():
        _matches_torch(*_attention_case(case, length=256 if case == "long" else 128), pallas_flash_attention,
                       rtol=2e-5, atol=2e-5)


@pytest.mark.xla_env
@pytest.mark.parametrize("case", ["bool_mask", "float_mask", "grouped_query", "scale", "long"])
def test_xla_hands_the_pallas_kernel_what_torch_computes(case):
    """The translation behind --attention flash on xla-tpu (backends/xlaspmd/attention.flash_inputs: torch tensors
    as torch_xla's flash_attention takes them), handed to the Pallas TPU kernel that torch_xla's custom call wraps,
    run in Pallas's TPU interpret mode: its output equals torch's attention (the custom call itself needs a TPU)."""
    import jax.numpy as jnp
    import torch.nn.functional as F
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas

    from xbridge.backends.xlaspmd.attention import flash_inputs

    (query, key, value), kwargs, _ = _attention_case(case, length=256 if case == "long" else 128)
    expected = F.scaled_dot_product_attention(query, key, value, **kwargs)
    q, k, v, ab, scale = flash_inputs(query, key, value, kwargs.get("attn_mask"), kwargs["scale"])
    with pltpu.force_tpu_interpret_mode():
        out = pallas.flash_attention(*(jnp.asarray(t.numpy()) for t in (q, k, v)),
                                     None if ab is None else jnp.asarray(ab.numpy()), causal=kwargs["is_causal"],
                                     sm_scale=scale)
    np.testing.assert_allclose(np.asarray(out).reshape(expected.shape), expected.numpy(), rtol=2e-5, atol=2e-5)


def test_the_pallas_kernel_refuses_what_it_cannot_tile():
    pytest.importorskip("torchax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")
    import jax.numpy as jnp

    from xbridge.backends.jaxjit.attention import pallas_flash_attention
    from xbridge.errors import ConfigError

    q = jnp.zeros((1, 2, 200, 8))
    with pytest.raises(ConfigError, match="this attention call has sequences of 200/200 and head dims of 8/8"):
        pallas_flash_attention(q, q, q)
    with pytest.raises(ConfigError, match="takes no dropout, and this attention call has dropout_p=0.1"):
        pallas_flash_attention(q, q, q, dropout_p=0.1)


def test_xla_reports_the_math_form_and_refuses_a_fused_kernel():
    """From .venv, the runs go to .venv-xla (xbridge/environments.py)."""
    proc = run_cli("run", LAYERED, "--backend", "xla-cpu", "--steps", "2", "--rng", "native", "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["summary"]["attention"] == {"math (XLA)": 3}
    proc = run_cli("run", str(PROGRAMS / "gpt.py"), "--backend", "xla-cpu", "--attention", "flash", "--steps", "2")
    assert proc.returncode == 2
    assert one_error_line(proc) == ("error: StepOptions attention='flash' is not available on xla-cpu: torch_xla's "
                                    "Pallas flash attention kernel (torch_xla.experimental.custom_kernel."
                                    "flash_attention) runs on TPUs only; use attention='auto' or 'math' here, or the "
                                    "target xla-tpu")
