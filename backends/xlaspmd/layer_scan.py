"""Scan over layers on torch_xla (``StepOptions(scan_layers=True, layers=...)``): the layers of one ``nn.ModuleList``
run as one ``torch_xla.experimental.scan.scan`` (an XLA ``While`` loop whose body is the first layer, traced once by
AOTAutograd, forward and backward) over their stacked parameters, so the step's graph holds one layer whatever the
depth. How the model's own loop is taken over is shared with jax (xbridge/torch/layer_scan.py). The layers' trained
parameters are held stacked between steps (xbridge/torch/layer_stacks.py), so the scan reads them as they are and
the optimizer updates one tensor per layer-relative name.

torch_xla's ``scan_layers`` carries one tensor; a decoder layer also takes masks and position embeddings, and a tensor
the body closes over would get no gradient from torch_xla's scan (and, traced once, would be baked into the cached
graph). So every tensor argument is an explicit input: floating ones ride in the carry unchanged (their gradients
come back through it), the others (integer positions, boolean masks) are broadcast along the layers as scanned
inputs. Arguments that are not tensors are part of the traced layer. An object among them (a Hugging Face KV cache
the model builds for each forward) reaches every trace as a fresh copy of what the model passed, since AOTAutograd
calls the layer more than once while tracing it and a cache filled by one call would become a constant of the next;
what a layer writes into such an object is not kept (a training step does not read it). The traced forward and
backward graphs are reused across steps (``is_fn_pure``) for the same shapes and the same plain arguments (None,
numbers, strings) and cache types; with any other object the layer is traced again in every step.

Layers that draw random numbers (dropout) are refused with one line when the layer is first traced: torch_xla 2.9's
scan fails on them (measured: "Dynamic update slice update element type does not match argument" for the dropout
mask it keeps for the backward pass, and a segmentation fault inside the step). Sharding hints
(``xb.shard``) inside a scanned layer are not part of AOTAutograd's graph: GSPMD propagates the shardings of the
stacked parameters and the carry into the loop instead."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from xbridge.errors import ConfigError
from xbridge.ir.program import Program
from xbridge.torch.layer_scan import LayerScan
from xbridge.torch.remat import scanned_layers

from . import layer_scan_loops
from .remat import scan_partition


def apply(model: torch.nn.Module, program: Program, target: str, mode: str) -> _XlaScan | None:
    """Make the layers one scan (nothing unless ``program.step.scan_layers``, and at least two layers); with
    ``remat`` the scan recomputes them (:func:`backends.xlaspmd.remat.scan_partition`), so the caller leaves the
    layers' forwards unwrapped."""
    found = scanned_layers(model, program, target, "a scanned layer")
    if found is None:
        return None
    if mode == "openxla":
        # measured: "RuntimeError: Expected XLA tensor. Got: XLAFloatType" (Dynamo's fake tensors reach the scan)
        raise ConfigError(f"StepOptions scan_layers is not available with --xla-mode openxla on {target}: Dynamo "
                          "cannot trace torch_xla's scan; use --xla-mode lazy")
    path, layers = found
    return _XlaScan(path, layers, target, scan_partition(program.step.remat)) if len(layers) >= 2 else None


class _RandomOps(TorchDispatchMode):
    """The first operation seen that draws from the generator (``torch.Tag.nondeterministic_seeded``)."""

    seen: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.seen is None and torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = func
        return func(*args, **(kwargs or {}))


class _XlaScan(LayerScan):
    def __init__(self, path: str, layers: torch.nn.ModuleList, target: str,
                 partition: Callable[..., Any]) -> None:
        super().__init__(path, layers)
        self.target, self.partition = target, partition
        self._bodies: dict[Any, Callable[..., Any]] = {}     # their loops reused by the caching scan (patches.py)

    def scan(self, hidden: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        from torch_xla.experimental.scan import scan

        leaves, spec = tree_flatten((rest, kwargs))
        floats = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
        others = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and i not in floats]
        fixed = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor))
        count = len(self.layers)
        weights = self.stacked_weights()
        broadcast = [leaves[i].expand(count, *leaves[i].shape) for i in others]
        # torch_xla's own cache of traced graphs knows shapes and dtypes only: a layer traced without gradients (an
        # evaluation) or in eval mode must not serve a training step (measured: the parameters' gradients were lost)
        needs = (torch.is_grad_enabled(), self.layers[0].training, hidden.requires_grad,
                 tuple(w.requires_grad for w in weights.values()), tuple(leaves[i].requires_grad for i in floats))
        key = _key(spec, fixed, needs)
        body = self._bodies.get(key) if key is not None else None
        if body is None:
            body = self._body(spec, len(leaves), floats, others, dict(fixed))
            if key is not None:
                self._bodies[key] = body
        if key is not None:
            layer_scan_loops.remember(body)
        carry, _ = scan(body, (hidden, *[leaves[i] for i in floats]), (weights, broadcast),
                        is_fn_pure=key is not None, partition_fn=self.partition)
        return carry[0]

    def _body(self, spec: Any, size: int, floats: list[int], others: list[int],
              fixed: dict[int, Any]) -> Callable[..., Any]:
        def body(carry: tuple[torch.Tensor, ...], x: tuple[dict[str, torch.Tensor], list[torch.Tensor]]) -> Any:
            state, *passed = carry
            weights, sliced = x
            leaves: list[Any] = [_fresh(fixed.get(i)) for i in range(size)]
            for i, tensor in zip(floats, passed):
                leaves[i] = tensor
            for i, tensor in zip(others, sliced):
                leaves[i] = tensor
            rest, kwargs = tree_unflatten(leaves, spec)
            with _RandomOps() as random:
                out = self.call_first(weights, state, rest, kwargs)
            if random.seen is not None:
                raise ConfigError(f"StepOptions scan_layers is not available on {self.target} for layers that draw "
                                  f"random numbers: {self.path}.0 calls {random.seen} (dropout?), and torch_xla "
                                  "2.9's scan fails on it (measured: a crash inside the step); set the layers' "
                                  "dropout to 0 or use scan_layers=False here (jax and inductor scan such layers)")
            return (out.to(state.dtype), *passed), None

        return body


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _is_cache(value: Any) -> bool:
    """A transformers KV cache (``transformers.cache_utils.Cache`` and its subclasses), told without importing it."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(value).__mro__)


def _key(spec: Any, fixed: tuple[tuple[int, Any], ...], needs: tuple[Any, ...]) -> Any:
    """What makes a traced layer reusable: the arguments' structure and their plain values and cache types; None
    (trace again) when an argument is some other object, whose contents the trace may depend on."""
    parts: list[Any] = []
    for i, value in fixed:
        if isinstance(value, _PLAIN):
            parts.append((i, value))
        elif _is_cache(value):
            parts.append((i, type(value)))
        else:
            return None
    return spec, tuple(parts), needs


def _fresh(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:          # an object that cannot be copied is passed as it is
        return value
