"""The Inductor executable: the shared torch train step with the loss and the optimizer update compiled.

One process and one device; the distributed rank engine (rank_engine.py) is this executable with a distributed
train step and the plan applied to the model, so both count compilations the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch._dynamo.utils import counters

from xbridge.ir.program import Program
from xbridge.planner import ShardingPlan

from .._torch.executable import TorchExecutable
from .._torch.train import TrainStep


def compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


class InductorExecutable(TorchExecutable):
    train_step_class: type[TrainStep] = TrainStep

    def __init__(self, program: Program, plan: ShardingPlan, device: torch.device, mode: str) -> None:
        super().__init__(program, plan, device)
        self.mode = mode
        self.warm_graphs = 0

    def make_train_step(self, model: torch.nn.Module) -> TrainStep:
        mode = None if self.mode == "default" else self.mode
        # lr and Adam's step count on the device (on_device): a changing schedule does not recompile the update.
        return self.train_step_class(self.program, model, self.device, on_device=True,
                                     compile=lambda fn: torch.compile(fn, mode=mode))

    def recompiles(self) -> int:
        return compiled_graphs() - self.warm_graphs

    def recompile_reasons(self) -> list[str]:
        return [f"graph break x{count}: {reason}" for reason, count in counters["graph_break"].items()]

    def mark_warm(self) -> None:
        self.warm_graphs = compiled_graphs()

    def dump(self, directory: Path) -> list[Path]:
        # TORCH_COMPILE_DEBUG (set by the backend's configure) wrote the FX graphs and Inductor's output code here.
        return sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix in (".py", ".txt", ".log"))
