"""Which attention kernel ran: each ``F.scaled_dot_product_attention`` call of a training forward pass, named by the
kernel that carried it out.

torch picks a kernel per call from the inputs (device, dtype, mask, dropout, whether gradients are wanted):
``_scaled_dot_product_flash_attention_for_cpu`` on CPU, flash, memory-efficient or cuDNN on CUDA, and the math path
(matmuls and a softmax) when none applies. :func:`probe` runs one forward pass of the loss as a training step runs it
(train mode, gradients on, the step's precision) and records, below autograd, which of those operators each call
reached; a call that reached none ran the math path. Nothing of the run is disturbed: the random generators are
forked, the buffers the forward updates (BatchNorm) are put back, and no backward pass runs. On lazy tensors
(torch_xla) nothing is executed either: the traced graph is dropped.

Eager and xla report what they run. Inductor reports the operator AOTAutograd traced into the graph it compiled
(the same dispatcher choice, made at trace time). jax reports torchax's lowering (backends/jaxjit)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from xbridge import hints
from xbridge.ir.program import Program

from .train import compute_context

__all__ = ["KERNELS", "MATH", "PORTABLE", "AttentionCalls", "meta_calls", "probe"]

# torch's fused attention operators -> the kernel's name in the run record
KERNELS = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_fused_attention_overrideable": "fused (device plugin)",
}
MATH = "math"
PORTABLE = "math (--rng portable dropout)"


class _Operators(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.fused: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in KERNELS:
            self.fused.append(KERNELS[name])
        return func(*args, **(kwargs or {}))


def _dropout_p(args: Any, kwargs: dict[str, Any]) -> float:
    return kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)


class AttentionCalls(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` calls, and those with dropout (the meta-device runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.with_dropout = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.count += 1
            self.with_dropout += bool(_dropout_p(args, kwargs))
        return func(*args, **kwargs)


class _Calls(TorchFunctionMode):
    """Each attention call run under a fresh dispatch recorder; its kernel counted."""

    def __init__(self, portable: bool, math: str = MATH) -> None:
        super().__init__()
        self.portable = portable
        self.math = math
        self.kernels: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        if self.portable and _dropout_p(args, kwargs):   # computed by the portable generator in plain ops
            self.kernels[PORTABLE] += 1
            return func(*args, **kwargs)
        recorder = _Operators()
        with recorder:
            out = func(*args, **kwargs)
        self.kernels[recorder.fused[0] if recorder.fused else self.math] += 1
        return out


def probe(program: Program, model: torch.nn.Module, tensors: dict[str, torch.Tensor], device_type: str,
          hint: hints.Handler | None, math: str = MATH) -> dict[str, int]:
    """``{kernel: calls}`` over one training forward pass of ``program.loss`` on ``tensors``; empty when the model
    calls no ``scaled_dot_product_attention``; ``math`` names the math path (xla: run by XLA). A model whose
    parameters are DTensors (inductor's ranks) runs it without gradients: FSDP2 expects the backward pass of a
    forward that wants them."""
    calls = _Calls(program.step.rng == "portable", math)
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if device_type == "cuda" else []
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=devices), torch.set_grad_enabled(not sharded), \
                compute_context(program, device_type), hints.activate(hint), calls:
            program.loss(model, tensors)
    finally:
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(buffers[name])
        model.train(was_training)
        if sharded:     # FSDP2 keeps the root's parameters gathered after a forward (for the backward it expects)
            for module in model.modules():
                reshard = getattr(module, "reshard", None) if type(module).__name__.startswith("FSDP") else None
                if callable(reshard):
                    reshard()
    return dict(sorted(calls.kernels.items()))


def meta_calls(program: Program, kernel: str) -> dict[str, int] | None:
    """For a backend whose kernel is fixed by its lowering (jax: torchax's): the training forward's attention calls
    counted on the meta device (shapes only), each named ``kernel``; None when the model cannot run on meta."""
    from .loss_check import meta_batch
    from .weights import meta_model

    model = meta_model(program)
    model.train()
    batch = meta_batch(program)
    calls = AttentionCalls()
    try:
        with calls:
            program.loss(model, batch)
    except Exception:
        return None
    portable = calls.with_dropout if program.step.rng == "portable" else 0     # drawn by the portable generator
    out = {kernel: calls.count - portable, PORTABLE: portable}
    return dict(sorted((name, n) for name, n in out.items() if n))
