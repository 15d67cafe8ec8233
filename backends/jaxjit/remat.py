"""Activation checkpointing on jax (``StepOptions(remat=...)``; the shared part is backends/_torch/remat.py): each
layer runs as a JAX function (torchax's ``jax_view``) under ``jax.checkpoint``. ``full`` saves nothing inside the
layer; ``dots`` saves the outputs of its matrix products (``jax.checkpoint_policies.dots_saveable``, every
``dot_general``: torch's ``dots`` keeps mm, bmm and their fused forms alike). The parameters the layer reads are
closed over; jax differentiates them through the checkpoint as it does its explicit arguments."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import torch
from torchax import interop

from .._torch.remat import Checkpoint


def checkpoint(remat: str) -> Checkpoint:
    policy = jax.checkpoint_policies.dots_saveable if remat == "dots" else None

    def run(fn: Callable[..., Any], tensors: Sequence[torch.Tensor]) -> Any:
        return interop.call_jax(jax.checkpoint(interop.jax_view(fn), policy=policy), *tensors)

    return run
