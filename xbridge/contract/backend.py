"""The backend class a plugin registers (entry-point group ``xbridge.backends``), its options and its targets.

The class must be cheap to import (no framework import at module top): the registry instantiates it to ask why it is
unavailable and which options it takes, and only :meth:`Backend.lower` pulls in the framework."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..ir.program import Program
    from ..planner import ShardingPlan
    from .executable import Executable


@dataclass(frozen=True)
class Target:
    backend: str
    device: str

    def __str__(self) -> str:
        return f"{self.backend}-{self.device}"


@dataclass(frozen=True)
class BackendOption:
    """An option a backend takes: ``xbridge run --NAME VALUE`` (``name`` with ``-`` for ``_``) and the
    ``TARGET:NAME=VALUE`` variants of compare and parity. The core checks the value against ``choices`` before the
    backend sees it; :meth:`Backend.lower` gets every declared option, defaults filled in."""

    name: str                       # a Python identifier, e.g. "sharding_mode"
    choices: tuple[str, ...]
    default: str
    help: str                       # one line

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"backend option name {self.name!r} is not an identifier")
        if self.default not in self.choices:
            raise ValueError(f"backend option {self.name!r}: default {self.default!r} is not one of {self.choices}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


class Backend:
    """Base class of backend plugins. Subclasses set ``name``, ``devices`` (best first), ``requires`` (import
    names of the packages the backend needs) and implement :meth:`lower`."""

    name: str = ""
    devices: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    extra: str = ""             # pip extra that installs the requirements
    options: tuple[BackendOption, ...] = ()   # options it takes (CLI flags such as --sharding-mode)
    sharded: bool = True        # False: runs on one device and ignores the mesh (its plan collapses every axis to 1)
    multi_process: bool = False  # True: --processes spreads it over several processes (:meth:`join_processes`)
    unsupported: dict[str, str] = {}   # device -> why this backend cannot ever target it

    def averages_shard_losses(self, options: dict[str, str]) -> bool:
        """True when, with ``options``, each device or process takes the loss over its own rows and the step averages
        those losses (torch DDP's semantics) rather than taking the loss over the global batch: a loss normalised by a
        count the data decides then differs from the reference's (parity says so; ``xb.LossSum`` is exact)."""
        return False

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

    def join_processes(self, device: str, devices: int, processes: int | str) -> tuple[int, int]:
        """``--processes``: join the job of several processes this process is one of (``processes``: the count an
        xbridge supervisor started, with the coordinator and this process's index in the environment; or
        ``"cluster"``: a job a cluster launcher started), ``devices`` of them in this process; return (this
        process's index, the process count). Called before :meth:`configure`. Default: one process only."""
        raise ConfigError(f"--processes: the {self.name} backend runs in one process; several processes are for jax "
                          "targets (docs/multi-process.md)")

    def configure(self, device: str, devices: int, dump: Path | None = None) -> None:
        """Called before the framework is imported in this process: set per-process environment (virtual CPU
        device counts, platform selection, compiler dump flags; ``dump`` is where ``--dump`` asked for what was
        compiled). Default: nothing."""

    def resolve_options(self, given: dict[str, str], target: str) -> dict[str, str]:
        """Check ``given`` (option name -> value) against :attr:`options`; return every option, defaults filled in.
        The message names the target, the flag and what it takes."""
        declared = {option.name: option for option in self.options}
        for name, value in given.items():
            option = declared.get(name)
            if option is None:
                takes = ", ".join(o.flag for o in self.options) or "no options"
                raise ConfigError(f"target {target} takes no --{name.replace('_', '-')} (it takes: {takes})")
            if value not in option.choices:
                raise ConfigError(f"{option.flag} {value!r} is not a choice of target {target}; use one of "
                                  f"{', '.join(option.choices)}")
        return {name: given.get(name, option.default) for name, option in declared.items()}

    def lower(self, program: Program, plan: ShardingPlan, target: Target, options: dict[str, str]) -> Executable:
        raise NotImplementedError(f"backend {self.name!r} does not implement lower()")
