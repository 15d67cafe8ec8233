"""What an executable can do beyond the core contract (xbridge/contract/executable.py), each as a class of its own.

A backend declares a capability by subclassing it next to :class:`~xbridge.contract.Executable`
(``class MyExecutable(Executable, Diagnostics, Profiling)``), or in a collaborator of its own that
:meth:`Executable.capability` returns, and overrides what it knows; every method has the default a backend without
it gets. The core asks by type, never by name, through the functions below (:func:`diagnostics`, :func:`probes`,
:func:`profiling`, :func:`sharded`, :func:`multi_process`).

- :class:`Diagnostics`: what the run record says about the compiled program (recompiles, compile cache, memory,
  device name, per-parameter layout, non-finite gradients, ``--dump``);
- :class:`Profiling`: ``--profile`` with the stack's own profiler;
- :class:`Probes`: one forward pass observed without an update (``--trace-modules`` and ``parity --bisect``,
  ``--matmul-dtypes``, the attention kernels);
- :class:`ShardedCheckpoint`: state held in pieces over several processes, written piece by piece and read back
  slice by slice;
- :class:`MultiProcess`: a job whose processes must agree on a flag (Ctrl-C seen by one of them)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import LoweringError

if TYPE_CHECKING:
    from ..checkpoint.shards import Group
    from .executable import CompileCache, Executable


class Diagnostics:
    """What the run record reports about the compiled program. The defaults are what a backend that compiles and
    inspects nothing reports."""

    def mark_warm(self) -> None:
        """Warm-up is over: later compilations count as recompiles."""

    def recompiles(self) -> int:
        """Compilations of the step since :meth:`mark_warm` (0 for a backend that compiles nothing)."""
        return 0

    def recompile_reasons(self) -> list[str]:
        """One line per cause of the recompilations counted by :meth:`recompiles`, when the backend knows them."""
        return []

    def compile_cache(self) -> CompileCache | None:
        """Persistent compile-cache hits and misses of this run's compilations (is the compile column a cold or a
        warm start?); None for a backend that compiles nothing."""
        return None

    def nonfinite_grads(self) -> list[str] | None:
        """Parameters (eager names, eager order) whose gradient in the last step held a NaN or Inf; None when the
        backend does not inspect gradients."""
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

    def dump(self, directory: Path) -> list[Path]:
        """Write what was compiled (graphs, HLO, or the module tree) under ``directory``; return the files."""
        return []


STEP_MARK = "xbridge step"      # the annotation around a profiled step, which xbridge/run/profile.py reads back


class Profiling(ABC):
    """``--profile``: the stack's own profiler around the profiled steps."""

    @abstractmethod
    def profiler(self, directory: Path) -> contextlib.AbstractContextManager[Any]:
        """A context in which the stack's own profiler traces what runs, writing a Chrome/Perfetto trace (JSON, or
        the ``*.trace.json.gz`` jax and torch_xla write) under ``directory`` when it closes."""

    def profile_step(self, step: int) -> contextlib.AbstractContextManager[Any]:
        """An annotation around one profiled step, named :data:`STEP_MARK`,
        where the stack can mark one; nothing by default."""
        return contextlib.nullcontext()


# --trace-modules writes both probes into one file: the module outputs under the module names, and each parameter's
# gradient under this prefix and the parameter's name (a module name never holds a colon).
GRADIENT_PREFIX = "grad:"


