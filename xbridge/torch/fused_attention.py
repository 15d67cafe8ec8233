"""What the fused attention kernels that xbridge routes ``F.scaled_dot_product_attention`` to take, checked before
they are called: the rules the jax and xla routes share (backends/jaxjit/attention.py, backends/xlaspmd/attention.py).
Imports no ML framework.

The Pallas TPU flash attention kernel (JAX's ``jax.experimental.pallas.ops.tpu.flash_attention``, which torch_xla's
``custom_kernel.flash_attention`` wraps) tiles the keys in blocks of :data:`BLOCK` in its backward pass
(``MIN_BLOCK_SIZE``) and takes a head dim of at most one lane row or a multiple of one; it computes
``softmax((q.k + ab) * scale)``, so torch's additive mask (``q.k * scale + mask``) is passed divided by the scale."""

from __future__ import annotations

from xbridge.errors import ConfigError

BLOCK = 128
MASK_VALUE = -0.7 * float.fromhex("0x1.fffffep+127")     # the kernel's DEFAULT_MASK_VALUE: -0.7 * float32 max


def flash_scale(scale: float | None, dim: int) -> float:
    """torch's scale (``1/sqrt(dim)`` unless given), which the kernel takes as ``sm_scale``."""
    return scale if scale is not None else 1.0 / float(dim) ** 0.5


def masked_bias(scale: float) -> float:
    """The additive bias where a boolean mask does not attend: the kernel's mask value, kept finite once the
    kernel multiplies it by ``scale``."""
    return MASK_VALUE / max(1.0, scale)


def no_dropout(attention: str, dropout_p: float) -> None:
    if dropout_p:
        raise ConfigError(f"StepOptions attention={attention!r}: the fused kernel takes no dropout, and this "
                          f"attention call has dropout_p={dropout_p}; use attention='auto' (the math path draws it)")


def flash_tiles(lengths: tuple[int, ...], dim: int, value_dim: int) -> None:
    """Refuse (one line) an attention call the Pallas flash kernel cannot tile."""
    if any(n % BLOCK for n in lengths) or (dim > BLOCK and dim % BLOCK) or value_dim != dim:
        raise ConfigError(f"StepOptions attention='flash': the Pallas TPU flash attention kernel tiles sequences in "
                          f"blocks of {BLOCK} and takes one head dim of at most {BLOCK} or a multiple of it; this "
                          f"attention call has sequences of {'/'.join(map(str, lengths))} and head dims of "
                          f"{dim}/{value_dim}; use attention='auto'")
