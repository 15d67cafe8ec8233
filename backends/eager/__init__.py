"""The eager backend: plain PyTorch, the reference every other backend is compared with (``eager-cpu``,
``eager-cuda``). One device; sharding rules are validated by the plan but have no effect here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xbridge.contract import Executable, Target
from xbridge.contract.checks import StepChecks
from xbridge.torch.device import TorchDeviceBackend

if TYPE_CHECKING:
    from xbridge import Program, ShardingPlan
    from xbridge.torch.op_census import Census


class EagerBackend(TorchDeviceBackend, StepChecks):
    name = "eager"
    extra = "eager"
    sharded = False

    def operator_support(self, census: Census) -> dict[str, str]:
        """torch's own kernels: the census ran them."""
        return dict.fromkeys(census.ops, "lowered")

    def lower(self, program: Program, plan: ShardingPlan, target: Target, options: dict[str, str]) -> Executable:
        from .executable import EagerExecutable

        return EagerExecutable(program, plan, target)
