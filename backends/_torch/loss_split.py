"""Does the loss survive a split batch? The check parity runs when a backend that averages per-device losses (torch
DDP's semantics: inductor's ranks, jax's shard_map) fails: step 0's batch, in eval mode (no dropout) and fp32, taken
whole and taken as the shards such a backend sees.

A mean over a fixed number of items per row splits exactly; a mean over a count the data decides (a masked-LM mean
over the masked tokens) does not, and ``xb.LossSum`` is the way out."""

from __future__ import annotations

import numpy as np
import torch

from xbridge.data.contract import checked_batch
from xbridge.ir.program import Program

from .train import batch_to_torch, build_model, eval_parts, per_item, split_micro

__all__ = ["split_losses"]


def split_losses(program: Program, weights: dict[str, np.ndarray], parts: int) -> tuple[float, float]:
    """(the loss of step 0's batch as the reference takes it, the loss as a backend takes it that splits each
    micro-batch into ``parts`` row blocks and averages their losses; an ``xb.LossSum`` is totalled instead)."""
    program = program.replace(precision="fp32")
    device = torch.device("cpu")
    model = build_model(program, weights, device)
    batch = batch_to_torch(checked_batch(program.data, 0, program.seed), device, program.precision)

    def loss_of(pieces: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        found = [eval_parts(program.loss, model, piece, program, "cpu") for piece in pieces]
        values = torch.stack([v for v, _ in found])
        counts = [c for _, c in found if c is not None]
        if counts:      # xb.LossSum: the totals over the counts
            return per_item(values.sum(), torch.stack(counts).sum())
        return values.mean()

    micro = split_micro(batch, program.step.grad_accum)
    whole = loss_of(micro)
    split = loss_of([piece for m in micro for piece in split_micro(m, parts)])
    return float(whole), float(split)
