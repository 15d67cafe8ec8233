"""The Inductor executable: the shared torch train step with the loss and the optimizer update compiled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch._dynamo.utils import counters

from xbridge import hints
from xbridge.backend import Target
from xbridge.torch_train import TorchTrainState, TrainStep, batch_to_torch, build_model, to_numpy_state


def compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


class InductorExecutable(TorchTrainState):
    def __init__(self, program: Any, plan: Any, target: Target, mode: str) -> None:
        self.program, self.plan, self.mode = program, plan, mode
        self.device = torch.device(target.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
        self._hints = hints.checker(plan.axis_sizes)
        self.warm_graphs = 0

    def init(self, weights: dict[str, np.ndarray]) -> None:
        self.model = build_model(self.program, weights, self.device)
        mode = None if self.mode == "default" else self.mode
        # lr and Adam's step count on the device (on_device): a changing schedule does not recompile the update.
        self.train_step = TrainStep(self.program, self.model, self.device, on_device=True,
                                    compile=lambda fn: torch.compile(fn, mode=mode))

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        lr = self.train_step.lr
        with hints.activate(self._hints):
            loss = self.train_step(batch_to_torch(batch, self.device, self.program.precision))
        return {"loss": float(loss), "lr": lr}      # float() waits for the device

    def state_dict(self) -> dict[str, np.ndarray]:
        return to_numpy_state(self.model)

    def layout(self) -> dict[str, dict[str, Any]]:
        return {n: {"spec": "unsharded", "shard_shapes": [list(p.shape)]} for n, p in self.model.named_parameters()}

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from xbridge.bisect import trace_torch

        tensors = batch_to_torch(batch, self.device, self.program.precision)
        return trace_torch(self.program, self.model, tensors, self.device.type, self._hints)

    def recompiles(self) -> int:
        return compiled_graphs() - self.warm_graphs

    def recompile_reasons(self) -> list[str]:
        return [f"graph break x{count}: {reason}" for reason, count in counters["graph_break"].items()]

    def mark_warm(self) -> None:
        self.warm_graphs = compiled_graphs()

    def dump(self, directory: Path) -> list[Path]:
        # TORCH_COMPILE_DEBUG (set by the backend's configure) wrote the FX graphs and Inductor's output code here.
        return sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix in (".py", ".txt", ".log"))
