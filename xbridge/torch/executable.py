"""The executable of the backends that run the torch module on torch's own devices (eager, inductor): the shared
train step on one device. A backend sets how the train step is built (eager: as is; inductor: compiled)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xbridge import hints
from xbridge.contract import Probes, Profiling, on_host
from xbridge.ir.program import Program
from xbridge.planner import ShardingPlan

from . import attention, remat
from .matmul_census import count_torch
from .module_outputs import gradients_torch, trace_torch
from .profiling import torch_profiler, torch_step
from .train import TorchTrainState, TrainStep, batch_to_torch, build_model, eval_loss, exact_fp32, to_numpy_state


class TorchExecutable(TorchTrainState, Probes, Profiling):
    def __init__(self, program: Program, plan: ShardingPlan, device: torch.device) -> None:
        self.program, self.plan, self.device = program, plan, device
        self._restore_fp32 = exact_fp32(device)
        self._hints = hints.checker(plan.axis_sizes)

    def close(self) -> None:
        self._restore_fp32()     # TF32 as it was before this run

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Hook: place the model before its train step is built (inductor's distributed engine applies the plan)."""
        return model

    def compiler(self) -> Callable[[Callable], Callable] | None:
        """Hook: how the loss and the update are compiled (None: run as they are; inductor: torch.compile)."""
        return None

    def make_train_step(self, model: torch.nn.Module) -> TrainStep:
        """Hook: the train step over ``model`` (inductor compiles it)."""
        return TrainStep(self.program, model, self.device)

    def scan_layers(self, model: torch.nn.Module) -> bool:
        """Hook: ``StepOptions(scan_layers=True)``; eager runs the model's own loop (inductor: one compile region).
        True when what it made of the layers recomputes them itself (``remat``)."""
        return False

    def init(self, weights: dict[str, np.ndarray]) -> None:
        model = build_model(self.program, weights, self.device)
        if not self.scan_layers(model):
            remat.apply(model, self.program, remat.torch_checkpoint(self.program.step.remat))
        self.model = self.prepare_model(model)
        self.train_step = self.make_train_step(self.model)
        compile = self.compiler()
        self.eval_fn = compile(self.program.loss) if compile else self.program.loss

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return batch_to_torch(batch, self.device, self.program.precision)

    def placed(self, batch: Any) -> dict[str, torch.Tensor]:
        return self.put(batch) if on_host(batch) else batch

    def step(self, batch: Any) -> dict[str, float]:
        lr = self.train_step.lr
        with hints.activate(self._hints):
            loss, norm = self.train_step(self.placed(batch))
        # float() waits for the device
        return {"loss": float(loss), "lr": lr, "grad_norm": float(norm), **self.train_step.counted()}

    def evaluate(self, batch: Any) -> float:
        with hints.activate(self._hints):
            return float(eval_loss(self.eval_fn, self.model, self.placed(batch), self.program,
                                   self.device.type))

    def state_dict(self) -> dict[str, np.ndarray]:
        return to_numpy_state(self.model)

    def layout(self) -> dict[str, dict[str, Any]]:
        return {n: {"spec": "unsharded", "shard_shapes": [list(p.shape)]} for n, p in self.model.named_parameters()}

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensors = batch_to_torch(batch, self.device, self.program.precision)
        return trace_torch(self.program, self.model, tensors, self.device.type, self._hints)

    def trace_gradients(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """None where the model's parameters get no ``.grad`` from the loss's backward (inductor's ranks: the
        data-parallel wrapper keeps them elsewhere), rather than an empty answer."""
        tensors = batch_to_torch(batch, self.device, self.program.precision)
        return gradients_torch(self.program, self.model, self.train_step.loss_fn, tensors, self.device.type,
                               self._hints, self.train_step.random_factories) or None

    def matmul_dtypes(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        tensors = batch_to_torch(batch, self.device, self.program.precision)
        return count_torch(self.program, self.model, tensors, self.device.type, self._hints)

    def attention_kernels(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        tensors = batch_to_torch(batch, self.device, self.program.precision)
        return attention.probe(self.program, self.model, tensors, self.device.type, self._hints)

    def profiler(self, directory: Path) -> contextlib.AbstractContextManager[Any]:
        return torch_profiler(directory, self.device)

    def profile_step(self, step: int) -> contextlib.AbstractContextManager[Any]:
        return torch_step(step)

    def device_kind(self) -> str | None:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None

    def device_peak_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None
