"""Does the loss survive a split batch? The check parity runs when a backend that averages per-device losses (torch
DDP's semantics: inductor's ranks, jax's shard_map) fails: step 0's batch, in eval mode (no dropout) and fp32, taken
whole and taken as the shards such a backend sees; the loss values and the gradients of both are compared.

A mean over a fixed number of items per row splits exactly; a mean over a count the data decides (a masked-LM mean
over the masked tokens) does not, and ``xb.LossSum`` is the way out. A term taken over the whole batch (a product
of two batch means: Switch Transformer's batch-wide load-balancing loss) can leave the loss value nearly unchanged
and still move the gradients of the parameters it trains (the router), which the gradients show."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from xbridge.data.source import checked_batch
from xbridge.ir.program import Program

from .train import batch_to_torch, build_model, compute_context, eval_mode, loss_parts, per_item, split_micro

__all__ = ["Split", "split_losses"]

# Gradients smaller than this share of the largest tensor's (RMS) are left out of the comparison: a true gradient of
# zero (attention's key bias) is all rounding noise, and its relative difference says nothing about the split
QUIET_GRADIENT = 1e-3


@dataclass(frozen=True)
class Split:
    whole: float                # step 0's loss as the reference takes it
    split: float                # as a backend takes it that averages its shards' losses
    gradients: dict[str, float]  # per parameter: RMS(gradient split - whole) / RMS(gradient whole)

    def worst_gradient(self) -> tuple[str, float]:
        return max(self.gradients.items(), key=lambda kv: kv[1], default=("", 0.0))


def split_losses(program: Program, weights: dict[str, np.ndarray], parts: int) -> Split:
    """Step 0's loss and gradients taken whole, and taken as a backend takes them that splits each micro-batch into
    ``parts`` row blocks and averages their losses (an ``xb.LossSum`` is totalled instead)."""
    program = program.replace(precision="fp32")
    device = torch.device("cpu")
    model = build_model(program, weights, device)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    batch = batch_to_torch(checked_batch(program.data, 0, program.seed), device, program.precision)

    def loss_and_grads(pieces: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, torch.Tensor]]:
        with eval_mode(model), compute_context(program, "cpu"):
            found = [loss_parts(program.loss(model, piece), program) for piece in pieces]
        values = torch.stack([v for v, _ in found])
        counts = [c for _, c in found if c is not None]
        loss = per_item(values.sum(), torch.stack(counts).sum()) if counts else values.mean()
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        return float(loss.detach()), {n: g.double() for n, g in zip(params, grads) if g is not None}

    micro = split_micro(batch, program.step.grad_accum)
    whole, whole_grads = loss_and_grads(micro)
    split, split_grads = loss_and_grads([piece for m in micro for piece in split_micro(m, parts)])
    scale = {n: float(g.pow(2).mean().sqrt()) for n, g in whole_grads.items()}
    loudest = max(scale.values(), default=0.0)
    gradients = {n: float((split_grads[n] - g).pow(2).mean().sqrt()) / scale[n] for n, g in whole_grads.items()
                 if n in split_grads and scale[n] > QUIET_GRADIENT * loudest}
    return Split(whole, split, gradients)
