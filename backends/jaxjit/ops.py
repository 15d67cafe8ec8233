"""Lowerings xbridge adds to torchax for torch operators it does not cover, registered before a program is traced
(by backends/jaxjit/patches.py, where every change to torchax lives).

- ``aten::_grouped_mm`` (mixture-of-experts layers: transformers 5's default experts implementation calls it with
  the tokens sorted by expert and ``offs``, the cumulative end row of each expert's group):
  ``(m, k) x (g, k, n)`` is ``jax.lax.ragged_dot`` with group sizes ``diff(offs)``; ``(k, m) x (m, n) -> (g, k, n)``
  (the weight gradient torch's autograd would ask for) is a one-hot contraction over the rows; ``(b, m, k) x
  (b, k, n)`` without ``offs`` is a batched matmul. Rows past ``offs[-1]`` come out 0 (torch leaves them unset).
  On CPU and in multi-device SPMD, XLA expands ``ragged_dot`` into a dense masked matmul over the groups (g times the
  FLOPs of the grouped product); single-device GPU and TPU keep it ragged.

- ``aten::native_batch_norm`` and ``aten::_native_batch_norm_legit`` in training mode (BatchNorm layers), replacing
  torchax's: torch updates the running mean and variance in place (the variance with Bessel's correction, n/(n-1));
  torchax 0.0.13 computes the new statistics but drops them (and without the correction). Here the update is done
  as torch does it, in place on the buffers, which the lowered loss then reads back.

- ``F.conv1d`` and ``F.conv3d`` (``nn.Conv1d``, ``nn.Conv3d``): torchax lowers ``aten::conv2d`` and
  ``aten::convolution`` but not these, so they ran torch's own composite, which checks that input and bias share a
  dtype before anything casts them: under bf16-mixed (a bf16 activation, a float32 bias) every Conv1d failed. Here
  they are ``aten::convolution``, which torchax lowers and the autocast policy casts, as torch does (``"same"``
  and ``"valid"`` padding as torch computes them).
- ``aten::_embedding_bag`` (``nn.EmbeddingBag``, ``F.embedding_bag``), replacing torchax's, which reads the bags'
  offsets as numpy and fails on a traced array: xbridge/torch/embedding_bag.py's static-shape form, which torchax
  lowers operator by operator.
Tests: tests/test_jax_backend.py compares each case with torch on the CPU, forward and backward; the model zoo
(tests/test_model_zoo.py) trains BatchNorm models and compares the buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import torch

from xbridge.errors import LoweringError
from xbridge.torch.batch_norm import batch_norm, batch_norm_no_training
from xbridge.torch.embedding_bag import embedding_bag

if TYPE_CHECKING:
    from xbridge.torch.op_census import OpUse


def _group_sizes(offs: jax.Array) -> jax.Array:
    offs = offs.astype(jnp.int32)
    return jnp.diff(offs, prepend=jnp.zeros((1,), jnp.int32))


def grouped_mm(a: jax.Array, b: jax.Array, offs: jax.Array | None = None, bias: jax.Array | None = None,
               out_dtype: Any = None) -> jax.Array:
    from torchax.ops import mappings

    if bias is not None:
        raise LoweringError("torch._grouped_mm with a bias has no lowering on the jax backend (transformers' "
                            "experts pass none); add the bias after the grouped product")
    if offs is None:
        out = jnp.matmul(a, b)
    elif a.ndim == 2 and b.ndim == 3:            # forward and input gradient: ragged along the rows of a
        out = jax.lax.ragged_dot(a, b, _group_sizes(offs))
    elif a.ndim == 2 and b.ndim == 2:            # weight gradient: ragged along the contracted rows
        group = jnp.searchsorted(offs.astype(jnp.int32), jnp.arange(a.shape[1]), side="right")
        out = jnp.einsum("km,mg,mn->gkn", a, jax.nn.one_hot(group, offs.shape[0], dtype=a.dtype), b)
    else:
        raise LoweringError(f"torch._grouped_mm of shapes {tuple(a.shape)} x {tuple(b.shape)} with offs has no "
                            "lowering on the jax backend (2-D x 3-D and 2-D x 2-D do)")
    return out if out_dtype is None else out.astype(mappings.t2j_dtype(out_dtype))


def jax_lowerings() -> list[tuple[Any, Any]]:
    """(torch operator, JAX function) pairs added where torchax has no lowering of its own."""
    return [(torch.ops.aten._grouped_mm.default, grouped_mm)]


def _convolution(dims: int) -> Any:
    def conv(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
             groups: int = 1) -> Any:
        def each(value: Any) -> list[int]:
            return list(value) if isinstance(value, (tuple, list)) else [value] * dims

        stride, dilation = each(stride), each(dilation)
        if padding == "valid":
            padding = 0
        if padding == "same":      # torch's: the total dilation*(k-1) per dimension, the odd one on the right
            totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
            left = [t // 2 for t in totals]
            if any(t % 2 for t in totals):
                pads = [amount for t, lo in reversed(list(zip(totals, left))) for amount in (lo, t - lo)]
                input = torch.nn.functional.pad(input, pads)
                left = [0] * dims
            padding = left
        return torch.ops.aten.convolution.default(input, weight, bias, stride, each(padding), dilation, False,
                                                  [0] * dims, groups)
    return conv


def torch_functions() -> list[tuple[Any, Any]]:
    """(torch function, torch function) pairs torchax's environment runs in place of the first (its
    ``override_op_definition``)."""
    return [(torch.nn.functional.conv1d, _convolution(1)), (torch.nn.functional.conv3d, _convolution(3))]


def torch_replacements() -> list[tuple[Any, Any]]:
    """(aten operator packet, torch function) pairs that replace torchax's own lowerings, the packet's default
    overload included; the functions mutate their arguments, as the aten schema says."""
    aten = torch.ops.aten
    return [(aten.native_batch_norm, batch_norm), (aten._native_batch_norm_legit, batch_norm),
            (aten._native_batch_norm_legit_no_training, batch_norm_no_training),
            (aten._embedding_bag, embedding_bag), (aten._embedding_bag_forward_only, embedding_bag)]


def support(uses: list[OpUse]) -> dict[str, str]:
    """How torchax (with xbridge's additions) carries each aten operator (``xbridge check``): ``lowered`` (a JAX
    function in its operator table, or xbridge's; or every call of it is inside a torch function torchax lowers
    whole, such as ``torch.cdist`` or ``F.interpolate``, so its dispatch never sees the operator), ``decomposed``
    (its decomposition table) or ``missing`` (the step fails with torchax's OperatorNotFound). Read from torchax's
    own tables, as its dispatch looks them up: the function first, then the operator, then its decomposition."""
    from torchax import decompositions
    from torchax.ops import jaten, jtorch, ops_registry  # noqa: F401  (importing them fills the table)

    from xbridge.torch.op_census import function_name, resolve

    ours = {op for op, _ in jax_lowerings()} | {packet for packet, _ in torch_replacements()}
    whole = {function_name(func) for func in ops_registry.all_torch_functions}
    out = {}
    for use in uses:
        op = resolve(use.name)
        keys = (op, getattr(op, "overloadpacket", None))
        if any(key in ops_registry.all_aten_ops or key in ours for key in keys):
            out[use.name] = "lowered"
        elif any(key in decompositions.DECOMPOSITIONS for key in keys):
            out[use.name] = "decomposed"
        elif use.functions and all(function in whole for function in use.functions) and not use.in_user_backward:
            out[use.name] = "lowered"
        else:
            out[use.name] = "missing"
    return out
