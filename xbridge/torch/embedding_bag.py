"""``aten::_embedding_bag`` (``nn.EmbeddingBag``, ``F.embedding_bag``) in static-shape torch operators, for the stacks
that cannot run torch's own kernel: torch_xla has none (it runs it on the CPU, which the one-graph step cannot stop
for), and torchax's lowering reads the bags' offsets as numpy, which fails on a traced array (every EmbeddingBag did:
torch makes the offsets of a 2-D input itself). Each index's bag is found by comparing its position with the bags'
offsets (one shape however the bags fall) and the bags are a one-hot product (sum, mean) or a masked maximum, with
``per_sample_weights``, ``padding_idx`` and ``include_last_offset`` as torch has them (an empty bag is zeros). Plain
operators, so autograd (xla) or JAX (jax) differentiates them. Registered by backends/xlaspmd/ops.py and
backends/jaxjit/ops.py."""

from __future__ import annotations

import torch

from xbridge.errors import LoweringError


def embedding_bag(weight: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
                  scale_grad_by_freq: bool = False, mode: int = 0, sparse: bool = False,
                  per_sample_weights: torch.Tensor | None = None, include_last_offset: bool = False,
                  padding_idx: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's ``_embedding_bag`` (mode 0 sum, 1 mean, 2 max): (output, offset2bag, bag_size, max_indices)."""
    if scale_grad_by_freq:
        raise LoweringError("nn.EmbeddingBag(scale_grad_by_freq=True) has no lowering on jax or xla; leave it off "
                            "or run on eager or inductor")
    count = indices.shape[0]
    ends = offsets[1:] if include_last_offset else torch.cat([offsets[1:], offsets.new_full((1,), count)])
    starts = offsets[:-1] if include_last_offset else offsets
    position = torch.arange(count, device=indices.device)
    member = (position[:, None] >= starts[None, :]) & (position[:, None] < ends[None, :])     # (indices, bags)
    if padding_idx >= 0:
        member = member & (indices != padding_idx)[:, None]
    rows = torch.nn.functional.embedding(indices, weight)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].to(rows.dtype)
    sizes = member.sum(dim=0)
    bags = torch.arange(starts.shape[0], device=indices.device)
    offset2bag = (member.to(torch.int64) * bags[None, :]).sum(dim=1)
    if mode == 2:
        masked = rows[None, :, :].expand(member.shape[1], -1, -1).masked_fill(~member.t()[:, :, None], float("-inf"))
        out = masked.amax(dim=1).masked_fill(sizes[:, None] == 0, 0.0)
        return out, offset2bag, sizes, torch.zeros_like(out, dtype=torch.int64)
    out = member.t().to(rows.dtype) @ rows
    if mode == 1:
        out = out / sizes.clamp(min=1)[:, None].to(out.dtype)
    return out, offset2bag, sizes, torch.zeros_like(sizes)
