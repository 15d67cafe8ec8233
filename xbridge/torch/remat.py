"""Activation checkpointing of the model's layers (``StepOptions(remat=..., layers=...)``), the part every backend
shares: which ``nn.ModuleList`` holds the layers, what may not be recomputed, and each layer's ``forward`` replaced
by one that hands the layer to the backend's own checkpoint function:

- eager, inductor: ``torch.utils.checkpoint`` (non-reentrant; ``dots`` through selective checkpointing), here;
- xla: ``torch_xla.utils.checkpoint`` (backends/xlaspmd);
- jax: ``jax.checkpoint`` with a policy, through torchax (backends/jaxjit).

The layers keep their modules and parameter names (only the instance's ``forward`` is wrapped), so state,
checkpoints and parity see the model as the user wrote it. A layer's tensor arguments (positional or keyword, nested
in tuples, lists and dicts) are what the checkpoint saves; every other argument (None, flags, a cache object) is
passed through as it is. Under ``--rng portable`` a recomputed layer draws the bits its forward drew."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from xbridge.errors import ConfigError
from xbridge.ir.program import Program

from . import portable_rng

__all__ = ["Checkpoint", "apply", "find_layers", "recomputed", "refuse_different", "refuse_running_statistics",
           "scanned_layers", "torch_checkpoint"]

# (fn, tensors) -> fn(*tensors), with fn's intermediate values recomputed in the backward pass
Checkpoint = Callable[[Callable[..., Any], Sequence[torch.Tensor]], Any]

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default, torch.ops.aten._grouped_mm.default}


def find_layers(model: torch.nn.Module, path: str | None) -> tuple[str, torch.nn.ModuleList]:
    """The ``nn.ModuleList`` of layers: the one at ``path``, or (None) the longest one whose modules are all of one
    class (the first of equal length, in module order)."""
    if path is not None:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise ConfigError(f"StepOptions layers={path!r}: the model ({type(model).__name__}) has no submodule "
                              f"{path!r}") from None
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            raise ConfigError(f"StepOptions layers={path!r} is a {type(module).__name__}, not a non-empty "
                              "nn.ModuleList of layers")
        return path, module
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1]
    if not found:
        raise ConfigError(f"StepOptions remat: the model ({type(model).__name__}) has no nn.ModuleList of layers of "
                          "one class; name the layers with StepOptions(layers='path.to.modulelist')")
    return max(found, key=lambda item: len(item[1]))


def refuse_running_statistics(path: str, layers: torch.nn.ModuleList) -> None:
    """A layer recomputed in the backward pass runs its forward twice: BatchNorm would update its running statistics
    twice; a scanned layer's updates would be lost. Refused rather than silently wrong."""
    for name, module in layers.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            raise ConfigError(f"StepOptions remat/scan_layers: {path}.{name} is a {type(module).__name__} that updates "
                              "its running statistics in the forward pass, which a recomputed or scanned layer would "
                              "get wrong; turn them off or name other layers with StepOptions(layers=...)")


def _signature(layer: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(n, tuple(t.shape), t.dtype) for n, t in [*layer.named_parameters(), *layer.named_buffers()]]


def refuse_different(path: str, layers: torch.nn.ModuleList) -> None:
    """``scan_layers`` runs one layer's code for all of them: each must be of the first one's class, with the same
    parameters and buffers (names, shapes, dtypes)."""
    first = _signature(layers[0])
    for i, layer in enumerate(layers):
        if type(layer) is not type(layers[0]) or _signature(layer) != first:
            raise ConfigError(f"StepOptions scan_layers: {path}.{i} differs from {path}.0 in its class, parameters or "
                              "buffers (names, shapes, dtypes); scan_layers runs one layer's code for all of them "
                              "and needs identical layers")


def scanned_layers(model: torch.nn.Module, program: Program, backend: str,
                   unit: str) -> tuple[str, torch.nn.ModuleList] | None:
    """The layers ``StepOptions(scan_layers=True)`` names, checked for what every backend's scan refuses; None when
    scan_layers is off. ``unit``: what the backend traces once (a scanned layer, one compile region)."""
    if not program.step.scan_layers:
        return None
    if program.step.rng == "portable":
        raise ConfigError(f"StepOptions scan_layers with rng='portable' is not available on {backend}: the portable "
                          f"generator numbers its draws while tracing, and {unit} is traced once, so every layer "
                          "would draw the same bits; use rng='native' or scan_layers=False")
    path, layers = find_layers(model, program.step.layers)
    refuse_running_statistics(path, layers)
    refuse_different(path, layers)
    return path, layers


def apply(model: torch.nn.Module, program: Program, checkpoint: Checkpoint) -> str | None:
    """Wrap every layer's forward for ``program.step.remat`` (nothing for ``none``); returns the layers' path."""
    if program.step.remat == "none":
        return None
    path, layers = find_layers(model, program.step.layers)
    refuse_running_statistics(path, layers)
    for layer in layers:
        layer.forward = recomputed(layer.forward, checkpoint)
    return path


def recomputed(forward: Callable[..., Any], checkpoint: Checkpoint) -> Callable[..., Any]:
    """``forward`` run through ``checkpoint`` when gradients are on (its tensor arguments saved, the rest
    recomputed in the backward pass), as it is in an evaluation."""
    @functools.wraps(forward)
    def layer_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():         # evaluation: nothing is saved for a backward pass
            return forward(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        mode = portable_rng.active_mode()
        site = mode.site if mode is not None else 0

        def recompute(*tensors: torch.Tensor) -> Any:
            full = list(leaves)
            for i, tensor in zip(where, tensors):
                full[i] = tensor
            a, k = tree_unflatten(full, spec)
            if mode is None:
                return forward(*a, **k)
            with portable_rng.replaying(mode, site):
                return forward(*a, **k)

        return checkpoint(recompute, [leaves[i] for i in where])

    return layer_forward


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def torch_checkpoint(remat: str) -> Checkpoint:
    """torch.utils.checkpoint, non-reentrant (the form torch.compile traces); ``dots`` keeps the matmul outputs
    (selective activation checkpointing) and recomputes the rest."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context = (functools.partial(create_selective_checkpoint_contexts, _save_matmuls) if remat == "dots"
               else None)

    def run(fn: Callable[..., Any], tensors: Sequence[torch.Tensor]) -> Any:
        if context is None:
            return checkpoint(fn, *tensors, use_reentrant=False)
        return checkpoint(fn, *tensors, use_reentrant=False, context_fn=context)

    return run
