"""Scan over layers on inductor (``StepOptions(scan_layers=True, layers=...)``): the layers of one ``nn.ModuleList``
become one nested compile region (``torch.compiler.nested_compile_region``, torch 2.9), so torch.compile traces and
compiles the first layer once and stamps that code out for every other layer (an ``invoke_subgraph`` per layer in
the one graph of the loss), instead of unrolling every layer's operations into the graph. The loss stays one
compiled graph, forward and backward; the parameters keep their eager names and modules.

One region function serves every layer: each layer's ``forward`` becomes that function bound to the layer, and the
layer's parameters and buffers reach it as the graph's inputs. Layers of different structure are refused, as are
layers that update running statistics in their forward (a compiled region may not mutate its inputs), and two
combinations measured wrong: ``remat`` (torch.utils.checkpoint around the region: wrong gradients with ``full``, a
failure with ``dots``) and ``rng='portable'`` (its draws are numbered while tracing, and the region is traced once).
Random ops under the native generator draw afresh in every layer (checked: four dropout layers, four masks)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from xbridge.errors import ConfigError
from xbridge.ir.program import Program

from .._torch.remat import scanned_layers

_regions: dict[Callable[..., Any], Callable[..., Any]] = {}     # a layer class's forward -> its one region


def apply(model: torch.nn.Module, program: Program) -> str | None:
    """Make the layers one compile region (nothing unless ``program.step.scan_layers``); returns their path."""
    if not program.step.scan_layers:
        return None
    if program.step.remat != "none":
        raise ConfigError(f"StepOptions scan_layers with remat={program.step.remat!r} is not available on inductor: "
                          "torch 2.9's torch.utils.checkpoint around a nested compile region gave wrong gradients "
                          "(full) or failed (dots) when measured; use one of them here (jax takes both)")
    found = scanned_layers(model, program, "inductor", "the layers' compile region")
    assert found is not None
    path, layers = found
    forward = type(layers[0]).forward
    region = _regions.get(forward)
    if region is None:
        region = _regions[forward] = torch.compiler.nested_compile_region(forward)
    for layer in layers:
        layer.forward = types.MethodType(region, layer)
    return path
