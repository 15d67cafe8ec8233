"""The program's weights as numpy: built once by the reference code path, checked against the program when they
come from outside (``--init-state``, a checkpoint).

torch is imported only inside the functions that build a model; the helpers that convert tensors take torch
tensors and need no import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ir.program import Program


def tensor_to_numpy(value: Any) -> np.ndarray:
    """A host copy; floating tensors in float32 (exact for bf16 and fp16). A DTensor (torch.distributed) is
    gathered to its full value first: a collective, so every rank must call this in the same order."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    value = value.detach().cpu()
    return (value.float() if value.is_floating_point() else value).numpy().copy()


def to_numpy_state(model: Any) -> dict[str, np.ndarray]:
    return {name: tensor_to_numpy(value) for name, value in model.state_dict().items()}


def initial_weights(program: Program) -> dict[str, np.ndarray]:
    """The program's initial weights: the model built under ``torch.manual_seed(program.seed)`` on the CPU in
    float32, as numpy under the state_dict names. Built once, handed to every backend."""
    from .seeding import seeded

    with seeded(program.seed):
        model = program.model()
    return to_numpy_state(model)


def meta_model(program: Program) -> Any:
    """The program's model built on the meta device (shapes and names only)."""
    import torch

    with torch.device("meta"):
        return program.model()


def shape_mismatch(program: Program, weights: dict[str, np.ndarray], source: str) -> str | None:
    """Why ``weights`` (from ``source``, e.g. "checkpoint 'ck/step-00000004'") are not this program's state: the
    first missing name, wrong shape or unexpected name, as one line; None when every name and shape matches."""
    expected = {name: tuple(t.shape) for name, t in meta_model(program).state_dict().items()}
    for name, shape in expected.items():
        if name not in weights:
            return f"{source} is missing tensor {name!r} of program {program.name!r}"
        if tuple(weights[name].shape) != shape:
            return (f"tensor {name!r} in {source} has shape {tuple(weights[name].shape)}, program "
                    f"{program.name!r} expects {shape}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        return f"{source} holds tensor {unexpected[0]!r}, which program {program.name!r} does not have"
    return None
