"""Activation checkpointing on torch_xla (``StepOptions(remat=...)``; the shared part is xbridge/torch/remat.py):
``torch_xla.utils.checkpoint.checkpoint``, torch's reentrant checkpoint with an optimization barrier on the saved
inputs so that XLA does not fold the recomputation back into the forward pass. It recomputes whole layers and takes
no policy (torch_xla 2.9: no ``context_fn``, and ``use_reentrant=False`` raises), so ``dots`` is refused; under
``--xla-mode openxla`` Dynamo breaks its graph at the checkpoint and the gradients came out wrong, so remat is
refused there (lazy mode only).

Scanned layers (``scan_layers``) are recomputed by the scan itself instead: torch_xla's scan traces the layer with
AOTAutograd, which cannot trace torch_xla's checkpoint, and takes the partition of the layer's joint forward and
backward graph as ``partition_fn`` (:func:`scan_partition`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from xbridge.errors import ConfigError
from xbridge.torch.remat import Checkpoint


def checkpoint(remat: str, target: str, mode: str) -> Checkpoint:
    if remat != "none" and mode == "openxla":
        # measured: Dynamo breaks its graph at torch_xla's checkpoint and the GPT's loss at step 1 came out 4% off
        raise ConfigError(f"StepOptions remat={remat!r} is not available with --xla-mode openxla on {target}: Dynamo "
                          "does not trace torch_xla's checkpoint (the results came out wrong); use --xla-mode lazy")
    if remat == "dots":
        raise ConfigError(f"StepOptions remat='dots' is not available on {target}: torch_xla's checkpoint "
                          "(torch_xla.utils.checkpoint) recomputes whole layers and takes no policy; use remat='full'")
    from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

    def run(fn: Callable[..., Any], tensors: Sequence[torch.Tensor]) -> Any:
        return xla_checkpoint(fn, *tensors)

    return run


def scan_partition(remat: str) -> Callable[..., Any]:
    """The partition of a scanned layer's joint forward and backward graph for ``remat``: AOTAutograd's min-cut
    partitioner (torch.compile's own; torch_xla's scan defaults to ``default_partition``, which saves everything the
    forward computed that the backward reads).

    ``none``: the min-cut partitioner as torch.compile runs it. It recomputes cheap elementwise operations in the
    backward loop instead of saving their outputs (never a matrix product), so fewer tensors are written to and read
    from the stacked buffers the forward loop saves. That traffic is what made the scanned step slower than the
    unrolled one on XLA:CPU (bench/depth.py, 8 layers: 1.07x with the default partition, 1.00x with this one, the
    same losses bit for bit).

    ``full``: the same partitioner with an activation memory budget of 0, which saves the layer's inputs only
    (``choose_saved_values_set`` returns the graph's inputs at budget 0), so the backward loop recomputes the whole
    layer. What the forward loop saves are its outputs, stacked over the layers, so XLA cannot fold the
    recomputation back into the forward pass (it does so without a scan on CPU)."""
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if remat != "full":
        return min_cut_rematerialization_partition

    def full(joint: Any, inputs: Any, **kwargs: Any) -> Any:
        with functorch_config.patch(activation_memory_budget=0.0):
            return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    return full
