"""The eager backend: plain PyTorch, the reference every other backend is compared with (``eager-cpu``,
``eager-cuda``). One device; sharding rules are validated by the plan but have no effect here."""

from __future__ import annotations

from typing import Any

from xbridge.backend import Executable, Target, TorchDeviceBackend


class EagerBackend(TorchDeviceBackend):
    name = "eager"
    extra = "eager"
    sharded = False

    def lower(self, program: Any, plan: Any, target: Target, options: dict[str, Any]) -> Executable:
        from .executable import EagerExecutable

        return EagerExecutable(program, plan, target)
