"""What a training step keeps for its backward pass, measured on the meta device (shapes only: no arithmetic, no
memory): the program's loss runs forward on one micro-batch of meta tensors, with the layers wrapped for the
program's remat choice exactly as the backends wrap them, and every tensor autograd saves is counted once (a view
counts as its base), parameters left out (they are counted as parameters).

torch.utils.checkpoint saves a wrapped layer's inputs instead of what its operations save, so ``remat="full"``
counts what a checkpointed step keeps between its forward and backward passes; the recomputation of one layer
during the backward pass adds that layer's own activations on top, for one layer at a time (reported apart).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xbridge.ir.precision import DTYPES
from xbridge.ir.program import Program

from . import remat
from .loss_check import meta_batch
from .train import split_micro
from .weights import meta_model

__all__ = ["Saved", "saved_bytes"]


def _forward(program: Program, batch: dict[str, np.ndarray], model: torch.nn.Module, counter: _Saved,
             fused: bool) -> None:
    """The loss of one micro-batch of meta tensors, forward only, every save going to ``counter`` (the model and the
    batch in fp32, as meta_model builds it; sizes are counted at the compute dtype)."""
    micro = split_micro(meta_batch(program.replace(precision="fp32"), batch), program.step.grad_accum)[0]
    with (torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t),
          _Attention(counter) if fused else contextlib.nullcontext()):
        program.loss(model, micro)


class _Attention(TorchFunctionMode):
    """Counts what ``scaled_dot_product_attention`` keeps as a fused kernel keeps it (flash, memory-efficient,
    cuDNN: q, k, v, the output and one fp32 log-sum-exp per query row) in place of what the math path the meta
    device runs keeps (the S x S probabilities too). The output is handed on in the fused kernels' layout ((batch,
    seq, heads, dim) in memory), so that a following ``transpose(1, 2).reshape(...)`` is a view, as after torch's
    flash kernel, not a copy."""

    def __init__(self, counter: _Saved) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        before = self.counter.total
        out = func(*args, **kwargs)
        if self.counter.total == before:    # inside a checkpointed layer: its saves are the checkpoint's business
            return out
        self.counter.total = before         # the math path's saves out, the fused kernel's in
        if out.dim() == 4:
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        for tensor in (*args[:3], out):
            self.counter.pack(tensor)
        self.counter.total += args[0][..., 0].numel() * 4       # the log-sum-exp, fp32
        return out


class _Saved:
    """Every tensor autograd saves, once (a view as its base), parameters left out."""

    def __init__(self, model: torch.nn.Module, compute: int) -> None:
        self.params = {id(p) for p in model.parameters()}
        self.compute = compute
        self.seen: dict[int, int] = {}
        self.kept: list[torch.Tensor] = []       # references keep ids unique while counting
        self.total = 0

    def size(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * (self.compute if tensor.is_floating_point() else tensor.element_size())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self.params and id(base) not in self.seen:
            self.kept.append(base)
            self.seen[id(base)] = self.size(base)
            self.total += self.seen[id(base)]
        return tensor


@dataclass(frozen=True)
class Saved:
    fused: int       # kept for the backward pass, attention as a fused kernel keeps it
    math: int        # the same with math attention (the S x S probabilities kept)
    layer: int       # remat: what recomputing the largest layer adds back (0 without remat)


def saved_bytes(program: Program, batch: dict[str, np.ndarray]) -> Saved:
    """What autograd keeps for the backward pass of one micro-batch. Floating tensors are counted at the compute
    dtype's size (autocast does not run on the meta device; bf16-mixed keeps its activations in bf16)."""
    compute = DTYPES[program.precision.compute]
    totals = []
    for fused in (False, True):     # the math path as the meta device runs it, then as a fused kernel keeps it
        model = meta_model(program)
        model.train()
        path = remat.apply(model, program, remat.torch_checkpoint(program.step.remat))
        counter = _Saved(model, compute)
        _forward(program, batch, model, counter, fused)
        totals.append(counter.total)
    layer = _largest_layer(program, batch, compute) if path is not None else 0
    return Saved(totals[1], totals[0], layer)


def _largest_layer(program: Program, batch: dict[str, np.ndarray], compute: int) -> int:
    """What one layer of the remat target keeps when it is not checkpointed (attention as a fused kernel): the most
    any layer keeps."""
    model = meta_model(program)
    model.train()
    _, layers = remat.find_layers(model, program.step.layers)
    counter = _Saved(model, compute)
    marks: dict[int, int] = {}
    per_layer: list[int] = []

    def enter(module: torch.nn.Module, args: Any) -> None:
        marks[id(module)] = counter.total

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        per_layer.append(counter.total - marks.pop(id(module)))

    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(enter),
                                                layer.register_forward_hook(leave))]
    try:
        _forward(program, batch, model, counter, fused=True)
    finally:
        for handle in handles:
            handle.remove()
    return max(per_layer, default=0)
