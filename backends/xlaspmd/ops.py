"""XLA kernels xbridge adds for torch operators torch_xla 2.9 cannot run, registered once per process before a
program is lowered (``torch.library``, dispatch key ``XLA``: only XLA tensors take them).

- ``aten::_grouped_mm`` (mixture-of-experts layers; transformers 5's default experts implementation): torch_xla has
  no kernel (the call crashes the process). Here it is a static-shape masked product: each row's group is found from
  ``offs`` (the cumulative end row of each group) by comparison, and the product is taken against every group and
  masked, so the graph has one shape whatever the routing (g times the FLOPs of a ragged product).
  ``(m, k) x (g, k, n)``, ``(k, m) x (m, n) -> (g, k, n)`` and the batched ``(b, m, k) x (b, k, n)`` without
  ``offs``. It is registered at the autograd key (``AutogradXLA``), so autograd differentiates this product itself:
  with the kernel at the ``XLA`` key and torch's own backward formula, the experts' weight gradients of a Qwen3-MoE
  layer came out wrong (0.15 relative after one step) while the forward matched.
- ``aten::native_batch_norm`` (BatchNorm layers): torch_xla 2.9 updates the running variance with the biased batch
  variance, torch with the unbiased one (measured: 1.5271 against 1.5371 after one step); here torch's formula in
  plain ops (xbridge/torch/batch_norm.py), so the buffers train as in eager.
- ``aten::histc`` on integer input (transformers counts tokens per expert with it): torch_xla runs histc on the CPU,
  whose kernel takes floating input only. Here it is a one-hot count, the same static shape for any input.

- ``aten::_embedding_bag`` (``nn.EmbeddingBag``): torch_xla has no kernel and runs it on the CPU, which the one-graph
  step cannot stop for; xbridge/torch/embedding_bag.py's static-shape form, at the autograd key, so autograd
  differentiates its operators.

- torch.autocast's CPU policy at ``AutocastXLA`` where torch_xla's own list differs (backends/xlaspmd/autocast.py).

Tests: tests/test_xla_backend.py compares each case with torch on the CPU, forward and backward.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from xbridge.errors import LoweringError
from xbridge.torch import matmul_census
from xbridge.torch.batch_norm import batch_norm
from xbridge.torch.embedding_bag import embedding_bag

from . import autocast

_LIBRARY: list[torch.library.Library] = []


def _row_groups(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """One-hot (rows, g) membership: row r belongs to the first group whose end offset exceeds r."""
    index = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    group = (index[:, None] >= offs[None, :]).sum(dim=1)                 # g for rows past the last group
    return group[:, None] == torch.arange(offs.shape[0], device=offs.device)[None, :]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               out_dtype: Any = None) -> torch.Tensor:
    if bias is not None:
        raise LoweringError("torch._grouped_mm with a bias has no kernel on the xla backend (transformers' experts "
                            "pass none); add the bias after the grouped product")
    matmul_census.record(a.dtype)                  # one product, as torch's own kernel counts
    with torch.autocast("xla", enabled=False):     # torch autocasts no _grouped_mm: it runs in the dtypes given
        return _grouped_mm_products(a, b, offs, out_dtype)


def _grouped_mm_products(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None, out_dtype: Any) -> torch.Tensor:
    if offs is None:
        out = torch.matmul(a, b)
    elif a.dim() == 2 and b.dim() == 3:
        mask = _row_groups(offs, a.shape[0]).to(a.dtype)                    # (m, g)
        out = torch.einsum("mg,gmn->mn", mask, torch.einsum("mk,gkn->gmn", a, b))
    elif a.dim() == 2 and b.dim() == 2:
        mask = _row_groups(offs, a.shape[1]).to(a.dtype)                    # (m, g)
        out = torch.einsum("km,mg,mn->gkn", a, mask, b)
    else:
        raise LoweringError(f"torch._grouped_mm of shapes {tuple(a.shape)} x {tuple(b.shape)} with offs has no "
                            "kernel on the xla backend (2-D x 3-D and 2-D x 2-D do)")
    return out if out_dtype is None else out.to(out_dtype)


def histc(x: torch.Tensor, bins: int = 100, min: float = 0.0, max: float = 0.0) -> torch.Tensor:  # noqa: A002
    """torch.histc's semantics: ``bins`` equal bins over [min, max] (the data's range when both are 0), values
    outside ignored, ``max`` itself in the last bin; counts in the input's dtype."""
    values = x.reshape(-1).to(torch.float32)
    if float(min) == 0.0 and float(max) == 0.0 and values.numel():
        low, high = values.min(), values.max()                 # tensors: the graph keeps one shape
    else:
        low, high = values.new_tensor(float(min)), values.new_tensor(float(max))
    same = low == high
    low, high = torch.where(same, low - 1, low), torch.where(same, high + 1, high)
    index = ((values - low) * (bins / (high - low))).floor().clamp(0, bins - 1).to(torch.int64)
    inside = ((values >= low) & (values <= high)).to(torch.float32)
    counts = (torch.nn.functional.one_hot(index, bins).to(torch.float32) * inside[:, None]).sum(dim=0)
    return counts.to(x.dtype)


def register() -> None:
    """Install the kernels (once per process)."""
    if _LIBRARY:
        return
    library = torch.library.Library("aten", "IMPL")
    # at the autograd key: autograd differentiates the static-shape product itself (torch's _grouped_mm backward
    # formula is not used on XLA)
    library.impl("_grouped_mm", grouped_mm, "AutogradXLA")
    library.impl("histc", histc, "XLA")
    library.impl("_embedding_bag", embedding_bag, "AutogradXLA")
    library.impl("_embedding_bag_forward_only", embedding_bag, "AutogradXLA")
    with warnings.catch_warnings():    # torch_xla's own kernel is replaced on purpose (the docstring says why)
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
        library.impl("native_batch_norm", batch_norm, "XLA")
    autocast.register(library)
    _LIBRARY.append(library)


def support(names: list[str]) -> dict[str, str]:
    """How torch_xla (with xbridge's kernels) carries each aten operator (``xbridge check``): ``lowered`` (a kernel
    at the XLA key: torch_xla's, or xbridge's), ``decomposed`` (a composite kernel written in other operators) or
    ``fallback`` (none: torch_xla copies the inputs to the host, runs torch's CPU kernel and copies back, at every
    call). Read from torch's dispatcher, where torch_xla registers its kernels."""
    import torch_xla  # noqa: F401  (its kernels register with the dispatcher when it loads)
    from torch._C import _dispatch_has_kernel_for_dispatch_key

    def has_kernel(name: str, key: str) -> bool:
        try:
            return bool(_dispatch_has_kernel_for_dispatch_key(name, key))
        except RuntimeError:        # no such operator (a backward's name with no forward of that name)
            return False

    def differentiated_by_torch_xla(name: str) -> bool:
        """A backward operator (``native_layer_norm_backward``) whose forward torch_xla differentiates itself (a
        kernel at ``AutogradXLA``): on XLA tensors the backward operator is never called."""
        base = name.partition(".")[0]
        for suffix in ("_backward_data", "_backward"):
            if base.endswith(suffix):
                return has_kernel(base.removesuffix(suffix), "AutogradXLA")
        return False

    register()
    out = {}
    for name in names:
        if has_kernel(name, "XLA") or has_kernel(name, "AutogradXLA") or differentiated_by_torch_xla(name):
            out[name] = "lowered"
        elif has_kernel(name, "CompositeExplicitAutograd") or has_kernel(name, "CompositeImplicitAutograd"):
            out[name] = "decomposed"
        else:
            out[name] = "fallback"
    return out
