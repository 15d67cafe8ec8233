"""torch.autocast's CPU op policy, for the backends whose own autocast departs from it (xla, jax).

The eager reference runs ``torch.autocast("cpu")``; bf16-mixed means that policy on every backend. torch applies it
per aten operator in C++ (aten/src/ATen/autocast_mode.cpp, torch 2.9): ``lower_precision_fp`` casts the floating
inputs to the autocast dtype, ``fp32`` casts them to float32, ``promote`` casts them all to the widest floating dtype
among them; every other operator runs in the dtypes it is given. A floating input is cast only when it is not
float64 (torch's ``is_eligible``), and lists of tensors (``cat``, ``stack``) count like single ones.

- torch_xla 2.9 registers its own list at ``AutocastXLA``: it leaves out ``scaled_dot_product_attention`` (mixed
  query/key/value dtypes then fail), ``linalg_vecdot``, the 3-D pools, the FFTs and the linear algebra, and adds
  ``softmax``/``log_softmax``/``pow`` in float32, ``max_pool2d`` in the lower dtype and ``batch_norm`` in float32
  (measured against ``torch.autocast("cpu")``). Its ``einsum`` in the lower dtype stays: on the CPU, einsum
  decomposes into ``bmm``, which autocast casts, while torch_xla runs einsum as one operator.
  backends/xlaspmd/autocast.py registers :data:`XLA_CORRECTIONS` over it.
- torchax 0.0.13 copies torch's table but its ``promote`` breaks on lists and it ignores a model's own
  ``torch.autocast(enabled=False)`` regions; backends/jaxjit/autocast.py replaces its policy function with
  :func:`cast_inputs`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

LOWER = "lower_precision_fp"
FP32 = "fp32"
PROMOTE = "promote"
KEEP = "keep"      # no autocast kernel on the CPU: the operator runs in the dtypes it is given

# Where torch_xla's AutocastXLA list differs from torch's AutocastCPU one (both read from the dispatcher, torch 2.9
# and torch_xla 2.9): torch's policy for each such operator, by aten name (overload included where it matters).
XLA_CORRECTIONS: dict[str, str] = {
    # on the CPU list, not on torch_xla's
    "scaled_dot_product_attention": LOWER,
    "_native_multi_head_attention": LOWER,
    "linalg_vecdot": LOWER,
    "_addmm_activation": LOWER,
    "_convolution.deprecated": LOWER,
    **{name: FP32 for name in (
        "avg_pool3d", "max_pool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d", "max_unpool2d", "max_unpool3d",
        "fractional_max_pool2d", "fractional_max_pool3d", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d",
        "huber_loss", "poisson_nll_loss", "polar", "view_as_complex", "stft", "stft.center", "quantile",
        "quantile.scalar", "nanquantile", "nanquantile.scalar", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2",
        "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn",
        "fft_hfft", "fft_ihfft", "linalg_cholesky", "linalg_cholesky_ex", "linalg_cond", "linalg_cond.p_str",
        "linalg_eig", "linalg_eigh", "linalg_eigvals", "linalg_eigvalsh", "linalg_householder_product",
        "linalg_inv", "linalg_lstsq", "linalg_matrix_rank", "linalg_matrix_rank.atol_rtol_float",
        "linalg_matrix_rank.atol_rtol_tensor", "linalg_matrix_rank.tol_tensor", "linalg_qr", "linalg_solve",
        "linalg_svdvals", "linalg_tensorinv", "linalg_tensorsolve", "lu_solve", "orgqr", "ormqr", "pinverse",
        "geqrf", "_lu_with_info", "fake_quantize_per_tensor_affine")},
    # on torch_xla's list, not on the CPU one
    **{name: KEEP for name in (
        "softmax.int", "softmax.Dimname", "_softmax", "log_softmax.int", "log_softmax.Dimname", "pow.Tensor_Scalar",
        "relu", "max_pool2d", "batch_norm")},
}


def _eligible(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def cast_inputs(policy: str, args: Any, kwargs: Any, lower: torch.dtype) -> tuple[Any, Any]:
    """``(args, kwargs)`` cast as torch.autocast casts an operator's inputs under ``policy``; ``lower`` is the
    autocast dtype (bfloat16 or float16). Tensors inside lists and tuples are cast too."""
    if policy == LOWER:
        target = lower
    elif policy == FP32:
        target = torch.float32
    elif policy == PROMOTE:
        dtypes = {v.dtype for v in pytree.tree_leaves((args, kwargs)) if _eligible(v)}
        target = torch.float32 if torch.float32 in dtypes else lower      # torch's prioritize(): float32 wins
    elif policy == KEEP:
        return args, kwargs
    else:
        raise ValueError(f"unknown autocast policy {policy!r}")
    return pytree.tree_map_only(torch.Tensor, lambda v: v.to(target) if _eligible(v) and v.dtype != target else v,
                                (args, kwargs))
