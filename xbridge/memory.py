"""Memory per device before a run (``xbridge inspect``): parameters, gradients, optimizer state and activations for
a mesh, a precision and a remat choice, so that a user sees whether a run fits before starting it.

- parameters: each parameter's shard on one device, in the parameter dtype (the sharding plan);
- gradients: the same for every trainable parameter (gradients take their parameter's dtype and layout);
- optimizer state: fp32 slots per trainable element, as every backend keeps them (AdamW: exp_avg and exp_avg_sq;
  SGD: a momentum buffer when momentum > 0), laid out as their parameter;
- activations: what autograd keeps between the forward and backward pass of one micro-batch, measured on the meta
  device with the layers wrapped for the remat choice (xbridge/torch/memory_estimate.py), divided by the number
  of row blocks the batch is split into; attention counted as a fused kernel keeps it (torch's flash, memory-
  efficient and cuDNN kernels: eager and inductor on CPU and GPU) and, apart, as the math path keeps it (the S x S
  probabilities: torchax's and torch_xla's attention). Activations inside a tensor-parallel layer are split over
  the model axis as well; they are counted whole here, so the figure is an upper bound there.

Not counted: the framework's workspace, the compiler's temporaries and fusion choices (XLA and Inductor may keep
less or more than eager), the batch itself, and allocator fragmentation. docs/depth-and-memory.md compares the
estimate with measured peaks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .ir.optim import SGD, AdamW
from .ir.program import Program
from .planner import ShardingPlan, batch_parts

OPTIMIZER_STATE_BYTES = 4      # fp32 slots (backends/jaxjit/optimizers.py, torch.optim with fp32 state)


@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    activations: int | None     # kept for the backward pass of one micro-batch, per device (fused attention)
    activations_math_attention: int | None     # the same where attention runs as matmuls and a softmax (jax, xla)
    recompute: int | None       # remat: what recomputing the largest layer adds during the backward pass
    remat: str
    activations_error: str | None = None    # why the activations are unknown (the model cannot run on meta)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + (self.activations or 0) + (self.recompute or 0)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def optimizer_slots(program: Program) -> int:
    spec = program.optimizer
    if isinstance(spec, AdamW):
        return 2
    if isinstance(spec, SGD):
        return 1 if spec.momentum > 0 else 0
    return 0


def estimate(program: Program, plan: ShardingPlan, batch: dict[str, Any]) -> MemoryEstimate:
    """Bytes per device for ``program`` laid out by ``plan``; ``batch`` is one batch of its data (shapes)."""
    from .torch.weights import meta_model

    trainable = {name for name, p in meta_model(program).named_parameters() if p.requires_grad}
    params = sum(p.shard_bytes for p in plan.params)
    grads = sum(p.shard_bytes for p in plan.params if p.name in trainable)
    elements = sum(math.prod(p.shard_shape) for p in plan.params if p.name in trainable)
    optimizer = optimizer_slots(program) * elements * OPTIMIZER_STATE_BYTES
    from .torch import memory_estimate as measure
    try:
        saved = measure.saved_bytes(program, batch)
    except Exception as exc:    # noqa: BLE001 - an operator the meta device refuses: the rest is still known
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return MemoryEstimate(params, grads, optimizer, None, None, None, program.step.remat,
                              f"the model cannot run on the meta device ({reason})")
    parts = batch_parts(program, plan.devices)
    return MemoryEstimate(params, grads, optimizer, saved.fused // parts, saved.math // parts, saved.layer // parts,
                          program.step.remat)
