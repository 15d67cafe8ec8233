"""Scan over layers on jax (``StepOptions(scan_layers=True, layers=...)``): the layers of one ``nn.ModuleList`` are
traced once and iterated by ``jax.lax.scan`` over their stacked parameters, so the compiled step holds one layer
whatever the depth.

The model's own loop stays as the user wrote it (``for block in self.blocks: x = block(x)``). The first layer's
forward runs the whole scan: the layers' parameters and buffers are stacked along a new leading axis, and the scan
body runs the first layer's module with each layer's slice substituted (``torch.func.functional_call``). The carry
is the first positional argument (the hidden states); every other argument is the same for every layer (masks,
position embeddings) and is closed over. The later layers then receive the scan's result and return it unchanged;
each checks that it is called in order on the previous layer's output, so a model that does something else between
its layers is refused rather than computed wrongly.

The parameters keep their eager names (``blocks.3.q.weight``): state, checkpoints and parity see the model as written.
Stacking copies the layers' parameters once per step; their gradients flow back through the stack to each layer.
Remat composes: each iteration runs the layer as ``StepOptions(remat=...)`` wrapped it (``jax.checkpoint``).
torchax's generator key (dropout under ``--rng native``) is carried through the scan, so each layer draws its own."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torchax
from torchax import interop

from xbridge.errors import ConfigError
from xbridge.ir.program import Program

from .._torch.remat import scanned_layers


def apply(model: torch.nn.Module, program: Program) -> str | None:
    """Make the layers one scan (nothing unless ``program.step.scan_layers``); returns the layers' path."""
    found = scanned_layers(model, program, "jax", "a scanned layer")
    if found is None:
        return None
    path, layers = found
    if len(layers) < 2:
        return path
    _Scan(path, layers)
    return path


class _Scan:
    def __init__(self, path: str, layers: torch.nn.ModuleList) -> None:
        self.path, self.layers = path, layers
        self.layer_forward = layers[0].forward       # as remat left it, if it did
        self.inside = False
        self.expected: torch.Tensor | None = None
        self.next = 0
        layers[0].forward = self.run
        for i, layer in enumerate(layers):
            if i:
                layer.forward = self._passthrough(i)

    def _passthrough(self, index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.next != index or not args or args[0] is not self.expected:
                raise ConfigError(f"StepOptions scan_layers: {self.path}.{index} was not called on the output of "
                                    f"{self.path}.{index - 1}; a scan over layers needs the model to call its layers "
                                    "in order, each on the previous one's output, with nothing in between")
            self.next = (index + 1) % len(self.layers)
            return args[0]

        return forward

    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.inside:                      # the scan body calling the first layer's module
            return self.layer_forward(*args, **kwargs)
        if not args or not isinstance(args[0], torch.Tensor):
            raise ConfigError(f"StepOptions scan_layers: {self.path}.0 takes no tensor as its first positional "
                                "argument, which a scan carries from layer to layer")
        env = torchax.default_env()
        first = self.layers[0]
        names = [n for n, _ in [*first.named_parameters(), *first.named_buffers()]]
        stacked = {}
        for name in names:
            per_layer = [interop.jax_view(functools.reduce(getattr, name.split("."), layer)) for layer in self.layers]
            stacked[name] = jnp.stack(per_layer)
        rest, kwargs_in = args[1:], kwargs

        def body(carry: tuple[jax.Array, jax.Array], slices: dict[str, jax.Array]) -> tuple[Any, None]:
            hidden, key = carry
            env.param.prng = key
            self.inside = True
            try:
                out = torch.func.functional_call(first, interop.torch_view(slices),
                                                 (interop.torch_view(hidden), *rest), kwargs_in)
            finally:
                self.inside = False
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(args[0].shape):
                raise ConfigError(f"StepOptions scan_layers: {self.path}.0 must return one tensor shaped like its "
                                    f"first argument, which the scan carries to the next layer; it returned "
                                    f"{type(out).__name__}")
            return (interop.jax_view(out).astype(hidden.dtype), env.param.prng), None

        (hidden, key), _ = jax.lax.scan(body, (interop.jax_view(args[0]), env.param.prng), stacked)
        env.param.prng = key
        result = interop.torch_view(hidden)
        self.expected, self.next = result, 1
        return result

