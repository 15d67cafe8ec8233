"""Module-by-module forward outputs of a torch module (``trace_modules``, behind ``parity --bisect``).

A backend's ``trace_modules(batch)`` runs one forward pass of the loss on the initial weights with forward hooks on
every submodule and returns each module's first floating output as numpy, in execution order: :func:`recording`
does the hooking (the backend supplies the conversion to numpy), :func:`trace_torch` the whole pass for the
backends that run the torch module itself. xbridge/parity/divergence.py compares the results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from xbridge import hints
from xbridge.ir.program import Program
from xbridge.weights import tensor_to_numpy

from .train import compute_context


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


def trace_torch(program: Program, model: torch.nn.Module, tensors: dict[str, torch.Tensor], device_type: str,
                hint: hints.Handler | None) -> dict[str, np.ndarray]:
    """``trace_modules`` for the backends that run the torch module itself (eager, inductor, xla)."""
    with torch.no_grad(), recording(model, tensor_to_numpy) as outputs, \
            compute_context(program, device_type), hints.activate(hint):
        program.loss(model, tensors)
    return outputs
