"""The executable of the backends that run the torch module on torch's own devices (eager, inductor): the shared
train step on one device. A backend sets how the train step is built (eager: as is; inductor: compiled)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from xbridge import hints
from xbridge.contract import on_host
from xbridge.ir.program import Program

from . import remat
from .capabilities import TorchDiagnostics, TorchProbes, TorchProfiling
from .train import TorchTrainState, TrainStep, batch_to_torch, build_model, eval_loss, exact_fp32, to_numpy_state

if TYPE_CHECKING:
    from xbridge.planner import ShardingPlan


class TorchExecutable(TorchTrainState):
    """The torch train step on one device, with hooks for the backends built on it; its diagnostics, probes and
    profiler are collaborators (xbridge/torch/capabilities.py), :attr:`diagnostics_class` the backend's own."""

    diagnostics_class: type[TorchDiagnostics] = TorchDiagnostics

    def __init__(self, program: Program, plan: ShardingPlan, device: torch.device) -> None:
        self.program, self.plan, self.device = program, plan, device
        self._restore_fp32 = exact_fp32(device)
        self.hint = hints.checker(plan.axis_sizes)
        self.parts = (self.diagnostics_class(self), TorchProbes(self), TorchProfiling(device))

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
        with hints.activate(self.hint):
            loss, norm = self.train_step(self.placed(batch))
        # float() waits for the device
        return {"loss": float(loss), "lr": lr, "grad_norm": float(norm), **self.train_step.counted()}

    def evaluate(self, batch: Any) -> float:
        with hints.activate(self.hint):
            return float(eval_loss(self.eval_fn, self.model, self.placed(batch), self.program,
                                   self.device.type))

    def state_dict(self) -> dict[str, np.ndarray]:
        return to_numpy_state(self.model)
