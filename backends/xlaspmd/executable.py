"""The torch_xla executable: the shared torch train step on XLA with SPMD shardings from the plan, in one of two
modes, and compile counts (with their causes) from torch_xla's metrics and debug analysis (compile_log.py).

- ``lazy``: the whole step traced as lazy tensors by ``torch_xla.compile`` into one graph per step.
- ``openxla``: the loss (forward, and backward through AOTAutograd) captured by Dynamo with
  ``torch.compile(backend="openxla")`` (as dynamo_capture.py prepares it); clipping, accumulation and the optimizer
  update are lazy tensors and run at the end of the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xbridge.contract import Target, on_host
from xbridge.errors import BackendUnavailable, LoweringError
from xbridge.ir.program import Program
from xbridge.plugin import ShardingPlan, cache_dir, hints
from xbridge.torch import remat as shared_remat
from xbridge.torch.layer_stacks import StackedParams
from xbridge.torch.optimizer_state import create_state
from xbridge.torch.seeding import training_seed
from xbridge.torch.train import TorchTrainState, TrainStep, batch_to_torch, build_model, eval_loss, tensor_to_numpy

from . import attention, layer_scan, ops, remat
from .capabilities import XlaDiagnostics, XlaProbes, XlaProfiling
from .compile_log import compile_count
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


class XlaExecutable(TorchTrainState):
    """The train step as one XLA graph over the SPMD mesh (lazy), or the loss captured by Dynamo (openxla); its
    diagnostics, probes and profiler: capabilities.py."""

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
        self._rng_resumed: int | None = None
        self.diagnosis = XlaDiagnostics(self)
        self.parts = (self.diagnosis, XlaProbes(self), XlaProfiling())

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
        self._rng_resumed = None
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
        self.diagnosis.step_compiles += compile_count() - before
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
            self.diagnosis.export_compiles += compile_count() - before

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

        from xbridge.plugin import user_frame

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
