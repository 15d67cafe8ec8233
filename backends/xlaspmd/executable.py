"""The torch_xla executable: the shared torch train step traced as lazy tensors into one graph per step, SPMD
shardings from the plan, compile counts from torch_xla's metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xbridge import hints
from xbridge.backend import Target
from xbridge.cache import cache_dir
from xbridge.errors import BackendUnavailable
from xbridge.planning import ShardingPlan
from xbridge.program import Program
from xbridge.torch_train import TorchTrainState, TrainStep, batch_to_torch, build_model, to_numpy_state

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


def compile_count() -> int:
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


class XlaExecutable(TorchTrainState):
    def __init__(self, program: Program, plan: ShardingPlan, target: Target) -> None:
        start_runtime()
        have = xr.global_runtime_device_count()
        if have != plan.devices:
            raise BackendUnavailable(f"target {target} runs SPMD over all {have} device(s) of this process, but the "
                                     f"plan uses {plan.devices}; run with --devices {have}")
        self.program, self.plan, self.target = program, plan, target
        sizes = plan.axis_sizes
        self.mesh = xs.Mesh(np.arange(plan.devices), tuple(sizes.values()), tuple(sizes))
        self.device = torch_xla.device()
        self.scaling = program.precision.loss_scale == "dynamic"
        self.warm_compiles = 0
        self.first_compiles = compile_count()

    def _spec(self, spec: tuple, rank: int) -> tuple:
        return tuple(spec) + (None,) * (rank - len(spec))

    def _hint(self, x: torch.Tensor, spec: tuple) -> torch.Tensor:
        hints.check_hint(x, spec, self.plan.axis_sizes)
        return xs.mark_sharding_with_gradients(x, self.mesh, self._spec(spec, x.dim()))

    def init(self, weights: dict[str, np.ndarray]) -> None:
        self.model = build_model(self.program, weights, self.device)
        planned = {p.name: p.spec for p in self.plan.params}
        for name, param in self.model.named_parameters():
            xs.mark_sharding(param, self.mesh, planned[name])
        # Optimizer state is created by the first step from the (sharded) parameters and inherits their sharding.
        self.train_step = TrainStep(self.program, self.model, self.device, on_device=True)
        # full_graph: the step must be one graph (GradScaler reads found_inf on the host, so not with fp16)
        self.compiled = torch_xla.compile(self.train_step, full_graph=not self.scaling,
                                          name=f"xbridge-{self.program.name}")
        torch_xla.sync()

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        tensors = batch_to_torch(batch, self.device, self.program.precision)
        for value in tensors.values():
            xs.mark_sharding(value, self.mesh, self._spec(self.plan.batch, value.dim()))
        lr = self.train_step.lr
        with hints.activate(self._hint):
            loss = self.compiled(tensors)
        return {"loss": float(loss.item()), "lr": lr}   # .item() waits for the device

    def state_dict(self) -> dict[str, np.ndarray]:
        torch_xla.sync()
        return to_numpy_state(self.model)

    def load_training_state(self, state: dict[str, np.ndarray]) -> None:
        """torch.optim's load_state_dict moves the state to the parameter's device but not its sharding: state
        that mirrors a parameter is sharded like it, as the first step would have created it."""
        self.train_step.import_state(state)
        planned = {p.name: p.spec for p in self.plan.params}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for param, entries in self.train_step.optimizer.state.items():
            for value in entries.values():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    xs.mark_sharding(value, self.mesh, planned[names[id(param)]])
        torch_xla.sync()

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from xbridge.bisect import trace_torch

        tensors = batch_to_torch(batch, self.device, self.program.precision)
        outputs = trace_torch(self.program, self.model, tensors, "xla", self._hint)
        torch_xla.sync()
        return outputs

    def layout(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, param in self.model.named_parameters():
            wrapped = xs.wrap_if_sharded(param)
            if isinstance(wrapped, xs.XLAShardedTensor):
                out[name] = {"spec": wrapped.sharding_spec,
                             "shard_shapes": [list(s.data.shape) for s in wrapped.local_shards]}
            else:
                out[name] = {"spec": "replicated", "shard_shapes": [list(param.shape)] * self.plan.devices}
        return out

    def recompiles(self) -> int:
        return compile_count() - self.warm_compiles

    def mark_warm(self) -> None:
        self.warm_compiles = compile_count()

    def dump(self, directory: Path) -> list[Path]:
        # XLA writes every module it compiled there (XLA_FLAGS=--xla_dump_to, set by the backend's configure).
        return sorted(p for p in directory.glob("*.txt") if "module_" in p.name)
