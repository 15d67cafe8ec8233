"""Module-by-module forward outputs, for finding where a backend first departs from the reference.

A backend's ``trace_modules(batch)`` runs one forward pass of the loss on the initial weights with forward hooks on
every submodule and returns each module's first floating output as numpy, in execution order (the shared helper
below does the hooking; the backend supplies the run and the conversion to numpy). ``first_divergence`` walks the
reference's order and names the first module whose output deviates beyond the tolerance.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import numpy as np


@contextlib.contextmanager
def recording(model: Any, to_numpy: Callable[[Any], np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    import torch

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


def relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)) /
                 max(float(np.linalg.norm(b.astype(np.float64))), 1e-12))


def first_divergence(reference: dict[str, np.ndarray], target: dict[str, np.ndarray],
                     rtol: float) -> tuple[str, float] | None:
    """The first module (in the reference's execution order) whose output deviates more than ``rtol``
    (relative L2); None if every module agrees. Outputs are recorded when modules finish, so the innermost
    module that deviates comes first."""
    for name, ref in reference.items():
        if name not in target:
            return name, float("inf")
        value = relative_l2(target[name], ref)
        if not value <= rtol:
            return name, value
    return None


def trace_torch(program: Any, model: Any, tensors: dict[str, Any], device_type: str, hint: Any) -> dict[str, np.ndarray]:
    """``trace_modules`` for the backends that run the torch module itself (eager, inductor, xla)."""
    import torch

    from . import hints
    from .torch_train import compute_context

    with torch.no_grad(), recording(model, lambda t: t.float().cpu().numpy()) as outputs, \
            compute_context(program.precision, device_type), hints.activate(hint):
        program.loss(model, tensors)
    return outputs
