"""Where a backend first departs from the reference, module by module (``parity --bisect``).

Each target's ``--trace-modules`` file holds every module's first floating output of one forward pass, in execution
order, and every trained parameter's gradient of that batch's loss (``grad:NAME``; xbridge/torch/module_outputs.py,
a backend's ``trace_gradients``). :func:`first_divergence` walks the reference's forward order and names the first
module whose output deviates beyond the tolerance; :func:`first_gradient_divergence` walks the backward order and
names the first module whose parameters' gradients do: a target that differs only in its backward (a custom
``autograd.Function``'s backward a stack does not honour) has no divergent forward output but a divergent gradient.
"""

from __future__ import annotations

import numpy as np

from ..contract.capabilities import GRADIENT_PREFIX

GRADIENT_FLOOR = 1e-4     # of the largest gradient norm: below it, a parameter's gradient is taken as zero


def relative_l2(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)) /
                 max(float(np.linalg.norm(b.astype(np.float64))), 1e-12))


def first_divergence(reference: dict[str, np.ndarray], target: dict[str, np.ndarray],
                     rtol: float) -> tuple[str, float] | None:
    """The first module (in the reference's execution order) whose output deviates more than ``rtol``
    (relative L2); None if every module agrees. Outputs are recorded when modules finish, so the innermost
    module that deviates comes first. The traces' gradients are not looked at here."""
    reference, target = split_trace(reference)[0], split_trace(target)[0]
    for name, ref in reference.items():
        if name not in target:
            return name, float("inf")
        value = relative_l2(target[name], ref)
        if not value <= rtol:
            return name, value
    return None


def split_trace(trace: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A ``--trace-modules`` file's (module outputs, parameter gradients), each in the order written."""
    outputs = {k: v for k, v in trace.items() if not k.startswith(GRADIENT_PREFIX)}
    gradients = {k.removeprefix(GRADIENT_PREFIX): v for k, v in trace.items() if k.startswith(GRADIENT_PREFIX)}
    return outputs, gradients


def backward_order(outputs: dict[str, np.ndarray], gradients: dict[str, np.ndarray]) -> list[tuple[str, list[str]]]:
    """(module, its own parameters) in the order backpropagation reaches them: the modules in the reverse of the
    order their forward outputs were recorded, then any module with parameters but no recorded output (in
    parameter order)."""
    owners: dict[str, list[str]] = {}
    for name in gradients:
        owners.setdefault(name.rpartition(".")[0] or "<root>", []).append(name)
    ordered = [module for module in reversed(list(outputs)) if module in owners]
    ordered += [module for module in owners if module not in ordered]
    return [(module, owners[module]) for module in ordered]


def first_gradient_divergence(reference: dict[str, np.ndarray], target: dict[str, np.ndarray],
                              rtol: float) -> tuple[str, str, float] | None:
    """The first module, in backward order (:func:`backward_order` of the reference's trace), one of whose own
    parameters' gradients deviates more than ``rtol`` (relative L2, against at least :data:`GRADIENT_FLOOR` of the
    largest gradient norm) from the reference's: (module, parameter,
    deviation); None if every gradient both traces hold agrees. A gradient the backward of a module gets wrong
    spoils the gradients of every module before it too, so the first one named is where it went wrong."""
    ref_outputs, ref_grads = split_trace(reference)
    _, grads = split_trace(target)
    # a parameter with no true gradient (the reference's is rounding noise) is held to the model's gradient scale,
    # not to its own noise
    floor = GRADIENT_FLOOR * max((float(np.linalg.norm(g.astype(np.float64))) for g in ref_grads.values()), default=0)

    def deviation(name: str) -> float:
        got, ref = grads[name], ref_grads[name]
        if got.shape != ref.shape:
            return float("inf")
        diff = np.linalg.norm(got.astype(np.float64) - ref.astype(np.float64))
        return float(diff / max(float(np.linalg.norm(ref.astype(np.float64))), floor, 1e-30))

    for module, names in backward_order(ref_outputs, ref_grads):
        worst = max(((deviation(name), name) for name in names if name in grads), default=None)
        if worst is not None and not worst[0] <= rtol:
            return module, worst[1], worst[0]
    return None
