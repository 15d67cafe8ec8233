"""The eager backend: plain PyTorch, the reference every other backend is compared with (``eager-cpu``,
``eager-cuda``). One device; sharding rules are validated by the plan but have no effect here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xbridge.contract import Executable, Target
from xbridge.torch.device import TorchDeviceBackend

if TYPE_CHECKING:
    from xbridge import Program, ShardingPlan


class EagerBackend(TorchDeviceBackend):
    name = "eager"
    extra = "eager"
    sharded = False

    def lower(self, program: Program, plan: ShardingPlan, target: Target, options: dict[str, str]) -> Executable:
        from .executable import EagerExecutable

        return EagerExecutable(program, plan, target)
