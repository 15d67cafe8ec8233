"""The capabilities of the xla executable (executable.py), collaborators of it: what the run record says about the
run (:class:`XlaDiagnostics`: compilations counted by torch_xla, and by Dynamo in openxla mode, after warm-up and
their causes; the persistent cache; the layout; TPU memory), the probes of one lazy forward pass
(:class:`XlaProbes`) and torch_xla's profiler (:class:`XlaProfiling`)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xbridge.contract import CompileCache, Probes, Profiling
from xbridge.torch.capabilities import TorchDiagnostics
from xbridge.torch.train import batch_to_torch

from . import attention, compile_log
from .compile_log import compile_count, compile_seconds, dynamo_graphs, persistent_cache_hits

if TYPE_CHECKING:
    from .executable import XlaExecutable


def tpu_device_kind() -> str | None:
    """``TPU <type>`` from the TPU VM's accelerator type (``v4``, ``v5litepod``, ``v5p``, ``v6e``: torch_xla's
    get_tpu_type, read from the VM's metadata), for the MFU peak table; None off a TPU. (Under SPMD torch_xla's
    device is the virtual ``SPMD:0``, which xm.xla_device_kind cannot name.)"""
    if xr.device_type() != "TPU":
        return None
    from torch_xla._internal import tpu

    try:
        return f"TPU {tpu.get_tpu_type()}"
    except (OSError, KeyError, ValueError):   # metadata unreachable: the target's device is all that is known
        return None


class XlaDiagnostics(TorchDiagnostics):
    ex: XlaExecutable

    def __init__(self, executable: XlaExecutable) -> None:
        super().__init__(executable)
        self.warm_compiles = 0
        self.export_compiles = 0        # compiled by copies to the host (checkpoints): not the step's
        self.warm_graphs = 0
        self._warm_debug_offset = 0
        self._warm_guard_failures: dict[Any, int] = {}
        self._cache_start = (persistent_cache_hits(), compile_count(), compile_seconds())
        self.step_compiles = 0          # XLA compilations while a training step ran (the step's graph: one)

    def layout(self) -> dict[str, dict[str, Any]]:
        """Per eager name: the sharding spec and each device's shard shape (a stacked group's members: the group's
        spec, their shard shapes without the layer axis)."""
        out = {}
        for key, param in self.ex.train_step.named_parameters():
            wrapped = xs.wrap_if_sharded(param)
            if isinstance(wrapped, xs.XLAShardedTensor):
                spec, shapes = wrapped.sharding_spec, [list(s.data.shape) for s in wrapped.local_shards]
            else:
                spec, shapes = "replicated", [list(param.shape)] * self.ex.plan.devices
            layered = key in self.ex.stacked.stacks.groups
            for name in self.ex.stacked.stacks.names_of(key):
                out[name] = {"spec": spec, "shard_shapes": [s[1:] for s in shapes] if layered else shapes}
        return out

    def device_kind(self) -> str | None:
        return tpu_device_kind()

    def device_peak_bytes(self) -> int | None:
        """PJRT's allocator statistics of the first device (TPU); the CPU client keeps none (UNIMPLEMENTED)."""
        if xr.device_type() == "CPU":
            return None
        return int(xm.get_memory_info(self.ex.device)["peak_bytes_used"])

    def recompiles(self) -> int:
        """XLA compilations after warm-up; in openxla mode plus the graphs Dynamo captured again."""
        count = self._xla_recompiles()
        if self.ex.mode == "openxla":
            count += dynamo_graphs() - self.warm_graphs
        return count

    def recompile_reasons(self) -> list[str]:
        """One line per distinct cause of the compilations after warm-up, with its count: torch_xla's own
        compilation analysis (``PT_XLA_DEBUG_LEVEL=1``, set by the backend's configure) and, in openxla mode,
        Dynamo's guard failures."""
        lines = compile_log.xla_reasons(self._xla_recompiles(), self._warm_debug_offset)
        if self.ex.mode == "openxla":
            failures = Counter(compile_log.guard_failures_since(self._warm_guard_failures))
            lines += [f"dynamo recompile x{count}: {reason}" for reason, count in failures.items()]
        return lines

    def _xla_recompiles(self) -> int:
        return compile_count() - self.warm_compiles - self.export_compiles

    def compile_cache(self) -> CompileCache | None:
        """On TPU the persistent cache is on: a compile that loads from it is a hit. On CPU it is off (see
        start_runtime), so every compile is a miss: xla-cpu always starts cold."""
        hits = persistent_cache_hits() - self._cache_start[0]
        compiles = compile_count() - self._cache_start[1]
        caches = ("torch_xla persistent cache" if xr.device_type() != "CPU"
                  else "none: PJRT CPU cannot reload compiled executables")
        return CompileCache(hits, max(compiles - hits, 0), caches,
                            {"XLA compile": round(compile_seconds() - self._cache_start[2], 3)},
                            {"train step": self.step_compiles, "other": compiles - self.step_compiles})

    def mark_warm(self) -> None:
        self.warm_compiles = compile_count()
        self.export_compiles = 0
        self._warm_debug_offset = compile_log.debug_offset()
        if self.ex.mode == "openxla":
            self.warm_graphs = dynamo_graphs()
            self._warm_guard_failures = compile_log.guard_failure_counts()

    def dump(self, directory: Path) -> list[Path]:
        # XLA writes every module it compiled there (XLA_FLAGS=--xla_dump_to, set by the backend's configure).
        return sorted(p for p in directory.glob("*.txt") if "module_" in p.name)


