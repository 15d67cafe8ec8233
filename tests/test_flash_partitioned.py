"""The Pallas TPU flash route over several devices (backends/jaxjit/attention.py): GSPMD cannot partition a Mosaic
kernel, so over a mesh the route wraps it in a shard_map. JAX refuses an unpartitioned Mosaic kernel while lowering
for a TPU, which needs no TPU and no libtpu (``lowering_platforms=("tpu",)`` over a CPU mesh): these tests lower for a
TPU on 4 of the session's CPU devices, run the wrapped route in Pallas's TPU interpret mode against torch's attention,
and, with libtpu installed, compile it for a v5e:2x2 topology (bench/results/tpu-aot/NOTES.md, section 5)."""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np
import pytest

from xbridge.aot.environment import tpu_chips_on_this_machine

# Before libtpu loads (at the session's first jax.devices()), where no TPU chip is: no TPU host to look for (NOTES.md
# section 1), and no claim on /tmp/libtpu_lockfile, which another process compiling for a TPU may hold (a
# compile-only client drives no chip)
if tpu_chips_on_this_machine() == 0:
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

jax = pytest.importorskip("jax", reason="the jax backend is not installed (pip install 'xbridge[jax]')")
pytest.importorskip("torchax", reason="the jax backend needs torchax (scripts/setup.sh installs it)")
torch = pytest.importorskip("torch", reason="the jax backend lowers torch programs (pip install 'xbridge[jax]')")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from test_attention import _attention_case, _matches_torch  # noqa: E402

from xbridge.backends.jaxjit import attention  # noqa: E402

BATCH = ("data",)
# name -> dtype, query shape, key/value heads, causal, mask shape and dtype (None: no mask)
CASES = {
    "causal": (jnp.float32, (4, 4, 128, 64), 4, True, None),
    "bool_mask": (jnp.bfloat16, (4, 4, 256, 128), 4, False, ((4, 1, 256, 256), jnp.bool_)),
    "float_mask": (jnp.float32, (4, 4, 128, 64), 4, False, ((1, 1, 128, 128), jnp.float32)),
    "grouped_query": (jnp.bfloat16, (4, 4, 128, 64), 2, True, None),
    "no_heads": (jnp.float32, (4, 256, 64), 0, True, None),
}


def _mesh(devices=None, shape=(2, 2)) -> Mesh:
    devices = jax.devices("cpu")[:4] if devices is None else devices
    return Mesh(np.array(devices).reshape(shape), ("data", "model"))


def _through_torch(mesh: Mesh, **kwargs):
    """A JAX function of query, key, value (and a mask): torch's ``F.scaled_dot_product_attention`` through torchax,
    routed to the flash kernel over ``mesh`` while it is traced."""
    import torch.nn.functional as F
    import torchax

    env = torchax.default_env()

    def attend(query, key, value, *mask):
        with attention.routed("flash", mesh=mesh, batch_axes=BATCH), env:
            tensors = env.j2t_iso((query, key, value, *mask))
            return env.t2j_iso(F.scaled_dot_product_attention(*tensors, **kwargs))

    return attend


def _inputs(case: str, mesh: Mesh):
    """Abstract query, key, value (and mask) of ``case``, their batch split over the data axis; its kwargs."""
    dtype, shape, kv_heads, causal, mask = CASES[case]
    kv_shape = (*shape[:-3], kv_heads, *shape[-2:]) if kv_heads else shape
    batch = NamedSharding(mesh, P("data"))
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=batch) for s in (shape, kv_shape, kv_shape)]
    if mask is not None:
        args.append(jax.ShapeDtypeStruct(mask[0], mask[1], sharding=NamedSharding(mesh, P())))
    return args, {"is_causal": causal, "enable_gqa": kv_heads not in (0, shape[-3])}


def _forward_and_backward(fn, which: str):
    if which == "forward":
        return fn
    return jax.grad(lambda q, k, v, *mask: jnp.sum(fn(q, k, v, *mask).astype(jnp.float32) ** 2), argnums=(0, 1, 2))


