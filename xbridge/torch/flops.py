"""Model FLOPs per step (forward + backward of the global batch), counted with torch.utils.flop_counter.

The count runs on the meta device (shapes only, no arithmetic), so it is exact for what the counter knows
(matmuls, convolutions, attention) and costs milliseconds; a model the meta device refuses is counted on the CPU.
Optimizer and elementwise FLOPs are not counted, as in the usual MFU convention.
"""

from __future__ import annotations

from typing import Any

from ..data.source import checked_batch
from ..ir.loss import LossSum
from ..ir.program import Program
from .weights import meta_model


def flops_per_step(program: Program, batch: dict[str, Any] | None = None, cpu: bool = True) -> int:
    """The count on the meta device; where the model cannot run there (an operator whose meta function refuses
    the shapes or dtypes: transformers' grouped experts in fp32), on the CPU with the initial weights and one real
    batch instead (the same count, at the cost of one forward and backward pass), unless ``cpu`` is False (xbridge
    compile: a model sized for a TPU slice may not fit this machine), which raises the meta device's refusal."""
    batch = checked_batch(program.data, 0, program.seed) if batch is None else batch
    try:
        return _count(program, batch, "meta")
    except Exception:       # noqa: BLE001 - any refusal of the meta device: count on real tensors
        if not cpu:
            raise
        return _count(program, batch, "cpu")


def _count(program: Program, batch: dict[str, Any], device: str) -> int:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    if device == "meta":
        model = meta_model(program)
        from . import loss_check as check
        tensors = check.meta_batch(program.replace(precision="fp32"), batch)      # as meta_model builds the model
    else:
        from . import train as build
        from .weights import initial_weights
        model = build.build_model(program.replace(precision="fp32"), initial_weights(program), torch.device("cpu"))
        tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    counter = FlopCounterMode(display=False)
    with counter:
        out = program.loss(model, tensors)
        (out.total if isinstance(out, LossSum) else out).backward()
    return int(counter.get_total_flops())
