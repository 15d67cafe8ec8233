"""Scan over layers on jax (``StepOptions(scan_layers=True, layers=...)``): the layers of one ``nn.ModuleList`` are
traced once and iterated by ``jax.lax.scan`` over their stacked parameters, so the compiled step holds one layer
whatever the depth. How the model's own loop is taken over is shared with xla (xbridge/torch/layer_scan.py).

The layers' trained parameters are held stacked between steps (backends/jaxjit/layer_stacks.py) and read by the scan as
they are; the rest of the layers' tensors (buffers, frozen parameters) are stacked along a new leading axis in every
step. Remat composes: each iteration runs the layer as ``StepOptions(remat=...)`` wrapped it (``jax.checkpoint``).
torchax's generator key (dropout under ``--rng native``) is carried through the scan, so each layer draws its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torchax
from torchax import interop

from xbridge.ir.program import Program
from xbridge.torch.layer_scan import LayerScan
from xbridge.torch.remat import scanned_layers


def apply(model: torch.nn.Module, program: Program) -> JaxScan | None:
    """Make the layers one scan (nothing unless ``program.step.scan_layers``, and at least two layers)."""
    found = scanned_layers(model, program, "jax", "a scanned layer")
    if found is None or len(found[1]) < 2:
        return None
    return JaxScan(*found)


class JaxScan(LayerScan):
    def __init__(self, path: str, layers: torch.nn.ModuleList) -> None:
        super().__init__(path, layers)
        self.stacked: dict[str, jax.Array] = {}

    @contextlib.contextmanager
    def given(self, stacked: dict[str, jax.Array]) -> Iterator[None]:
        """While a loss is traced: the layer-relative names whose every layer's array the state holds stacked
        already (backends/jaxjit/layer_stacks.py); the scan reads them as they are, and stacks only the others."""
        before, self.stacked = self.stacked, stacked
        try:
            yield
        finally:
            self.stacked = before

    def scan(self, hidden: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        env = torchax.default_env()
        stacked = {name: self.stacked[name] if name in self.stacked else
                   jnp.stack([interop.jax_view(t) for t in tensors]) for name, tensors in self.weights().items()}

        def body(carry: tuple[jax.Array, jax.Array], slices: dict[str, jax.Array]) -> tuple[Any, None]:
            state, key = carry
            env.param.prng = key
            out = self.call_first(interop.torch_view(slices), interop.torch_view(state), rest, kwargs)
            return (interop.jax_view(out).astype(state.dtype), env.param.prng), None

        (state, key), _ = jax.lax.scan(body, (interop.jax_view(hidden), env.param.prng), stacked)
        env.param.prng = key
        return interop.torch_view(state)
