"""Activation checkpointing on jax (``StepOptions(remat=...)``; the shared part is xbridge/torch/remat.py): each
layer runs as a JAX function (torchax's ``jax_view``) under ``jax.checkpoint``. ``full`` saves nothing inside the
layer; ``dots`` saves the outputs of its matrix products (``jax.checkpoint_policies.dots_saveable``, every
``dot_general``: torch's ``dots`` keeps mm, bmm and their fused forms alike). The parameters the layer reads are
closed over; jax differentiates them through the checkpoint as it does its explicit arguments. torchax's generator
key is threaded through as a value, so a recomputed layer draws what its forward drew."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
import torchax
from torchax import interop

from xbridge.torch.remat import Checkpoint


def checkpoint(remat: str) -> Checkpoint:
    policy = jax.checkpoint_policies.dots_saveable if remat == "dots" else None

    def run(fn: Callable[..., Any], tensors: Sequence[torch.Tensor]) -> Any:
        # torchax's generator key (--rng native: dropout, torch.rand) goes in and out of the layer as a value: set
        # inside jax.checkpoint's own trace, it would otherwise leak that trace's tracer into the rest of the step
        env = torchax.default_env()
        layer = interop.jax_view(fn)

        def keyed(key: jax.Array, *arrays: jax.Array) -> tuple[Any, jax.Array]:
            env.param.prng = key
            out = layer(*arrays)
            return out, env.param.prng

        out, env.param.prng = jax.checkpoint(keyed, policy=policy)(env.param.prng, *interop.jax_view(tuple(tensors)))
        return interop.torch_view(out)

    return run
