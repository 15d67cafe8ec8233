"""The model as every torch-based stack builds it: the program's module with the initial weights, in the params
dtype, tied weights kept tied, outputs cast to the output dtype (the precision semantics: xbridge/torch/train.py).

Importing this module imports torch: the core never imports it, backends do when they lower."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from xbridge.ir.program import Program

from .seeding import seeded


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a precision's dtype name (xbridge.ir.precision.DTYPES: float32, bfloat16, float16)."""
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


def exact_fp32(device: torch.device) -> Callable[[], None]:
    """fp32 means fp32 on a GPU too: no TF32 in matmuls or convolutions (parity needs it; docs/parity.md). These are
    the process's global switches: returns what puts them back as they were (TorchExecutable.close, when the run
    ends), so a program that calls xbridge from its own process keeps its own settings afterwards."""
    if device.type != "cuda":
        return lambda: None
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    def restore() -> None:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn

    return restore


def build_model(program: Program, weights: dict[str, np.ndarray] | None, device: torch.device) -> torch.nn.Module:
    """Build the module, load ``weights`` (strictly: every name must match) and store it in the params dtype.
    ``weights=None``: the module keeps the values it was built with (a caller that feeds its parameters and buffers
    from elsewhere: jax)."""
    with seeded(program.seed), (torch.device("meta") if device.type == "meta" else contextlib.nullcontext()):
        model = program.model()     # on the meta device: built as shapes (xbridge compile), nothing initialised
    if weights is not None:
        state = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in weights.items()}
        model.load_state_dict(state, strict=True)
    ties = tied_groups(model)
    params_dtype = torch_dtype(program.precision.params)
    # Module.to(dtype) would cast complex tensors too (dropping the imaginary part): only floating ones take the
    # params dtype; complex ones keep theirs under every precision (docs/programs.md). _apply is what .to uses.
    model._apply(lambda t: t.to(device=device, dtype=params_dtype if t.is_floating_point() else None))
    retie(model, ties)
    _cast_outputs(model, torch_dtype(program.precision.output))
    model.train()
    if program.step.layers is not None:     # named layers: checked here, on every backend, whether used or not
        from .remat import find_layers

        find_layers(model, program.step.layers)
    return model


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (e.g. an embedding shared with the output layer)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model: torch.nn.Module, groups: list[list[str]]) -> None:
    """Moving to a device whose tensors cannot share a CPU tensor's storage (XLA) replaces each module's
    Parameter object and silently unties shared weights; point every name of a group at one Parameter again."""
    for first, *others in groups:
        shared = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if module._parameters[attr] is not shared:
                module._parameters[attr] = shared


def _cast_outputs(model: torch.nn.Module, dtype: torch.dtype) -> None:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, output)
    model.register_forward_hook(hook)
