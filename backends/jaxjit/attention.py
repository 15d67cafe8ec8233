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

Both translations are tested on CPU against torch's attention, forward and backward (tests/test_attention.py):
cuDNN's through ``implementation="xla"``, the Pallas kernel itself in Pallas's TPU interpret mode
(``pltpu.force_tpu_interpret_mode``). Neither kernel has run on its hardware here.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp

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
    out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                                       implementation=implementation)  # type: ignore[arg-type]
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


@contextlib.contextmanager
def routed(attention: str) -> Iterator[None]:
    """While a loss is traced: its attention calls go to JAX's ``attention`` implementation (nothing for the
    torchax reference). torchax's default environment is the process's, so the entries are put back after
    (backends/jaxjit/patches.py)."""
    if KERNELS.get(attention, TORCHAX) == TORCHAX:
        yield
        return
    from . import patches

    impl = (pallas_flash_attention if attention == "flash"
            else functools.partial(dot_product_attention, implementation=attention))
    with patches.routed_attention(impl):
        yield