class Probes(ABC):
    """One forward pass of the loss observed on a batch, without an update."""

    @abstractmethod
    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each module's first floating output of one forward pass of the loss (no update), in execution order."""

    def trace_gradients(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The gradient of the batch's loss by each trained parameter, as the stack's own step differentiates it
        (no update), under the parameters' torch names in float32; None: not known. Neither probe may change what
        training then computes."""
        return None

    def matmul_dtypes(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """The matrix products of one forward pass of the loss (eval mode, no update) counted by the dtype they
        compute in, under the step's precision (xbridge/torch/matmul_census.py); None: not known."""
        return None

    def attention_kernels(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """The training forward's ``scaled_dot_product_attention`` calls counted by the kernel that carried them out
        (xbridge/torch/attention.py); ``{}`` when the model calls none; None: not known."""
        return None


@dataclass
class PieceWriter:
    """How one checkpoint is written in pieces. ``write(folder)`` writes the pieces this process is responsible for
    into ``folder`` (xbridge.checkpoint.shards.write_part for each process it writes for) and returns their parts, in
    process order. With a ``group``, every process of the group calls it, each into a folder of its own, and
    process 0 commits them all; without one, this process writes every process's part (it drives the others)."""

    write: Callable[[Path], list[dict[str, Any]]]
    group: Group | None = None


class ShardedCheckpoint:
    """State held in pieces over several processes: checkpoints are written piece by piece, nothing gathered, and
    read back slice by slice (docs/checkpoints.md)."""

    #: True: :meth:`Executable.init` and :meth:`Executable.load_training_state` take a checkpoint's tensors as
    #: ``xbridge.checkpoint.shards.Stored`` (``shape``, ``dtype`` and ``[slices]`` reading only those), so each process
    #: reads only what its devices hold; False: as numpy arrays.
    reads_slices: bool = True

    def piece_writer(self) -> PieceWriter | None:
        """How this run writes a checkpoint in pieces; None while the state is whole in this process (one process),
        when the checkpoint is :meth:`Executable.state_dict` and :meth:`Executable.training_state`."""
        return None


class MultiProcess:
    """A job of several processes that must stop at the same step."""

    def gathered(self, values: np.ndarray) -> np.ndarray:
        """Every process's ``values`` (one shape and dtype in all), stacked on a new first axis in process order; a
        collective every process calls at the same point (the run loop compares the processes' initial weights with
        it, and asks after each step whether Ctrl-C or SIGTERM came to any of them)."""
        return values[None]


_NO_DIAGNOSTICS = Diagnostics()


def diagnostics(executable: Executable) -> Diagnostics:
    """The executable's :class:`Diagnostics`, or the defaults when it declares none."""
    return executable.capability(Diagnostics) or _NO_DIAGNOSTICS


def profiling(executable: Executable) -> Profiling:
    """The executable's :class:`Profiling`; one line naming the executable when it has none."""
    found = executable.capability(Profiling)  # type: ignore[type-abstract]  # an ABC as type[C]
    if found is None:
        raise LoweringError(f"{type(executable).__name__} has no profiler (--profile)")
    return found


def probes(executable: Executable) -> Probes | None:
    """The executable's :class:`Probes`; None when it has none."""
    return executable.capability(Probes)  # type: ignore[type-abstract]


def sharded(executable: Executable) -> ShardedCheckpoint | None:
    """The executable's :class:`ShardedCheckpoint`; None when it writes whole checkpoints."""
    return executable.capability(ShardedCheckpoint)


def multi_process(executable: Executable) -> MultiProcess | None:
    """The executable's :class:`MultiProcess`; None when its processes never need to agree on a flag."""
    return executable.capability(MultiProcess)


def traced_modules(executable: Executable, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """:meth:`Probes.trace_modules`; one line naming the executable when it has no probes."""
    found = probes(executable)
    if found is None:
        raise LoweringError(f"{type(executable).__name__} cannot record module outputs (--trace-modules, "
                            "parity --bisect)")
    return found.trace_modules(batch)


def traced_gradients(executable: Executable, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """:meth:`Probes.trace_gradients`; None when the executable has no probes or does not know them."""
    found = probes(executable)
    return found.trace_gradients(batch) if found is not None else None


def reads_slices(executable: Executable) -> bool:
    """Whether the executable takes a sharded checkpoint's tensors as they are
    (:attr:`ShardedCheckpoint.reads_slices`)."""
    found = sharded(executable)
    return found is not None and found.reads_slices
