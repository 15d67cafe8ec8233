"""The eager backend: plain PyTorch, the reference every other backend is compared with (``eager-cpu``,
``eager-cuda``). One device; sharding rules are validated by the plan but have no effect here."""

from __future__ import annotations

from typing import Any

from xbridge.backend import Backend, Executable, Target


class EagerBackend(Backend):
    name = "eager"
    devices = ("cuda", "cpu")
    requires = ("torch",)
    extra = "eager"
    sharded = False

    def device_reason(self, device: str) -> str | None:
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                return "torch sees no CUDA device (torch.cuda.is_available() is False)"
        return None

    def versions(self) -> dict[str, str]:
        import torch

        return {"torch": torch.__version__}

    def lower(self, program: Any, plan: Any, target: Target, options: dict[str, Any]) -> Executable:
        from .executable import EagerExecutable

        return EagerExecutable(program, plan, target)
