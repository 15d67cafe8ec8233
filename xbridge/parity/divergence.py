"""Where a backend first departs from the reference, module by module (``parity --bisect``).

Each target's ``trace_modules`` gives every module's first floating output of one forward pass, in execution order
(recorded by xbridge/torch/module_outputs.py); :func:`first_divergence` walks the reference's order and
names the first module whose output deviates beyond the tolerance.
"""

from __future__ import annotations

import numpy as np


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