class XlaProbes(Probes):
    """One forward pass traced lazily (in either mode), observed without an update."""

    def __init__(self, executable: XlaExecutable) -> None:
        self.ex = executable

    @contextlib.contextmanager
    def _generator_kept(self) -> Iterator[None]:
        """The device's generator, after a probe, where it was before (set again just before the first step: a
        graph run in between moves it)."""
        before = xm.get_rng_state(self.ex.device)
        yield
        if self.ex._rng_resumed is None:
            self.ex._rng_resumed = before

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from xbridge.torch.module_outputs import trace_torch

        # Module hooks on a lazy forward pass, in both modes (what --bisect compares is the model's arithmetic).
        tensors = batch_to_torch(batch, self.ex.device, self.ex.program.precision)
        with self._generator_kept():
            outputs = trace_torch(self.ex.program, self.ex.model, tensors, "xla", self.ex._lazy_hint)
            torch_xla.sync()
        return outputs

    def trace_gradients(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Through the train step's loss (lazy, or Dynamo-captured with --xla-mode openxla), its backward run as
        one graph before the gradients are read."""
        from xbridge.torch.module_outputs import gradients_torch

        tensors = batch_to_torch(batch, self.ex.device, self.ex.program.precision)
        with self._generator_kept():
            return gradients_torch(self.ex.program, self.ex.model, self.ex.train_step.loss_fn, tensors, "xla",
                                   self.ex._lazy_hint, self.ex.train_step.random_factories, settle=torch_xla.sync)

    def matmul_dtypes(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """Counted on lazy tensors as they are traced; the graph is dropped, never executed. Scanned layers are
        counted as the scan's body run in a loop (the scan traces that body under the same autocast: checked, every
        product of the scanned GPT's bf16-mixed step HLO is bf16)."""
        from xbridge.torch.layer_scan import looping
        from xbridge.torch.matmul_census import count_torch

        tensors = batch_to_torch(batch, self.ex.device, self.ex.program.precision)
        with looping():
            return count_torch(self.ex.program, self.ex.model, tensors, "xla", self.ex._lazy_hint)

    def attention_kernels(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """Probed on lazy tensors as they are traced (scanned layers as the scan's body in a loop); the graph is
        dropped, never executed."""
        from xbridge.torch.attention import meta_calls, probe
        from xbridge.torch.layer_scan import looping

        if self.ex.program.step.attention == "flash":      # every call routed to the kernel (attention.py)
            return meta_calls(self.ex.program, attention.FLASH)
        tensors = batch_to_torch(batch, self.ex.device, self.ex.program.precision)
        with looping():
            return probe(self.ex.program, self.ex.model, tensors, "xla", self.ex._lazy_hint, math=attention.MATH)


class XlaProfiling(Profiling):
    def profiler(self, directory: Path) -> contextlib.AbstractContextManager[Any]:
        return _xla_trace(directory)


@contextlib.contextmanager
def _xla_trace(directory: Path) -> Iterator[None]:
    """torch_xla's profiler session (``start_trace``/``stop_trace``): ``plugins/profile/<time>/<host>.xplane.pb``
    and ``<host>.trace.json.gz``, as jax writes them. The steps carry no annotation: torch_xla refuses a trace
    scope still open at the step's ``sync``."""
    import torch_xla.debug.profiler as xp

    directory.mkdir(parents=True, exist_ok=True)
    xp.start_trace(str(directory))
    try:
        yield
    finally:
        xp.stop_trace()
