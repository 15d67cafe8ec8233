"""The capabilities of the jax executable (executable.py), collaborators of it: what the run record says about the
run (:class:`JaxDiagnostics`: traces of the step after warm-up, JAX's compile events, the layout, the device's
memory, non-finite gradients), the probes of one forward pass (:class:`JaxProbes`) and jax.profiler
(:class:`JaxProfiling`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from xbridge.contract import STEP_MARK, CompileCache, Diagnostics, Probes, Profiling
from xbridge.plugin import native_lines_dropped, write_text

from . import attention, step_builders
from .lowering import matmul_precision

if TYPE_CHECKING:
    from .executable import JaxExecutable

# JAX's own compile events, counted for every executable of this process (jax.monitoring has no unregister)
_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace (torchax + jaxpr)",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower to StableHLO",
              "/jax/core/compile/backend_compile_duration": "XLA compile or cache load"}
_counts: dict[str, float] = {}


@contextlib.contextmanager
def _trace(directory: Path) -> Iterator[None]:
    """``jax.profiler.trace``, without the TraceMe lines jaxlib logs where TensorFlow is not installed."""
    with native_lines_dropped():
        jax.profiler.start_trace(str(directory))
    try:
        yield
    finally:
        with native_lines_dropped():
            jax.profiler.stop_trace()


def _count_event(event: str, **kwargs: str | int) -> None:
    if event in _EVENTS:
        _counts[_EVENTS[event]] = _counts.get(_EVENTS[event], 0) + 1


def _count_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event in _DURATIONS:
        _counts[_DURATIONS[event]] = _counts.get(_DURATIONS[event], 0.0) + duration_secs


@functools.cache
def _listen_once() -> None:
    jax.monitoring.register_event_listener(_count_event)
    jax.monitoring.register_event_duration_secs_listener(_count_duration)


class JaxDiagnostics(Diagnostics):
    def __init__(self, executable: JaxExecutable) -> None:
        self.ex = executable
        _listen_once()
        self._counts_start = dict(_counts)
        self.warm_traces = 0

    def nonfinite_grads(self) -> list[str]:
        """Parameters (eager names, eager order) whose gradient in the last step held a NaN or Inf."""
        if self.ex.bad_grads_seen is None:
            return []
        bad = np.asarray(self.ex.host(self.ex.bad_grads_seen))
        names = self.ex.eager_names()
        flagged = {names[n] for n, count in zip(self.ex.bad_grad_names, bad) if count > 0 and n in names}
        return [n for n in self.ex.names if n in flagged]

    def layout(self) -> dict[str, dict[str, Any]]:
        return {n: {"spec": str(a.sharding.spec), "shard_shapes": [list(s.data.shape) for s in a.addressable_shards]}
                for n, a in self.ex.stacks.unstack(self.ex.state["params"]).items()}

    def device_kind(self) -> str | None:
        return str(jax.local_devices(backend=self.ex.target.device)[0].device_kind)

    def device_peak_bytes(self) -> int | None:
        """Peak bytes in use on the first device (None where the runtime keeps no statistics, as on CPU)."""
        stats = jax.local_devices(backend=self.ex.target.device)[0].memory_stats()
        return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None

    def recompiles(self) -> int:
        return self.ex.traces - self.warm_traces

    def mark_warm(self) -> None:
        self.warm_traces = self.ex.traces

    def compile_cache(self) -> CompileCache | None:
        delta = {k: v - self._counts_start.get(k, 0) for k, v in _counts.items()}
        return CompileCache(int(delta.get("hits", 0)), int(delta.get("misses", 0)),
                            "JAX persistent compilation cache",
                            {name: round(delta[name], 3) for name in _DURATIONS.values() if delta.get(name)})

    def dump(self, directory: Path) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        with matmul_precision(self.ex.program.precision.compute):
            lowered = self.ex.jitted.lower(self.ex.state, self.ex.last_batch)
        stablehlo = directory / f"jax_{self.ex.mode}_step.stablehlo.mlir"
        write_text(stablehlo, lowered.as_text())
        hlo = directory / f"jax_{self.ex.mode}_step.optimized.hlo.txt"
        write_text(hlo, lowered.compile().as_text())
        return [stablehlo, hlo]


class JaxProbes(Probes):
    """One forward pass of the lowered loss, observed without an update."""

    def __init__(self, executable: JaxExecutable) -> None:
        self.ex = executable

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One forward pass of the loss run op by op through torchax (not jitted), hooks on every module."""
        from torchax import interop

        from xbridge.torch.module_outputs import recording

        to_numpy = lambda t: np.asarray(interop.jax_view(t).astype(jnp.float32))  # noqa: E731
        ex = self.ex
        with recording(ex.lowered.module._model, to_numpy) as out, matmul_precision(ex.program.precision.compute):
            ex.loss_of(ex.state["params"], ex.state["buffers"], ex.put(batch))
        return out

    def trace_gradients(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``jax.grad`` of the lowered loss (as the step differentiates it: a custom ``autograd.Function``'s own
        backward, the scanned layers stacked), jitted; under the eager names (the first of a tied group)."""
        buffers, placed = self.ex.state["buffers"], self.ex.put(batch)

        def loss(params: dict[str, Any]) -> jax.Array:
            value, count, _ = self.ex.loss_of(params, buffers, placed)
            return value if count is None else value / step_builders.nonzero(count)

        with matmul_precision(self.ex.program.precision.compute):
            grads = self.ex.host(jax.jit(jax.grad(loss))(self.ex.state["params"]))
        grads = self.ex.stacks.unstack(grads)
        return {eager: np.asarray(grads[canonical], dtype=np.float32)
                for canonical, eager in self.ex.eager_names().items()}

    def matmul_dtypes(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """The products of the loss's jaxpr (traced, never compiled): what XLA is handed, attention's two products
        included."""
        from .lowering import count_products

        ex = self.ex
        with matmul_precision(ex.program.precision.compute):
            jaxpr = jax.make_jaxpr(ex.loss_of)(ex.state["params"], ex.state["buffers"], ex.put(batch))
        return count_products(jaxpr.jaxpr)

    def attention_kernels(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """The kernel the lowering gives every ``scaled_dot_product_attention`` call (torchax's reference: matmuls,
        a softmax that XLA fuses as it can; or JAX's cuDNN attention); the calls are counted on the meta device."""
        from xbridge.torch.attention import meta_calls

        return meta_calls(self.ex.program, attention.KERNELS[self.ex.program.step.attention])


class JaxProfiling(Profiling):
    def profiler(self, directory: Path) -> contextlib.AbstractContextManager[Any]:
        """jax.profiler: ``plugins/profile/<time>/<host>.xplane.pb`` (TensorBoard's profile plugin, xprof) and the
        same trace as ``<host>.trace.json.gz`` (Chrome/Perfetto)."""
        directory.mkdir(parents=True, exist_ok=True)
        return _trace(directory)

    def profile_step(self, step: int) -> contextlib.AbstractContextManager[Any]:
        return jax.profiler.StepTraceAnnotation(STEP_MARK, step_num=step)
