"""The contract between the core and a backend plugin (docs/adding-a-backend.md lists all of it).

A plugin registers a :class:`Backend` subclass in the entry-point group ``xbridge.backends``. The class must be
cheap to import (no framework import at module top): the registry instantiates it to ask why it is unavailable and
which options it takes, and only :meth:`Backend.lower` pulls in the framework. ``lower`` returns an
:class:`Executable`; every method the core calls is declared here, with a default where one makes sense.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, LoweringError

if TYPE_CHECKING:
    from ..ir.program import Program
    from ..planner import ShardingPlan


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


@dataclass
class CompileCache:
    """What a run's compilations found in the backend's persistent caches, and the compile phases it timed."""

    hits: int
    misses: int
    caches: str                                 # which caches, in the backend's words
    seconds: dict[str, float] = field(default_factory=dict)   # compile phases as the backend times them

    @property
    def state(self) -> str:
        """warm: every lookup hit; cold: every lookup missed; partial: both; unused: no lookup."""
        if self.hits and not self.misses:
            return "warm"
        if self.misses and not self.hits:
            return "cold"
        return "partial" if self.hits else "unused"

    def to_json(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "state": self.state, "caches": self.caches,
                "seconds": self.seconds}


def on_host(batch: Any) -> bool:
    """Whether ``batch`` is still the host's numpy arrays (not yet :meth:`Executable.put`)."""
    return isinstance(batch, dict) and any(isinstance(v, np.ndarray) for v in batch.values())


class Executable(ABC):
    """A program lowered for one target. Arrays cross the boundary as numpy, under the eager parameter names."""

    @abstractmethod
    def init(self, weights: dict[str, np.ndarray]) -> None:
        """Load the initial weights (float32 numpy, eager names) and create the optimizer state."""

    @abstractmethod
    def step(self, batch: Any) -> dict[str, float]:
        """Run one optimizer step on the global batch (numpy, or what :meth:`put` made of it); return metrics (at
        least ``loss``) once the device is done."""

    def fetch(self, source: Any, step: int, seed: int, check: Callable[[Any, int], dict[str, np.ndarray]]) -> Any:
        """Step ``step``'s batch for :meth:`step`: read from the data ``source``, ``check``-ed, :meth:`put`. The run
        loop calls it one step ahead on its prefetch thread. A backend whose processes each read only their own
        rows overrides it (the distributed inductor ranks)."""
        return self.put(check(source.batch(step, seed), step))

    def put(self, batch: dict[str, np.ndarray]) -> Any:
        """The batch moved where :meth:`step` and :meth:`evaluate` read it (the device, sharded as planned). The run
        loop calls it on its prefetch thread, one step ahead, so the transfer overlaps the running step."""
        return batch

    def evaluate(self, batch: Any) -> float:
        """The loss of one batch with the model in eval mode, no gradient and no update (``xb.Eval``)."""
        raise LoweringError(f"{type(self).__name__} cannot evaluate (the program's xb.Eval)")

    @abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]:
        """Current parameters and buffers as full (unsharded) numpy arrays under the eager names."""

    @abstractmethod
    def training_state(self) -> dict[str, np.ndarray]:
        """Everything but the weights that the next step depends on, full numpy arrays under backend-neutral
        names (``optim/<param>/<torch.optim key>``, ``loop/updates``, ``scaler/*``, ``rng/*``; see
        xbridge/run/checkpoint.py). Written into checkpoints; read back by any backend."""

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """What a checkpoint holds: (:meth:`state_dict`, :meth:`training_state`, None). A backend whose processes
        save together returns, in every process, the pieces that process writes (``xbridge.run.shards.Sharded``
        values) and the ``shards.Group`` they save as."""
        return self.state_dict(), self.training_state(), None

    def any_process(self, flag: bool) -> bool:
        """Whether ``flag`` is true in any process of a job spread over several (a collective every process calls
        at the same point; the run loop asks it after each step whether Ctrl-C was pressed). One process: ``flag``."""
        return flag

    def checkpoint_parts(self) -> Callable[[Path], list[dict[str, Any]]] | None:
        """None: checkpoints are written from :meth:`checkpoint_state`. A backend whose state lives in other
        processes it drives (inductor's ranks) returns ``write(folder)``, which makes each of them write its own
        pieces into ``folder`` (``xbridge.run.shards.write_part``) and returns their parts, in process order."""
        return None

    @abstractmethod
    def load_training_state(self, state: dict[str, np.ndarray]) -> None:
        """After :meth:`init`: continue from ``state`` (from :meth:`training_state` of any backend), sharding it
        like the parameters it belongs to."""

    def nonfinite_grads(self) -> list[str] | None:
        """Parameters (eager names, eager order) whose gradient in the last step held a NaN or Inf; None when the
        backend does not inspect gradients."""
        return None

    def recompiles(self) -> int:
        """Compilations of the step since :meth:`mark_warm` (0 for a backend that compiles nothing)."""
        return 0

    def recompile_reasons(self) -> list[str]:
        """One line per cause of the recompilations counted by :meth:`recompiles`, when the backend knows them."""
        return []

    def mark_warm(self) -> None:  # noqa: B027 (a default: backends that count nothing need not override it)
        """Warm-up is over: later compilations count as recompiles."""

    def profiler(self, directory: Path) -> contextlib.AbstractContextManager[Any]:
        """--profile: a context in which the stack's own profiler traces what runs, writing a Chrome/Perfetto trace
        (JSON, or the ``*.trace.json.gz`` jax and torch_xla write) under ``directory`` when it closes."""
        raise LoweringError(f"{type(self).__name__} has no profiler (--profile)")

    def profile_step(self, step: int) -> contextlib.AbstractContextManager[Any]:
        """An annotation around one profiled step, named ``xbridge step`` (xbridge/run/profile.py:STEP_MARK),
        where the stack can mark one; nothing by default."""
        return contextlib.nullcontext()

    def dump(self, directory: Path) -> list[Path]:
        """Write what was compiled (graphs, HLO, or the module tree) under ``directory``; return the files."""
        return []

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each module's first floating output of one forward pass of the loss (no update), in execution order."""
        raise LoweringError(f"{type(self).__name__} cannot record module outputs (--trace-modules, parity --bisect)")

    def matmul_dtypes(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """The matrix products of one forward pass of the loss (eval mode, no update) counted by the dtype they
        compute in, under the step's precision (backends/_torch/matmul_census.py); None: not known."""
        return None

    def attention_kernels(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """The training forward's ``scaled_dot_product_attention`` calls counted by the kernel that carried them out
        (backends/_torch/attention.py); ``{}`` when the model calls none; None: not known."""
        return None

    def layout(self) -> dict[str, dict[str, Any]]:
        """Per trained parameter, as the runtime reports it: ``{"spec": str, "shard_shapes": [[...], ...]}``."""
        return {}

    def device_kind(self) -> str | None:
        """The device's name as its runtime reports it (e.g. ``NVIDIA H200``, ``TPU v5 lite``), for the MFU peak
        table; None: the target's device kind is all that is known."""
        return None

    def device_peak_bytes(self) -> int | None:
        """Peak device memory in use during the run, where the runtime reports it."""
        return None

    def compile_cache(self) -> CompileCache | None:
        """Persistent compile-cache hits and misses of this run's compilations (is the compile column a cold or a
        warm start?); None for a backend that compiles nothing."""
        return None


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
    # True: init and load_training_state also take a sharded checkpoint's tensors (xbridge.run.shards.Stored: shape,
    # dtype, and [slices] reading only those); False: they get numpy arrays
    reads_slices: bool = False
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
