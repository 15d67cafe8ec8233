"""The torch_xla backend (``xla-cpu``, ``xla-tpu``): torch_xla 2.9 with PJRT, SPMD from the same plan.

torch_xla 2.9 is the last release and has no CUDA support; upstream plans to replace it (TorchTPU). Everything
torch_xla-specific lives in this package, so it can be swapped for its successor without touching the core.
The folder is deliberately not called ``torch_xla``: it would shadow the real package.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Any

from xbridge.backend import Backend, Executable, Target
from xbridge.errors import BackendUnavailable

_PJRT = {"cpu": "CPU", "tpu": "TPU"}


class XlaBackend(Backend):
    name = "xla"
    devices = ("tpu", "cpu")
    requires = ("torch_xla", "torch")
    extra = "xla"
    unsupported = {"cuda": "torch_xla 2.9 has no CUDA support (removed upstream; its successor targets TPU): "
                           "use inductor-cuda or jax-cuda"}

    def device_reason(self, device: str) -> str | None:
        if device == "tpu" and not (Path("/dev/accel0").exists() or Path("/dev/vfio").exists()
                                    or os.environ.get("TPU_NAME")):
            return "no TPU here (no /dev/accel* or /dev/vfio device, TPU_NAME unset): xla-tpu runs on a TPU VM"
        return None

    def versions(self) -> dict[str, str]:
        return {dist: importlib.metadata.version(dist) for dist in ("torch_xla", "torch")}

    def device_count(self, device: str) -> int | None:
        return None  # CPU: virtual devices, any count; TPU: known once the runtime starts (the executable checks)

    def configure(self, device: str, devices: int, dump: Path | None = None) -> None:
        """PJRT reads these once, when torch_xla's runtime starts: set them first, per process."""
        os.environ["PJRT_DEVICE"] = _PJRT[device]
        if device == "cpu":
            current = os.environ.get("CPU_NUM_DEVICES")
            if _runtime_started() and current and int(current) != devices:
                raise BackendUnavailable(
                    f"torch_xla in this process already runs with CPU_NUM_DEVICES={current}, not {devices}; torch_xla "
                    "SPMD spans every device of the process: run each device count in its own process")
            os.environ["CPU_NUM_DEVICES"] = str(devices)
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            if _runtime_started():
                raise BackendUnavailable("--dump for xla must be given before torch_xla starts in this process")
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()

    def lower(self, program: Any, plan: Any, target: Target, options: dict[str, Any]) -> Executable:
        from .executable import XlaExecutable

        return XlaExecutable(program, plan, target)


def _runtime_started() -> bool:
    """Conservative: once torch_xla is imported, PJRT may have read its environment already."""
    import sys

    return "torch_xla" in sys.modules
