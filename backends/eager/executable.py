"""The eager executable: the shared torch train step, run op by op."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from xbridge import hints
from xbridge.backend import Target
from xbridge.errors import BackendUnavailable
from xbridge.torch_train import TorchTrainState, TrainStep, batch_to_torch, build_model, to_numpy_state


class EagerExecutable(TorchTrainState):
    def __init__(self, program: Any, plan: Any, target: Target) -> None:
        if plan.devices != 1:
            raise BackendUnavailable(f"target {target} runs on one device, but the plan uses {plan.devices}; "
                                     "pass --devices 1 (eager is the unsharded reference)")
        self.program = program
        self.plan = plan
        self.device = torch.device(target.device)
        if self.device.type == "cuda":
            # fp32 means fp32: no TF32 in the reference.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
        self.model: torch.nn.Module | None = None
        self.train_step: TrainStep | None = None
        self._hints = hints.checker(plan.axis_sizes)

    def init(self, weights: dict[str, np.ndarray]) -> None:
        self.model = build_model(self.program, weights, self.device)
        self.train_step = TrainStep(self.program, self.model, self.device)

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        assert self.train_step is not None, "init() must be called before step()"
        lr = self.train_step.lr
        with hints.activate(self._hints):
            loss = self.train_step(batch_to_torch(batch, self.device, self.program.precision))
        value = float(loss)  # synchronises the device
        return {"loss": value, "lr": lr}

    def state_dict(self) -> dict[str, np.ndarray]:
        assert self.model is not None, "init() must be called before state_dict()"
        return to_numpy_state(self.model)

    @property
    def device_kind(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def device_peak_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else None

    def recompiles(self) -> int:
        return 0  # eager compiles nothing

    def mark_warm(self) -> None:
        pass

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from xbridge.bisect import trace_torch

        tensors = batch_to_torch(batch, self.device, self.program.precision)
        return trace_torch(self.program, self.model, tensors, self.device.type, self._hints)

    def layout(self) -> dict[str, dict[str, Any]]:
        assert self.model is not None
        return {n: {"spec": "unsharded", "shard_shapes": [list(p.shape)]} for n, p in self.model.named_parameters()}

    def dump(self, directory: Path) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "eager_module.txt"
        path.write_text("# eager compiles nothing; this is the module tree it runs op by op\n" + repr(self.model) + "\n")
        return [path]
