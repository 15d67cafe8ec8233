"""The contract between the core and a backend plugin.

A plugin registers a :class:`Backend` subclass in the entry-point group ``xbridge.backends``. The class must be
cheap to import (no framework import at module top): the registry instantiates it to ask why it is unavailable, and
only :meth:`Backend.lower` pulls in the framework.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from .planning import ShardingPlan
    from .program import Program


@dataclass(frozen=True)
class Target:
    backend: str
    device: str

    def __str__(self) -> str:
        return f"{self.backend}-{self.device}"


class Executable(Protocol):
    """A program lowered for one target. Arrays cross the boundary as numpy, under the eager parameter names."""

    def init(self, weights: dict[str, np.ndarray]) -> None:
        """Load the initial weights (float32 numpy, eager names) and create the optimizer state."""

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """Run one optimizer step on the global batch; return metrics (at least ``loss``) once the device is done."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """Current parameters and buffers as full (unsharded) numpy arrays under the eager names."""

    def training_state(self) -> dict[str, np.ndarray]:
        """Everything but the weights that the next step depends on, full numpy arrays under backend-neutral
        names (``optim/<param>/<torch.optim key>``, ``loop/updates``, ``scaler/*``, ``rng/*``; see
        xbridge/checkpoint.py). Written into checkpoints; read back by any backend."""

    def load_training_state(self, state: dict[str, np.ndarray]) -> None:
        """After :meth:`init`: continue from ``state`` (from :meth:`training_state` of any backend), sharding it
        like the parameters it belongs to."""

    def nonfinite_grads(self) -> list[str]:
        """Parameters (eager names, eager order) whose gradient in the last step held a NaN or Inf."""

    def recompiles(self) -> int:
        """Compilations of the step since the last call to :meth:`mark_warm` (0 for a backend that compiles nothing)."""

    def mark_warm(self) -> None:
        """Warm-up is over: later compilations count as recompiles."""

    def dump(self, directory: Path) -> list[Path]:
        """Write what was compiled (graphs, HLO, or the module tree) under ``directory``; return the files."""

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each module's first floating output of one forward pass of the loss (no update), in execution order."""

    def layout(self) -> dict[str, dict[str, Any]]:
        """Per trained parameter, as the runtime reports it: ``{"spec": str, "shard_shapes": [[...], ...]}``."""


class Backend:
    """Base class of backend plugins. Subclasses set ``name``, ``devices`` (best first), ``requires`` (import
    names of the packages the backend needs) and implement :meth:`lower`."""

    name: str = ""
    devices: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    extra: str = ""             # pip extra that installs the requirements
    options: tuple[str, ...] = ()   # backend options it takes (CLI flags such as --sharding-mode)
    sharded: bool = True        # False: runs on one device and ignores the mesh (its plan collapses every axis to 1)
    unsupported: dict[str, str] = {}   # device -> why this backend cannot ever target it

    def missing_package(self) -> str | None:
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return module
        return None

    def unavailable_reason(self, device: str) -> str | None:
        """None when ``device`` can run here, else one line saying why (missing package, no such device)."""
        if device in self.unsupported:
            return self.unsupported[device]
        if device not in self.devices:
            return f"backend {self.name!r} has no device {device!r} (devices: {', '.join(self.devices)})"
        missing = self.missing_package()
        if missing:
            return f"package {missing!r} is not installed (pip install 'xbridge[{self.extra or self.name}]')"
        return self.device_reason(device)

    def device_reason(self, device: str) -> str | None:
        """Hook: why ``device`` is absent on this machine (packages are known to be installed)."""
        return None

    def default_device(self) -> str | None:
        for device in self.devices:
            if self.unavailable_reason(device) is None:
                return device
        return None

    def versions(self) -> dict[str, str]:
        out = {}
        for dist in self.requires:
            try:
                out[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
        return out

    def device_count(self, device: str) -> int | None:
        """How many devices of this kind a run may use here; None for virtual devices (any count)."""
        return 1

    def configure(self, device: str, devices: int, dump: Path | None = None) -> None:
        """Called before the framework is imported in this process: set per-process environment (virtual CPU
        device counts, platform selection, compiler dump flags). Default: nothing."""

    def lower(self, program: "Program", plan: "ShardingPlan", target: Target, options: dict[str, Any]) -> Executable:
        raise NotImplementedError(f"backend {self.name!r} does not implement lower()")


class TorchDeviceBackend(Backend):
    """Shared by the backends that run torch on torch's own devices (eager, inductor): CUDA availability from
    torch, torch's version."""

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
