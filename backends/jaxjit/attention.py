"""Which kernel runs ``F.scaled_dot_product_attention`` on jax (``StepOptions(attention=...)``, ``--attention``).

torchax 0.0.13 lowers every attention call to its math reference (two matmuls and a softmax, which XLA fuses as it
can): that is ``auto`` and ``math``. Two fused kernels are routed to for the time the loss is traced
(:func:`routed`), each refused with one line before the first step on a device that cannot run it, never left to
fall back, and with dropout (neither takes it):

- ``cudnn``: JAX's own fused attention, ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (cuDNN's
  flash attention, NVIDIA GPUs, fp16 and bf16). torch's layout ``(batch, heads, seq, dim)`` becomes JAX's
  ``(batch, seq, heads, dim)``, a boolean ``attn_mask`` (True: attend, as in torch) JAX's ``mask`` and a floating
  one its ``bias``; grouped-query attention (fewer key/value heads) is JAX's own.
- ``flash``: the Pallas TPU flash attention kernel JAX ships, ``jax.experimental.pallas.ops.tpu.flash_attention``
  (TPUs). It takes torch's layout as it is; a mask becomes its additive bias ``ab`` (a boolean one with the
  kernel's own mask value, a floating one divided by the scale, which the kernel applies after adding it), grouped
  key/value heads are repeated to the query's count, the scale is torch's
  (``1/sqrt(dim)`` unless given). Its tiles are 128 positions every way and its backward takes whole tiles only,
  so each sequence must be a multiple of 128 (and the head dim at most 128 or a multiple of it): refused otherwise.
  A Mosaic kernel cannot be split by the GSPMD partitioner: lowered for a TPU inside a ``jax.jit`` over several
  devices, JAX refuses it ("Mosaic kernels cannot be automatically partitioned. Please wrap the call in a
  shard_map."). So over a mesh of more than one device the call is wrapped in ``jax.shard_map`` over the whole mesh
  (:func:`partitioned_flash_attention`), each device running the kernel on its own rows and heads: query, key and
  value split on the batch dim over the plan's batch axes and on the heads dim over the other mesh axes, each only
  where the sizes divide (else that dim is replicated), a mask split the same way on the dims it shares with the
  query. Inside a shard_map that already makes every mesh axis manual (the ``sharding_mode="shard_map"`` train
  step: ``jax.sharding.get_abstract_mesh().manual_axes``) the kernel is called as it is.

Both translations are tested on CPU against torch's attention, forward and backward (tests/test_attention.py):
cuDNN's through ``implementation="xla"``, the Pallas kernel itself in Pallas's TPU interpret mode
(``pltpu.force_tpu_interpret_mode``); the shard_map wrapping lowered for a TPU over a CPU mesh and, with libtpu,
compiled for a TPU topology (tests/test_flash_partitioned.py). Neither kernel has run on its hardware here.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from xbridge.errors import ConfigError
from xbridge.torch.fused_attention import flash_scale, flash_tiles, masked_bias, no_dropout

TORCHAX = "math (torchax reference, XLA)"     # torchax 0.0.13's only lowering of attention
CUDNN = "cuDNN (jax.nn.dot_product_attention)"
FLASH = "Pallas TPU flash attention (jax.experimental.pallas.ops.tpu)"
KERNELS = {"auto": TORCHAX, "math": TORCHAX, "cudnn": CUDNN, "flash": FLASH}
# a fused kernel -> (the JAX platform that runs it, in words, the target to use)
NEEDS = {"cudnn": ("gpu", "jax.nn.dot_product_attention(implementation='cudnn') runs on NVIDIA GPUs only", "jax-cuda"),
         "flash": ("tpu", "the Pallas flash attention kernel runs on TPUs only", "jax-tpu")}


def check(attention: str, target: str, platform: str) -> None:
    """Refuse (one line) a forced kernel this target cannot run, before anything is traced."""
    if attention not in KERNELS:
        raise ConfigError(f"StepOptions attention={attention!r} is not available on {target}: torchax 0.0.13 lowers "
                          "scaled_dot_product_attention to its math reference (XLA fuses it as it can), and xbridge "
                          "routes it to JAX's cuDNN attention on NVIDIA GPUs and to the Pallas flash kernel on TPUs; "
                          "use attention='auto', 'math', 'cudnn' (jax-cuda) or 'flash' (jax-tpu)")
    if attention in NEEDS and platform != NEEDS[attention][0]:
        raise ConfigError(f"StepOptions attention={attention!r} is not available on {target}: {NEEDS[attention][1]}; "
                          f"use attention='auto' or 'math' here, or the target {NEEDS[attention][2]}")


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, attn_mask: jax.Array | None = None,
                          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                          enable_gqa: bool = False, *, implementation: str) -> jax.Array:
    """torch's ``scaled_dot_product_attention`` (its arguments, its layout) as ``jax.nn.dot_product_attention``."""
    no_dropout(implementation, dropout_p)
    q, k, v = (jnp.swapaxes(t, -3, -2) for t in (query, key, value))
    mask = bias = None
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            mask = attn_mask
        else:
            bias = attn_mask.astype(q.dtype)
    # implementation: "xla" or "cudnn" (checked where the option is read); jax types it as a Literal
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                                       implementation=cast(Any, implementation))
    return jnp.swapaxes(out, -3, -2)


