"""The capabilities of an executable that holds a torch model and a :class:`~xbridge.torch.train.TrainStep` (eager,
inductor, xla), each a collaborator of its own (``executable.parts``, xbridge/contract/executable.py): what the run
record says about the run (:class:`TorchDiagnostics`), the probes of one forward pass (:class:`TorchProbes`) and
torch's profiler (:class:`TorchProfiling`). A backend subclasses the one whose answers differ on its stack."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from xbridge.contract import Diagnostics, Probes, Profiling

from . import attention
from .matmul_census import count_torch
from .module_outputs import gradients_torch, trace_torch
from .profiling import torch_profiler, torch_step
from .train import batch_to_torch

if TYPE_CHECKING:
    from xbridge.ir.program import Program

    from .executable import TorchExecutable
    from .train import TrainStep


class HoldsModel(Protocol):
    """An executable that trains a torch module with a :class:`TrainStep` (TorchExecutable, the xla executable)."""

    program: Program
    device: torch.device
    model: torch.nn.Module
    train_step: TrainStep


class TorchDiagnostics(Diagnostics):
    """Non-finite gradients from the train step; the parameters as they are (one device); CUDA's name and peak."""

    def __init__(self, executable: HoldsModel) -> None:
        self.ex = executable

    def nonfinite_grads(self) -> list[str] | None:
        return self.ex.train_step.nonfinite_grads()

    def layout(self) -> dict[str, dict[str, Any]]:
        return {n: {"spec": "unsharded", "shard_shapes": [list(p.shape)]} for n, p in self.ex.model.named_parameters()}

    def device_kind(self) -> str | None:
        device = self.ex.device
        return torch.cuda.get_device_name(device) if device.type == "cuda" else None

    def device_peak_bytes(self) -> int | None:
        device = self.ex.device
        return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


class TorchProbes(Probes):
    """One forward pass of the executable's model observed on the host's batch, without an update."""

    def __init__(self, executable: TorchExecutable) -> None:
        self.ex = executable

    def _tensors(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return batch_to_torch(batch, self.ex.device, self.ex.program.precision)

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ex = self.ex
        return trace_torch(ex.program, ex.model, self._tensors(batch), ex.device.type, ex.hint)

    def trace_gradients(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """None where the model's parameters get no ``.grad`` from the loss's backward (inductor's ranks: the
        data-parallel wrapper keeps them elsewhere), rather than an empty answer."""
        ex = self.ex
        return gradients_torch(ex.program, ex.model, ex.train_step.loss_fn, self._tensors(batch), ex.device.type,
                               ex.hint, ex.train_step.random_factories) or None

    def matmul_dtypes(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        ex = self.ex
        return count_torch(ex.program, ex.model, self._tensors(batch), ex.device.type, ex.hint)

    def attention_kernels(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        ex = self.ex
        return attention.probe(ex.program, ex.model, self._tensors(batch), ex.device.type, ex.hint)


class TorchProfiling(Profiling):
    """torch.profiler on the executable's device; each profiled step a ``record_function`` range."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def profiler(self, directory: Path) -> contextlib.AbstractContextManager[Any]:
        return torch_profiler(directory, self.device)

    def profile_step(self, step: int) -> contextlib.AbstractContextManager[Any]:
        return torch_step(step)
