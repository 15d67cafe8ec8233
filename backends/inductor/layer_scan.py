"""Scan over layers on inductor (``StepOptions(scan_layers=True, layers=...)``): the layers of one ``nn.ModuleList``
become one nested compile region (``torch.compiler.nested_compile_region``, torch 2.9), so torch.compile traces and
compiles the first layer once and stamps that code out for every other layer (an ``invoke_subgraph`` per layer in
the one graph of the loss), instead of unrolling every layer's operations into the graph. The loss stays one
compiled graph, forward and backward; the parameters keep their eager names and modules.

Only on torch 2.9 (:data:`VERIFIED`): on torch 2.14.1 the region, bound to each layer, computes every layer with one
layer's weights (a four-layer GPT's step-0 loss 3e-3 from eager's; a toy of four Linear layers 17.01 against
14.73), and a region over ``torch.func.functional_call`` with each layer's tensors as its inputs got the forward
right and the first layer's gradients wrong (measured 2026-12-07). Elsewhere scan_layers is refused before
anything compiles.

One region function serves every layer: each layer's ``forward`` becomes that function bound to the layer, and the
layer's parameters and buffers reach it as the graph's inputs. Layers of different structure are refused, as are
layers that update running statistics in their forward (a compiled region may not mutate its inputs), and
``rng='portable'`` (its draws are numbered while tracing, and the region is traced once). Random ops under the native
generator draw afresh in every layer (checked: four dropout layers, four masks).

With ``remat`` the checkpoint runs inside the region (the region's function calls the layer's forward through
torch.utils.checkpoint, ``dots`` with its selective policy), so the one traced subgraph recomputes itself. Around
the region it was measured wrong: the gradients were off with ``full`` (the loss 2e-4 from eager's at the second
step) and ``dots`` failed."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from xbridge.errors import ConfigError
from xbridge.ir.program import Program
from xbridge.torch.remat import recomputed, scanned_layers, torch_checkpoint

_regions: dict[tuple[Callable[..., Any], str], Callable[..., Any]] = {}   # (forward, remat) -> its one region
VERIFIED = ">=2.9,<2.10"     # the torch releases whose nested compile region gives eager's losses here


def refuse_where_wrong(version: str) -> None:
    """scan_layers on inductor only on a torch it was measured right on (the module docstring says why)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    release = Version(version).base_version
    if release not in SpecifierSet(VERIFIED):
        raise ConfigError(f"StepOptions scan_layers is not available on inductor with torch {release}: its nested "
                          "compile region gives wrong losses there (every layer computed with one layer's weights; "
                          f"right on torch {VERIFIED}); use scan_layers=False, or jax or xla, which scan on any "
                          "torch")


def apply(model: torch.nn.Module, program: Program) -> str | None:
    """Make the layers one compile region (nothing unless ``program.step.scan_layers``); returns their path."""
    if not program.step.scan_layers:
        return None
    refuse_where_wrong(torch.__version__)
    found = scanned_layers(model, program, "inductor", "the layers' compile region")
    assert found is not None
    path, layers = found
    forward = type(layers[0]).forward
    key = (forward, program.step.remat)
    region = _regions.get(key)
    if region is None:
        body = forward if program.step.remat == "none" else _recomputing(forward, program.step.remat)
        region = _regions[key] = torch.compiler.nested_compile_region(body)
    for layer in layers:
        layer.forward = types.MethodType(region, layer)
    return path


def _recomputing(forward: Callable[..., Any], remat: str) -> Callable[..., Any]:
    """A layer class's ``forward`` that runs itself through torch.utils.checkpoint (``remat``)."""
    checkpoint = torch_checkpoint(remat)

    def body(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        def layer(*a: Any, **k: Any) -> Any:        # a closure: Dynamo does not trace types.MethodType
            return forward(self, *a, **k)

        return recomputed(layer, checkpoint)(*args, **kwargs)

    return body
