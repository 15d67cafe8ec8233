"""Which kernel runs ``F.scaled_dot_product_attention`` on jax (``StepOptions(attention=...)``, ``--attention``).

torchax 0.0.13 lowers every attention call to its math reference (two matmuls and a softmax, which XLA fuses as it
can): that is ``auto`` and ``math``. ``cudnn`` routes the calls to JAX's own fused attention,
``jax.nn.dot_product_attention(..., implementation="cudnn")`` (cuDNN's flash attention, NVIDIA GPUs only, fp16 and
bf16, no dropout), for the time the loss is traced (:func:`routed`): torch's layout ``(batch, heads, seq, dim)``
becomes JAX's ``(batch, seq, heads, dim)``, a boolean ``attn_mask`` (True: attend, as in torch) JAX's ``mask`` and a
floating one its ``bias``; grouped-query attention (fewer key/value heads) is JAX's own. On any other device, or with
dropout, ``cudnn`` is refused with one line before the first step, never left to fall back.

The translation is tested on CPU through ``implementation="xla"`` against torch's attention, forward and backward
(tests/test_attention.py); cuDNN itself needs a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F

from xbridge.errors import ConfigError

TORCHAX = "math (torchax reference, XLA)"     # torchax 0.0.13's only lowering of attention
CUDNN = "cuDNN (jax.nn.dot_product_attention)"
KERNELS = {"auto": TORCHAX, "math": TORCHAX, "cudnn": CUDNN}


def check(attention: str, target: str, platform: str) -> None:
    """Refuse (one line) a forced kernel this target cannot run, before anything is traced."""
    if attention not in KERNELS:
        raise ConfigError(f"StepOptions attention={attention!r} is not available on {target}: torchax 0.0.13 lowers "
                          "scaled_dot_product_attention to its math reference (XLA fuses it as it can), and xbridge "
                          "routes it to JAX's cuDNN attention on NVIDIA GPUs; use attention='auto', 'math' or "
                          "'cudnn' (jax-cuda)")
    if attention == "cudnn" and platform != "gpu":
        raise ConfigError(f"StepOptions attention='cudnn' is not available on {target}: "
                          "jax.nn.dot_product_attention(implementation='cudnn') runs on NVIDIA GPUs only; use "
                          "attention='auto' or 'math' here, or the target jax-cuda")


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, attn_mask: jax.Array | None = None,
                          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                          enable_gqa: bool = False, *, implementation: str) -> jax.Array:
    """torch's ``scaled_dot_product_attention`` (its arguments, its layout) as ``jax.nn.dot_product_attention``."""
    if dropout_p:
        raise ConfigError(f"StepOptions attention={implementation!r}: jax.nn.dot_product_attention takes no "
                          f"dropout, and this attention call has dropout_p={dropout_p}; use attention='auto' (the "
                          "torchax reference draws it)")
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


@contextlib.contextmanager
def routed(attention: str) -> Iterator[None]:
    """While a loss is traced: its attention calls go to JAX's ``attention`` implementation (nothing for the
    torchax reference). torchax's default environment is the process's, so the entries are put back after."""
    if KERNELS.get(attention, TORCHAX) == TORCHAX:
        yield
        return
    import torchax
    from torchax.ops import ops_registry

    env = torchax.default_env()
    impl = functools.partial(dot_product_attention, implementation=attention)
    keys = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention,
            torch.ops.aten.scaled_dot_product_attention.default)
    before = {key: env._ops.get(key) for key in keys}
    for key in keys:
        env._ops[key] = ops_registry.Operator(key, impl, is_jax_function=True, is_user_defined=True,
                                              needs_env=False, is_view_op=False)
    try:
        yield
    finally:
        for key, op in before.items():
            if op is None:
                env._ops.pop(key, None)
            else:
                env._ops[key] = op
