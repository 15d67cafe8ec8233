"""The JAX backend: torchax turns the torch module and loss into a JAX function; the whole train step is one
``jax.jit`` with GSPMD shardings from the plan (default) or a ``jax.shard_map`` with explicit collectives
(``sharding_mode="shard_map"``). Targets ``jax-cpu``, ``jax-cuda``, ``jax-tpu``.

This folder is deliberately not called ``jax``: it would shadow the real package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

from xbridge.backend import Backend, BackendOption, Executable, Target
from xbridge.errors import BackendUnavailable

if TYPE_CHECKING:
    from xbridge import Program, ShardingPlan

_PLATFORM_PLUGINS = {"tpu": ("libtpu",), "cuda": ("jax_cuda12_plugin", "jax_cuda13_plugin")}
_INSTALL_HINT = {"tpu": "pip install 'jax[tpu]' on a TPU VM", "cuda": "pip install 'xbridge[cuda]' on a CUDA machine"}


class JaxBackend(Backend):
    name = "jax"
    devices = ("tpu", "cuda", "cpu")
    requires = ("jax", "optax", "torchax", "torch")
    extra = "jax"
    options = (BackendOption("sharding_mode", ("gspmd", "shard_map"), "gspmd",
                             "gspmd: jit with NamedSharding from the plan; shard_map: explicit collectives"),)

    def device_reason(self, device: str) -> str | None:
        if device == "cpu":
            return None
        if not any(importlib.util.find_spec(m) for m in _PLATFORM_PLUGINS[device]):
            return (f"jax has no {device.upper()} runtime here (none of {', '.join(_PLATFORM_PLUGINS[device])} "
                    f"is installed; {_INSTALL_HINT[device]})")
        import jax

        try:
            jax.devices(device)
        except RuntimeError as exc:
            return f"jax found no {device} device: {str(exc).splitlines()[0]}"
        return None

    def versions(self) -> dict[str, str]:
        return {dist: importlib.metadata.version(dist) for dist in ("jax", "jaxlib", "torchax", "optax", "torch")}

    def device_count(self, device: str) -> int | None:
        if device == "cpu":
            return None  # virtual CPU devices: any count, set before JAX initialises
        import jax

        return len(jax.devices(device))

    def configure(self, device: str, devices: int, dump: Path | None = None) -> None:
        """Ask for ``devices`` virtual CPU devices before JAX initialises its backends (per process); never fewer
        than this process already asked for (XLA_FLAGS, or an earlier ``jax_num_cpu_devices``)."""
        if device != "cpu":
            return
        import jax

        asked = int(jax.config.jax_num_cpu_devices)  # type: ignore[attr-defined]  # (-1: not set)
        try:
            jax.config.update("jax_num_cpu_devices", max(devices, _requested_cpu_devices(), asked))
        except RuntimeError:  # already initialised in this process: use what it has
            have = len(jax.devices("cpu"))
            if have < devices:
                raise BackendUnavailable(
                    f"JAX in this process was already initialised with {have} CPU device(s), fewer than --devices "
                    f"{devices}; run in a fresh process or set XLA_FLAGS=--xla_force_host_platform_device_count="
                    f"{devices} before JAX starts") from None

    def averages_shard_losses(self, options: dict[str, str]) -> bool:
        return options.get("sharding_mode") == "shard_map"   # gspmd takes the loss over the global batch

    def lower(self, program: Program, plan: ShardingPlan, target: Target, options: dict[str, str]) -> Executable:
        from .executable import JaxExecutable

        return JaxExecutable(program, plan, target, options["sharding_mode"])


def _requested_cpu_devices() -> int:
    """The device count XLA_FLAGS already asks for (so configure never lowers it)."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_force_host_platform_device_count="):
            try:
                return int(flag.split("=", 1)[1])
            except ValueError:
                return 1
    return 1
