"""The base of the backends that run torch on torch's own devices (eager, inductor)."""

from __future__ import annotations

from xbridge.contract import Backend


class TorchDeviceBackend(Backend):
    """CUDA availability from torch, torch's version."""

    devices = ("cuda", "cpu")
    requires = ("torch",)

    def device_reason(self, device: str) -> str | None:
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                return "torch sees no CUDA device (torch.cuda.is_available() is False)"
        return None

    def versions(self) -> dict[str, str]:
        import torch

        return {"torch": torch.__version__}
