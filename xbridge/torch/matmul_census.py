"""Which dtype a model's matmuls compute in: the forward pass of the loss, counted operator by operator.

``Executable.matmul_dtypes(batch)`` runs one forward pass of the loss in eval mode, without gradient or update, under
the step's own precision (autocast and all), and counts the matrix products by the dtype of their inputs: what
bf16-mixed actually did to this model on this backend. Parity compares the dtypes each target used with the
reference's (a target whose autocast policy leaves a product in float32 where eager casts it, or casts one the
model keeps in float32 on purpose, fails there even when its losses stay within the bf16 tolerance).

Torch backends count below autograd and autocast with a ``TorchDispatchMode`` (:func:`count_torch`): eager and
inductor on their device (Inductor compiles the graph AOTAutograd traces through the same autocast), xla on lazy
tensors (nothing is executed). jax counts the products of the loss's jaxpr (backends/jaxjit/lowering.py), which
splits attention into its two products.

On the torch backends attention counts as one product, in the dtype of its output: how
``scaled_dot_product_attention`` is carried out below that is the backend's kernel choice, not the precision
policy (eager's CPU flash kernel takes bfloat16 and accumulates in float32; torch's math path, which XLA takes,
upcasts the same bfloat16 values to float32 for its two ``bmm``; both give bfloat16).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from xbridge import hints
from xbridge.ir.program import Program

from .train import compute_context, eval_mode

# Matrix products as aten operators after decomposition (linear -> addmm/mm, matmul -> mm/bmm, attention kernels)
PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "_addmm_activation", "dot", "mv", "convolution",
            "_convolution", "_grouped_mm", "linalg_vecdot", "scaled_dot_product_attention"}


def is_product(name: str) -> bool:
    return name in PRODUCTS or name.startswith("_scaled_dot_product")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def first_floating(args: Any) -> torch.Tensor | None:
    return next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point()), None)


class MatmulCensus(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.inside_composite = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.inside_composite and is_product(func.overloadpacket.__name__):
            tensor = first_floating(args)
            if tensor is not None:
                self.counts[dtype_name(tensor.dtype)] += 1
        return func(*args, **(kwargs or {}))


# Counted once each, by their output, with the products inside them hidden: attention (see above) and einsum (the
# CPU decomposes it into bmm, torch_xla runs it as one operator)
COMPOSITES = (torch.nn.functional.scaled_dot_product_attention, torch.einsum)
_active: list[MatmulCensus] = []


def record(dtype: torch.dtype) -> None:
    """A product computed by one of xbridge's own kernels above the dispatch mode (the XLA ``_grouped_mm``,
    registered at the autograd key): counted by the census running, if any."""
    if _active and not _active[-1].inside_composite:
        _active[-1].counts[dtype_name(dtype)] += 1


class CompositeScope(TorchFunctionMode):
    """Counts each call of :data:`COMPOSITES` once, by its output, and hides the products inside it."""

    def __init__(self, census: MatmulCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in COMPOSITES or self.census.inside_composite:
            return func(*args, **(kwargs or {}))
        self.census.inside_composite += 1
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.census.inside_composite -= 1
        self.census.counts[dtype_name(out.dtype)] += 1
        return out


def count_torch(program: Program, model: torch.nn.Module, tensors: dict[str, torch.Tensor], device_type: str,
                hint: hints.Handler | None) -> dict[str, int]:
    census = MatmulCensus()
    _active.append(census)
    try:
        with eval_mode(model), torch.no_grad(), compute_context(program, device_type), \
                hints.activate(hint), census, CompositeScope(census):
            program.loss(model, tensors)
    finally:
        _active.pop()
    return dict(sorted(census.counts.items()))