def _lowered_for_tpu(fn, args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def test_gspmd_refuses_the_kernel_called_directly():
    """The route as it was: the kernel called in a jitted step whose batch is split over 4 devices."""
    from xbridge.backends.jaxjit.attention import pallas_flash_attention

    mesh = _mesh(shape=(4, 1))
    args, _ = _inputs("causal", mesh)
    step = jax.jit(functools.partial(pallas_flash_attention, is_causal=True),
                   in_shardings=(NamedSharding(mesh, P("data")),) * 3)
    with pytest.raises(NotImplementedError, match="Mosaic kernels cannot be automatically partitioned"):
        step.trace(*args).lower(lowering_platforms=("tpu",))


@pytest.mark.parametrize("which", ["forward", "forward+backward"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_routed_kernel_lowers_for_a_tpu_over_a_mesh(case, which):
    """torch's attention through the flash route over data=2 x model=2 lowers for a TPU: the kernel in a shard_map
    (one Mosaic call forward; forward, dK/dV and dQ with the backward)."""
    mesh = _mesh()
    args, kwargs = _inputs(case, mesh)
    text = _lowered_for_tpu(_forward_and_backward(_through_torch(mesh, **kwargs), which), args)
    assert text.count("stablehlo.custom_call @tpu_custom_call") == (1 if which == "forward" else 3)


def test_the_kernel_is_called_as_it_is_inside_a_shard_map_over_every_axis():
    """The shard_map train step: every mesh axis manual already, so the route calls the kernel without a shard_map
    of its own (one shard_map in the step, the caller's), and it lowers for a TPU."""
    mesh = _mesh()
    args, kwargs = _inputs("grouped_query", mesh)
    spec = P("data", "model")
    step = jax.shard_map(_forward_and_backward(_through_torch(mesh, **kwargs), "forward+backward"), mesh=mesh,
                         in_specs=(spec,) * 3, out_specs=(spec,) * 3, check_vma=False)
    assert str(jax.make_jaxpr(step)(*args)).count("shard_map[") == 1
    assert "tpu_custom_call" in _lowered_for_tpu(step, args)
    gspmd = _forward_and_backward(_through_torch(mesh, **kwargs), "forward+backward")
    assert str(jax.make_jaxpr(gspmd)(*args)).count("shard_map[") == 2     # the route's own, forward and backward


def test_each_dim_is_split_where_it_divides():
    """Batch over the batch axes, heads over the others (the query's and key/value's counts both dividing), and a
    mask on the dims it shares with the query."""
    mesh = _mesh()
    assert attention.split_dims((4, 4, 128, 64), 2, mesh, BATCH) == (BATCH, ("model",), None, None)
    assert attention.split_dims((4, 4, 128, 64), 1, mesh, BATCH) == (BATCH, None, None, None)    # one kv head
    assert attention.split_dims((3, 6, 128, 64), 6, mesh, BATCH) == (None, ("model",), None, None)
    assert attention.split_dims((4, 128, 64), 0, mesh, BATCH) == (BATCH, None, None)             # no heads dim
    dims = (BATCH, ("model",), None, None)
    shape = (4, 4, 128, 128)
    assert attention.aligned(dims, shape, (4, 1, 128, 128)) == (BATCH, None, None, None)
    assert attention.aligned(dims, shape, (1, 4, 128, 128)) == (None, ("model",), None, None)
    assert attention.aligned(dims, shape, (4, 128, 128)) == (("model",), None, None)    # (heads, seq, seq)
    assert attention.aligned(dims, shape, (128, 128)) == (None, None)


@pytest.mark.parametrize("case", ["causal", "bool_mask", "float_mask", "grouped_query"])
def test_the_wrapped_kernel_computes_what_torch_does(case):
    """The route over data=2 x model=2, the Pallas kernel run in Pallas's TPU interpret mode on each CPU device:
    forward and the three input gradients equal torch's attention (tests/test_attention.py's cases)."""
    from jax.experimental.pallas import tpu as pltpu

    mesh = _mesh()

    def routed(query, key, value, mask, **kwargs):
        return jax.jit(_through_torch(mesh, **kwargs))(query, key, value, *(() if mask is None else (mask,)))

    with pltpu.force_tpu_interpret_mode():
        _matches_torch(*_attention_case(case, length=128), routed, rtol=2e-5, atol=2e-5)


def test_the_wrapped_kernel_compiles_for_a_tpu_topology():
    """With libtpu, the TPU compiler: forward and backward compiled for a v5e:2x2 (4 chips, compile-only), batch
    split over them, bf16 with a boolean mask."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu not installed")
    from jax.experimental import topologies

    mesh = _mesh(topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices)
    args, kwargs = _inputs("bool_mask", mesh)
    from xbridge.aot.measure import no_persistent_cache

    with no_persistent_cache():      # a compile-only executable cannot be stored in it
        compiled = jax.jit(_forward_and_backward(_through_torch(mesh, **kwargs), "forward+backward")).lower(
            *args).compile()
    assert compiled.as_text().count('custom_call_target="tpu_custom_call"') == 3    # forward, dK/dV, dQ
