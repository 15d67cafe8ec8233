"""Model FLOPs per step (forward + backward of the global batch), counted with torch.utils.flop_counter.

The count runs on the meta device (shapes only, no arithmetic), so it is exact for what the counter knows
(matmuls, convolutions, attention) and costs milliseconds. Optimizer and elementwise FLOPs are not counted,
as in the usual MFU convention.
"""

from __future__ import annotations

from typing import Any

from ..data.contract import checked_batch
from ..ir.program import Program
from ..weights import meta_model


def flops_per_step(program: Program, batch: dict[str, Any] | None = None) -> int:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    batch = checked_batch(program.data, 0, program.seed) if batch is None else batch
    model = meta_model(program)
    meta_batch = {k: torch.empty(v.shape, dtype=torch.from_numpy(v[:0]).dtype, device="meta")
                  for k, v in batch.items()}
    counter = FlopCounterMode(display=False)
    with counter:
        loss = program.loss(model, meta_batch)
        loss.backward()
    return int(counter.get_total_flops())
