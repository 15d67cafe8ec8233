"""Module-by-module forward outputs and parameter gradients of a torch module (``trace_modules`` and
``trace_gradients``, behind ``--trace-modules`` and ``parity --bisect``).

A backend's ``trace_modules(batch)`` runs one forward pass of the loss on the initial weights with forward hooks on
every submodule and returns each module's first floating output as numpy, in execution order: :func:`recording`
does the hooking (the backend supplies the conversion to numpy), :func:`trace_torch` the whole pass for the
backends that run the torch module itself. ``trace_gradients(batch)`` differentiates the loss of that batch through
the backend's own step (:func:`gradients_torch` for those backends: the loss as the train step calls it, compiled
where the backend compiles it). Neither changes what training then computes: the buffers a training-mode forward
updates (BatchNorm's running statistics) and torch's CPU generator are put back (:func:`untouched`).
xbridge/parity/divergence.py compares the results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from xbridge import hints
from xbridge.ir.program import Program

from .train import compute_context, loss_parts, per_item
from .weights import tensor_to_numpy


@contextlib.contextmanager
def recording(model: torch.nn.Module, to_numpy: Callable[[Any], np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    outputs: dict[str, np.ndarray] = {}

    def first_tensor(value: Any) -> Any:
        leaves = torch.utils._pytree.tree_leaves(value)
        return next((t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), None)

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            tensor = first_tensor(output)
            if tensor is not None and name not in outputs:
                outputs[name] = np.asarray(to_numpy(tensor.detach()), dtype=np.float32)
        return hook

    handles = [module.register_forward_hook(hook_for(name or "<root>")) for name, module in model.named_modules()]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def untouched(model: torch.nn.Module) -> Iterator[None]:
    """The model's buffers and torch's CPU generator as they were before: a probe's forward in training mode
    (BatchNorm updates its running statistics, dropout draws) changes nothing that training then computes."""
    saved = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for name, buffer in model.named_buffers():
                    if name in saved:
                        buffer.copy_(saved[name])


def trace_torch(program: Program, model: torch.nn.Module, tensors: dict[str, torch.Tensor], device_type: str,
                hint: hints.Handler | None) -> dict[str, np.ndarray]:
    """``trace_modules`` for the backends that run the torch module itself (eager, inductor, xla)."""
    with untouched(model), torch.no_grad(), recording(model, tensor_to_numpy) as outputs, \
            compute_context(program, device_type), hints.activate(hint):
        program.loss(model, tensors)
    return outputs


def gradients_torch(program: Program, model: torch.nn.Module, loss_fn: Callable[..., Any],
                    tensors: dict[str, torch.Tensor], device_type: str, hint: hints.Handler | None,
                    draws: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                    settle: Callable[[], Any] | None = None) -> dict[str, np.ndarray]:
    """``trace_gradients`` for the backends that run the torch module itself: the gradient of the batch's loss (an
    ``xb.LossSum``'s total over its count) by every trained parameter that gets one, under torch's names, through
    ``loss_fn`` (the train step's own: compiled on inductor, lazy or Dynamo-captured on xla); no update, and the
    parameters' ``.grad`` as they were. ``settle``: run after the backward, before the gradients are read (torch_xla:
    one graph for them all, not one per gradient read)."""
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    saved = [param.grad for _, param in named]
    try:
        for _, param in named:
            param.grad = None
        with untouched(model), hints.activate(hint):
            with compute_context(program, device_type), draws():
                value, count = loss_parts(loss_fn(model, tensors), program)
            (value if count is None else per_item(value, count)).backward()
            if settle is not None:
                settle()
            return {name: np.asarray(tensor_to_numpy(param.grad), dtype=np.float32)
                    for name, param in named if param.grad is not None}
    finally:
        for (_, param), grad in zip(named, saved, strict=True):
            param.grad = grad