def pallas_flash_attention(query: jax.Array, key: jax.Array, value: jax.Array, attn_mask: jax.Array | None = None,
                           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                           enable_gqa: bool = False) -> jax.Array:
    """torch's ``scaled_dot_product_attention`` (its arguments, its layout) as the Pallas TPU flash kernel."""
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas

    no_dropout("flash", dropout_p)
    lead, (length, dim), kv_length = query.shape[:-2], query.shape[-2:], key.shape[-2]
    flash_tiles((length, kv_length), dim, value.shape[-1])

    def four(t: jax.Array) -> jax.Array:      # (..., heads, seq, dim) -> (batch, heads, seq, dim)
        return t.reshape((-1, t.shape[-3] if t.ndim > 3 else 1, *t.shape[-2:]))

    q, k, v = four(query), four(key), four(value)
    if k.shape[1] != q.shape[1]:               # grouped-query attention: each key/value head serves a group
        k, v = (jnp.repeat(t, q.shape[1] // t.shape[1], axis=1) for t in (k, v))
    scale = flash_scale(scale, dim)
    ab = None
    if attn_mask is not None:       # the kernel scales the sum, (q.k + ab) * scale; torch adds its mask after
        bias = (jnp.where(attn_mask, 0.0, masked_bias(scale))
                if attn_mask.dtype == jnp.bool_ else attn_mask.astype(jnp.float32) / scale)
        ab = jnp.broadcast_to(bias, (*lead, length, kv_length)).reshape(q.shape[0], q.shape[1], length, kv_length)
    out = pallas.flash_attention(q, k, v, ab, causal=is_causal, sm_scale=scale)   # its default tiles: 128 each way
    return out.reshape(query.shape)


def partitioned_flash_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                                attn_mask: jax.Array | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                                scale: float | None = None, enable_gqa: bool = False, *,
                                mesh: jax.sharding.Mesh | None = None, batch_axes: tuple[str, ...] = ()) -> jax.Array:
    """:func:`pallas_flash_attention` per device, in a ``jax.shard_map`` over ``mesh`` (the partitioner cannot split
    a Mosaic kernel), unless there is one device or every mesh axis is manual already."""
    kernel = functools.partial(pallas_flash_attention, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                               enable_gqa=enable_gqa)
    arrays = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
    if mesh is None or mesh.size == 1 or manual_over(mesh):
        return kernel(*arrays)
    dims = split_dims(query.shape, key.shape[-3] if key.ndim > 3 else 1, mesh, batch_axes)
    specs = (P(*dims),) * 3 + tuple(P(*aligned(dims, query.shape, mask.shape)) for mask in arrays[3:])
    return jax.shard_map(kernel, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*arrays)


def manual_over(mesh: jax.sharding.Mesh) -> bool:
    """Whether this trace is inside a shard_map that makes every axis of ``mesh`` manual (each device's own part)."""
    return set(mesh.axis_names) <= set(jax.sharding.get_abstract_mesh().manual_axes)


def split_dims(shape: tuple[int, ...], kv_heads: int, mesh: jax.sharding.Mesh,
               batch_axes: tuple[str, ...]) -> tuple[Any, ...]:
    """The mesh axes splitting each dim of torch's ``(batch, heads, seq, dim)`` (or ``(batch, seq, dim)``): the batch
    over ``batch_axes``, the heads (of the query and of key/value) over the other axes, where the sizes divide."""
    heads = tuple(a for a in mesh.axis_names if a not in batch_axes and mesh.shape[a] > 1)
    dims: list[Any] = [None] * len(shape)
    dims[0] = dividing(batch_axes, mesh, shape[0])
    if len(shape) > 3:
        dims[-3] = dividing(heads, mesh, shape[-3], kv_heads)
    return tuple(dims)


def dividing(axes: tuple[str, ...], mesh: jax.sharding.Mesh, *sizes: int) -> tuple[str, ...] | None:
    """``axes`` where each of ``sizes`` divides by their devices, else None (replicated)."""
    devices = math.prod(mesh.shape[a] for a in axes)
    return axes if axes and all(size % devices == 0 for size in sizes) else None


def aligned(dims: tuple[Any, ...], shape: tuple[int, ...], mask: tuple[int, ...]) -> tuple[Any, ...]:
    """A broadcastable mask's split: the query's (``dims`` of ``shape``) on each dim of the same size, the dims
    aligned from the right as broadcasting aligns them; any other dim replicated."""
    offset = len(shape) - len(mask)
    return tuple(dims[i + offset] if i + offset >= 0 and size == shape[i + offset] else None
                 for i, size in enumerate(mask))


@contextlib.contextmanager
def routed(attention: str, mesh: jax.sharding.Mesh | None = None,
           batch_axes: tuple[str, ...] = ()) -> Iterator[None]:
    """While a loss is traced: its attention calls go to JAX's ``attention`` implementation (nothing for the
    torchax reference), the flash kernel in a shard_map over ``mesh`` (:func:`partitioned_flash_attention`, the
    batch split over ``batch_axes``). torchax's default environment is the process's, so the entries are put back
    after (backends/jaxjit/patches.py)."""
    if KERNELS.get(attention, TORCHAX) == TORCHAX:
        yield
        return
    from . import patches

    impl = (functools.partial(partitioned_flash_attention, mesh=mesh, batch_axes=batch_axes) if attention == "flash"
            else functools.partial(dot_product_attention, implementation=attention))
    with patches.routed_attention(impl):
        yield
