"""The eager executable: the shared torch train step, run op by op."""

from __future__ import annotations

from pathlib import Path

import torch

from xbridge.contract import Target
from xbridge.errors import BackendUnavailable
from xbridge.ir.program import Program
from xbridge.plugin import ShardingPlan, write_text
from xbridge.torch.capabilities import TorchDiagnostics
from xbridge.torch.executable import TorchExecutable


class EagerDiagnostics(TorchDiagnostics):
    def dump(self, directory: Path) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "eager_module.txt"
        write_text(path, f"# eager compiles nothing; this is the module tree it runs op by op\n{self.ex.model!r}\n")
        return [path]


class EagerExecutable(TorchExecutable):
    diagnostics_class = EagerDiagnostics

    def __init__(self, program: Program, plan: ShardingPlan, target: Target) -> None:
        if plan.devices != 1:
            raise BackendUnavailable(f"target {target} runs on one device, but the plan uses {plan.devices}; "
                                     "pass --devices 1 (eager is the unsharded reference)")
        super().__init__(program, plan, torch.device(target.device))
