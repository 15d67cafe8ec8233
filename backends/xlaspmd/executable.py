"""The torch_xla executable: the shared torch train step on XLA with SPMD shardings from the plan, in one of two
modes, and compile counts (with their causes) from torch_xla's metrics and debug analysis (compile_log.py).

- ``lazy``: the whole step traced as lazy tensors by ``torch_xla.compile`` into one graph per step.
- ``openxla``: the loss (forward, and backward through AOTAutograd) captured by Dynamo with
  ``torch.compile(backend="openxla")`` (as dynamo_capture.py prepares it); clipping, accumulation and the optimizer
  update are lazy tensors and run at the end of the step.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xbridge import hints
from xbridge.cache import cache_dir
from xbridge.contract import CompileCache, Probes, Profiling, Target, on_host
from xbridge.errors import BackendUnavailable, LoweringError
from xbridge.ir.program import Program
from xbridge.planner import ShardingPlan
from xbridge.torch import remat as shared_remat
from xbridge.torch.layer_stacks import StackedParams
from xbridge.torch.optimizer_state import create_state
from xbridge.torch.seeding import training_seed
from xbridge.torch.train import TorchTrainState, TrainStep, batch_to_torch, build_model, eval_loss, tensor_to_numpy

from . import attention, compile_log, layer_scan, ops, remat
from .compile_log import compile_count, compile_seconds, dynamo_graphs, persistent_cache_hits
from .dynamo_capture import ShardHint, check_importable, fresh_input_loss

_RUNTIME_READY = False


def start_runtime() -> None:
    """SPMD mode and the persistent compilation cache: once per process, before any XLA tensor exists.
    The cache is off on CPU: PJRT's CPU client cannot deserialise executables (measured with torch_xla 2.9:
    "Deserializing serialized executable not supported")."""
    global _RUNTIME_READY
    if not _RUNTIME_READY:
        xr.use_spmd()
        if xr.device_type() != "CPU":
            xr.initialize_cache(str(cache_dir(f"torch_xla-{xr.device_type().lower()}")), readonly=False)
        _RUNTIME_READY = True


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


class XlaExecutable(TorchTrainState, Probes, Profiling):
    def __init__(self, program: Program, plan: ShardingPlan, target: Target, mode: str = "lazy") -> None:
        start_runtime()
        ops.register()
        have = xr.global_runtime_device_count()
        if have != plan.devices:
            raise BackendUnavailable(f"target {target} runs SPMD over all {have} device(s) of this process, but the "
                                     f"plan uses {plan.devices}; run with --devices {have}")
        self.program, self.plan, self.target, self.mode = program, plan, target, mode
        sizes = plan.axis_sizes
        self.mesh = xs.Mesh(np.arange(plan.devices), tuple(sizes.values()), tuple(sizes))
        self._mesh_text = str(self.mesh)
        self.device = torch_xla.device()
        self.scaling = program.precision.loss_scale == "dynamic"
        self.warm_compiles = 0
        self._export_compiles = 0
        self.warm_graphs = 0
        self._warm_debug_offset = 0
        self._warm_guard_failures: dict[Any, int] = {}
        self.first_compiles = compile_count()
        self._cache_start = (persistent_cache_hits(), compile_count(), compile_seconds())
        self._step_compiles = 0         # XLA compilations while a training step ran (the step's graph: one)

    def _spec(self, spec: tuple, rank: int) -> tuple:
        return tuple(spec) + (None,) * (rank - len(spec))

    def _hint(self, x: torch.Tensor, spec: tuple) -> torch.Tensor:
        if self.mode == "openxla":
            hints.check_hint(x, spec, self.plan.axis_sizes)
            return ShardHint.apply(x, self._mesh_text, str(self._spec(spec, x.dim())))
        return self._lazy_hint(x, spec)

    def _lazy_hint(self, x: torch.Tensor, spec: tuple) -> torch.Tensor:
        hints.check_hint(x, spec, self.plan.axis_sizes)
        return xs.mark_sharding_with_gradients(x, self.mesh, self._spec(spec, x.dim()))

    def init(self, weights: dict[str, np.ndarray]) -> None:
        step = self.program.step
        attention.check(step.attention, str(self.target), self.target.device, self.mode, step.scan_layers)
        self.model = build_model(self.program, weights, self.device)
        layer_checkpoint = remat.checkpoint(self.program.step.remat, str(self.target), self.mode)
        scanner = layer_scan.apply(self.model, self.program, str(self.target), self.mode)
        if scanner is None:                     # a scan recomputes itself
            shared_remat.apply(self.model, self.program, layer_checkpoint)
        self.planned = {p.name: tuple(p.spec) for p in self.plan.params}
        for name, param in self.model.named_parameters():
            xs.mark_sharding(param, self.mesh, self.planned[name])
        # The scanned layers' parameters held stacked: the step's update, clipping and norm do not grow with depth.
        self.stacked = StackedParams.hold(self.model, scanner, self.planned,
                                          lambda tensor, spec: xs.mark_sharding(tensor, self.mesh, spec))
        self.train_step = TrainStep(self.program, self.model, self.device, on_device=True, stacked=self.stacked)
        # The optimizer's state before step 0, sharded like its parameter: step 0 is then step 1's graph (one
        # compile). An SGD with dampening keeps torch's lazy state: its first step creates it, a second graph.
        if create_state(self.train_step.optimizer):
            self._shard_state()
        xm.set_rng_state(training_seed(self.program.seed), self.device)      # the device's own generator
        self._rng_resumed: int | None = None
        if self.mode == "openxla":
            check_importable(self.program, self.model)
            # Dynamo captures the loss; static shapes (each XLA graph is for one shape anyway).
            self.train_step.loss_fn = torch.compile(fresh_input_loss(self.model, self.program.loss),
                                                    backend="openxla", dynamic=False)
        # lazy: full_graph, the step must be one graph (not with fp16: GradScaler reads found_inf on the host).
        # openxla: the Dynamo bridge runs its graphs inside the step, so more than one graph by design.
        self.compiled = torch_xla.compile(self.train_step, full_graph=self.mode == "lazy" and not self.scaling,
                                          name=f"xbridge-{self.program.name}")
        torch_xla.sync()

    def fetch(self, source: Any, step: int, seed: int, check: Callable[[Any, int], dict[str, np.ndarray]]) -> Any:
        """Read and checked on the prefetch thread, placed by :meth:`step` on the calling thread: torch_xla state is
        not touched beside a running step. (Its threaded loader path, ``xm.send_cpu_data_to_device`` with a
        ``ShardingSpec``, fails on a batch replicated over part of the mesh, e.g. labels over data=1 x model=2:
        IndexError in ``_xla_tensors_from_aten``, torch_xla 2.9.)"""
        return check(source.batch(step, seed), step)

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        tensors = batch_to_torch(batch, self.device, self.program.precision)
        for value in tensors.values():
            xs.mark_sharding(value, self.mesh, self._spec(self.plan.batch, value.dim()))
        return tensors

    def step(self, batch: Any) -> dict[str, float]:
        tensors = self.put(batch) if on_host(batch) else batch
        lr = self.train_step.lr
        if self._rng_resumed is not None:     # set just before the step: any graph run in between moves it
            xm.set_rng_state(self._rng_resumed, self.device)
            self._rng_resumed = None
        before = compile_count()
        with hints.activate(self._hint), self._attention(), host_values_named(self.program.name):
            loss, norm = self.compiled(tensors)
        self._step_compiles += compile_count() - before
        # .item() waits for the device
        return {"loss": float(loss.item()), "lr": lr, "grad_norm": float(norm.item()), **self.train_step.counted()}

    def evaluate(self, batch: Any) -> float:
        """The loss in eval mode as lazy tensors (one XLA graph, compiled once), in either mode."""
        tensors = self.put(batch) if on_host(batch) else batch
        with hints.activate(self._lazy_hint), self._attention():
            loss = eval_loss(self.program.loss, self.model, tensors, self.program, "xla")
        return float(loss.item())

    def _attention(self) -> contextlib.AbstractContextManager[Any]:
        return attention.routed(self.program.step.attention, self.mesh, self.plan.batch[0] if self.plan.batch else None)

    def state_dict(self) -> dict[str, np.ndarray]:
        with self._host_export():
            torch_xla.sync()
            return self.stacked.state_dict(tensor_to_numpy)

    def training_state(self) -> dict[str, np.ndarray]:
        with self._host_export():
            state = super().training_state()
        # --rng native draws on the XLA device from torch_xla's own generator state (an integer), kept so that a
        # resume on xla draws what the run would have drawn. torch_xla advances it at every graph run, random or
        # not (torch_xla 2.9), so a resume sets it just before its first step, where the run read it
        state["rng/xla"] = np.array(xm.get_rng_state(self.device), dtype=np.uint64)
        return state

    @contextlib.contextmanager
    def _host_export(self) -> Iterator[None]:
        """Copying sharded arrays to the host compiles XLA programs of its own (on 4 devices, a checkpoint of the
        MLP: 12), which torch_xla records no cause for: they are not recompilations of the step, so the count
        after warm-up leaves them out."""
        before = compile_count()
        try:
            yield
        finally:
            self._export_compiles += compile_count() - before

    def load_training_state(self, state: dict[str, np.ndarray]) -> None:
        """torch.optim's load_state_dict moves the state to the parameter's device but not its sharding: state
        that mirrors a parameter is sharded like it, as the first step would have created it."""
        self.train_step.import_state(state)
        if "rng/xla" in state:
            self._rng_resumed = int(state["rng/xla"])
        self._shard_state()
        torch_xla.sync()

    def _shard_state(self) -> None:
        """Optimizer state that mirrors a parameter sharded like it, as the first step would have created it."""
        names = {id(p): n for n, p in self.train_step.named_parameters()}
        for param, entries in self.train_step.optimizer.state.items():
            for value in entries.values():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    xs.mark_sharding(value, self.mesh, self.stacked.stacks.spec_of(names[id(param)], self.planned))

    @contextlib.contextmanager
    def _generator_kept(self) -> Iterator[None]:
        """The device's generator, after a probe, where it was before (set again just before the first step: a
        graph run in between moves it)."""
        before = xm.get_rng_state(self.device)
        yield
        if self._rng_resumed is None:
            self._rng_resumed = before

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from xbridge.torch.module_outputs import trace_torch

        # Module hooks on a lazy forward pass, in both modes (what --bisect compares is the model's arithmetic).
        tensors = batch_to_torch(batch, self.device, self.program.precision)
        with self._generator_kept():
            outputs = trace_torch(self.program, self.model, tensors, "xla", self._lazy_hint)
            torch_xla.sync()
        return outputs

    def trace_gradients(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Through the train step's loss (lazy, or Dynamo-captured with --xla-mode openxla), its backward run as
        one graph before the gradients are read."""
        from xbridge.torch.module_outputs import gradients_torch

        tensors = batch_to_torch(batch, self.device, self.program.precision)
        with self._generator_kept():
            return gradients_torch(self.program, self.model, self.train_step.loss_fn, tensors, "xla",
                                   self._lazy_hint, self.train_step.random_factories, settle=torch_xla.sync)

    def matmul_dtypes(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """Counted on lazy tensors as they are traced; the graph is dropped, never executed. Scanned layers are
        counted as the scan's body run in a loop (the scan traces that body under the same autocast: checked, every
        product of the scanned GPT's bf16-mixed step HLO is bf16)."""
        from xbridge.torch.layer_scan import looping
        from xbridge.torch.matmul_census import count_torch

        tensors = batch_to_torch(batch, self.device, self.program.precision)
        with looping():
            return count_torch(self.program, self.model, tensors, "xla", self._lazy_hint)

    def attention_kernels(self, batch: dict[str, np.ndarray]) -> dict[str, int] | None:
        """Probed on lazy tensors as they are traced (scanned layers as the scan's body in a loop); the graph is
        dropped, never executed."""
        from xbridge.torch.attention import meta_calls, probe
        from xbridge.torch.layer_scan import looping

        if self.program.step.attention == "flash":      # every call routed to the kernel (attention.py)
            return meta_calls(self.program, attention.FLASH)
        tensors = batch_to_torch(batch, self.device, self.program.precision)
        with looping():
            return probe(self.program, self.model, tensors, "xla", self._lazy_hint, math=attention.MATH)

    def layout(self) -> dict[str, dict[str, Any]]:
        """Per eager name: the sharding spec and each device's shard shape (a stacked group's members: the group's
        spec, their shard shapes without the layer axis)."""
        out = {}
        for key, param in self.train_step.named_parameters():
            wrapped = xs.wrap_if_sharded(param)
            if isinstance(wrapped, xs.XLAShardedTensor):
                spec, shapes = wrapped.sharding_spec, [list(s.data.shape) for s in wrapped.local_shards]
            else:
                spec, shapes = "replicated", [list(param.shape)] * self.plan.devices
            layered = key in self.stacked.stacks.groups
            for name in self.stacked.stacks.names_of(key):
                out[name] = {"spec": spec, "shard_shapes": [s[1:] for s in shapes] if layered else shapes}
        return out

    def profiler(self, directory: Path) -> contextlib.AbstractContextManager[Any]:
        return _xla_trace(directory)

    def device_kind(self) -> str | None:
        return tpu_device_kind()

    def device_peak_bytes(self) -> int | None:
        """PJRT's allocator statistics of the first device (TPU); the CPU client keeps none (UNIMPLEMENTED)."""
        if xr.device_type() == "CPU":
            return None
        return int(xm.get_memory_info(self.device)["peak_bytes_used"])

    def recompiles(self) -> int:
        """XLA compilations after warm-up; in openxla mode plus the graphs Dynamo captured again."""
        count = self._xla_recompiles()
        if self.mode == "openxla":
            count += dynamo_graphs() - self.warm_graphs
        return count

    def recompile_reasons(self) -> list[str]:
        """One line per distinct cause of the compilations after warm-up, with its count: torch_xla's own
        compilation analysis (``PT_XLA_DEBUG_LEVEL=1``, set by the backend's configure) and, in openxla mode,
        Dynamo's guard failures."""
        lines = compile_log.xla_reasons(self._xla_recompiles(), self._warm_debug_offset)
        if self.mode == "openxla":
            failures = Counter(compile_log.guard_failures_since(self._warm_guard_failures))
            lines += [f"dynamo recompile x{count}: {reason}" for reason, count in failures.items()]
        return lines

    def _xla_recompiles(self) -> int:
        return compile_count() - self.warm_compiles - self._export_compiles

    def compile_cache(self) -> CompileCache | None:
        """On TPU the persistent cache is on: a compile that loads from it is a hit. On CPU it is off (see
        start_runtime), so every compile is a miss: xla-cpu always starts cold."""
        hits = persistent_cache_hits() - self._cache_start[0]
        compiles = compile_count() - self._cache_start[1]
        caches = ("torch_xla persistent cache" if xr.device_type() != "CPU"
                  else "none: PJRT CPU cannot reload compiled executables")
        return CompileCache(hits, max(compiles - hits, 0), caches,
                            {"XLA compile": round(compile_seconds() - self._cache_start[2], 3)},
                            {"train step": self._step_compiles, "other": compiles - self._step_compiles})

    def mark_warm(self) -> None:
        self.warm_compiles = compile_count()
        self._export_compiles = 0
        self._warm_debug_offset = compile_log.debug_offset()
        if self.mode == "openxla":
            self.warm_graphs = dynamo_graphs()
            self._warm_guard_failures = compile_log.guard_failure_counts()

    def dump(self, directory: Path) -> list[Path]:
        # XLA writes every module it compiled there (XLA_FLAGS=--xla_dump_to, set by the backend's configure).
        return sorted(p for p in directory.glob("*.txt") if "module_" in p.name)


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


_SHAPE_FROM_DATA = ("nonzero", "unique", "masked_select", "_local_scalar_dense")


@contextlib.contextmanager
def host_values_named(program: str) -> Iterator[None]:
    """torch_xla's one-graph step (``torch_xla.compile(full_graph=True)``) stops at the first value the traced
    code needs on the host (a shape the data decides: boolean indexing, ``nonzero``, ``unique``; ``.item()``;
    ``if tensor:``) with "Unexpected execution happens inside the compiled function": one line naming where and why,
    before the step computes anything. So does an operator torch_xla has no XLA kernel for (``torch.fft`` on complex
    tensors): it falls back to the CPU, which counts it as ``aten::NAME`` in its metrics; the line names it."""
    try:
        yield
    except RuntimeError as exc:
        if "Unexpected execution happens inside the compiled function" not in str(exc):
            raise
        import torch_xla.debug.metrics as met

        from xbridge.program_file import user_frame

        found = user_frame(exc)
        where = "" if found is None else (f" at {found[0].filename}:{found[0].lineno} (in {found[0].name}, the "
                                          f"program's {found[1]})")
        # the operators that ran on the CPU, but those whose output shape the data decides (said below)
        on_cpu = sorted(name for name in met.counter_names() if name.startswith("aten::")
                        and not any(part in name for part in _SHAPE_FROM_DATA))
        if on_cpu:
            raise LoweringError(f"program {program!r} calls {', '.join(on_cpu)}{where}, which torch_xla "
                                f"{torch_xla.__version__} has no XLA kernel for (it falls back to the CPU), and the "
                                "step is one XLA graph (--xla-mode lazy); write it with other operators, or run it on "
                                "eager, inductor or jax") from None
        raise LoweringError(f"program {program!r} needs a value computed inside the step on the host{where}: a shape "
                            "the data decides (boolean indexing, nonzero, unique), .item() or `if tensor:`; torch_xla "
                            "compiles the step as one graph (--xla-mode lazy), so write it with fixed shapes (masks, "
                            "torch.where, a weighted loss) or run it on eager or inductor") from None
