"""One rank of the Inductor backend on torch.distributed (see placement.py for where the mesh axes go).

Every rank builds the full model from the same weights and applies the plan; the loss (forward and backward) and
the optimizer update are compiled by torch.compile as in one process (the engine is the single-process
:class:`InductorExecutable` with a distributed train step): FSDP2's hooks run outside the compiled graphs (Dynamo
skips them by design, ``torch._dynamo.config.skip_fsdp_hooks``), and DTensor code and its collectives are traced
into them. The reported loss is the mean over the batch axis, the same number on every rank.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from xbridge.errors import ConfigError, LoweringError
from xbridge.ir.program import Program
from xbridge.plugin import BatchCheck, Feed, ShardingPlan, data_source, hints, rng_rows
from xbridge.torch.train import TrainStep, batch_to_torch, eval_parts, exact_fp32, per_item, tensor_to_numpy

from . import checkpoint_shards
from .executable import InductorDiagnostics, InductorExecutable
from .patches import ShardedGradScaler
from .placement import MeshRoles, apply_batch_axis, local_rows, rank_rows, tensor_parallel, to_plain


class DistributedTrainStep(TrainStep):
    """The shared train step with the parts that must see every rank: the gradient norm for clipping, the loss
    scaler's overflow check, the non-finite check, and optimizer state that mirrors a sharded parameter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.scaler is not None:
            self.scaler = ShardedGradScaler(self.device_type, enabled=True)
        self.batch_group: dist.ProcessGroup | None = None    # set by the engine: the ranks that split the batch
        self.batch_parts = 1

    def global_count(self, count: torch.Tensor) -> float:
        """The count summed over the ranks that split the batch."""
        if self.batch_group is not None:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.batch_group)
        return float(count)

    def normaliser(self, count: torch.Tensor | float) -> float:
        """``batch_parts / global count``: FSDP2 averages the gradients over the batch axis, and the returned loss
        is averaged over it too (:meth:`RankEngine._batch_mean`); both must come out as the global total over the
        global count."""
        items = float(count)
        return self.batch_parts / items if items > 0 else float(self.batch_parts)

    def gradient_norm(self) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # each parameter's norm over all its shards (DTensor reduces it), then torch's formula on the host side
        norms = [to_plain(torch.linalg.vector_norm(g, 2.0)) for g in grads]
        return torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else torch.zeros(())

    def nonfinite_grads(self) -> list[str]:
        named = list(self.model.named_parameters())
        flags = torch.zeros(len(named), dtype=torch.float32)
        for i, (_, p) in enumerate(named):
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                flags[i] = float(not bool(torch.isfinite(local).all()))
        device = next(self.model.parameters()).device
        flags = flags.to(device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return [name for (name, _), bad in zip(named, flags.cpu().tolist()) if bad]

    def import_state(self, state: dict[str, np.ndarray]) -> None:
        """Full arrays in; state that mirrors a sharded parameter is split like the parameter (each rank keeps its
        own piece of the full array, no communication)."""
        super().import_state(state)
        for param, entries in self.optimizer.state.items():
            if not isinstance(param, DTensor):
                continue
            for key, value in entries.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                    entries[key] = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements,
                                                     src_data_rank=None)


class RankDiagnostics(InductorDiagnostics):
    """The layout and the recompiles of every rank (collectives: called on every rank in the same order)."""

    ex: RankEngine

    def layout(self) -> dict[str, dict[str, Any]]:
        local = {}
        for name, param in self.ex.model.named_parameters():
            if isinstance(param, DTensor):
                names = param.device_mesh.mesh_dim_names or ()
                sizes = param.device_mesh.shape   # a placement over a size-1 axis means nothing: not shown
                spec = "(" + ", ".join(f"{n}: {p}" for n, p, k in zip(names, param.placements, sizes) if k > 1) + ")"
                local[name] = (spec, list(param.to_local().shape))
            else:
                local[name] = ("replicated", list(param.shape))
        everyone = self.ex.gather(local)
        return {name: {"spec": spec, "shard_shapes": [rank[name][1] for rank in everyone]}
                for name, (spec, _) in local.items()}

    def recompiles(self) -> int:
        """Compilations after warm-up, the most of any rank."""
        return max(self.ex.gather(super().recompiles()))


class RankEngine(InductorExecutable):
    """One rank of the distributed executable. Every method is called on every rank in the same order (the
    collectives inside them line up); results that differ by rank are gathered so that each rank returns the
    same value. ``trace_modules`` runs the forward on the whole batch on every rank (FSDP2 gathers the parameters,
    DTensor modules return replicated outputs), so the outputs are the full ones and the same on every rank."""

    train_step_class = DistributedTrainStep
    diagnostics_class = RankDiagnostics
    foreach = False    # per-parameter over DTensors and FSDP2 shards: the distributed parity figures were measured so

    def __init__(self, program: Program, plan: ShardingPlan, device: torch.device, mode: str) -> None:
        super().__init__(program, plan, device, mode)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != plan.devices:
            raise LoweringError(f"the plan spans {plan.devices} devices but torch.distributed has {self.world} "
                                "processes; pass --devices equal to the number of processes")
        self.roles = MeshRoles(plan)
        self.mesh = self.roles.build_mesh(device.type)
        self.tensor_parallel: list[str] = []
        self._feed: Feed | None = None
        self._check: BatchCheck | None = None

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plan applied: DTensor on the model axis, FSDP2 on the batch axis."""
        roles = self.roles
        if roles.model is not None:
            self.tensor_parallel = tensor_parallel(model, self.plan, self.mesh, roles.model)
            split = [m for m in self.tensor_parallel if self.scanned and m.startswith(self.scanned + ".")]
            if split:
                raise ConfigError(f"StepOptions scan_layers is not available on inductor with {split[0]!r} split over "
                                  f"mesh axis {roles.model!r} (DTensor): torch 2.9's nested compile region fails on "
                                  "it; use scan_layers=False, or a mesh without that axis")
        apply_batch_axis(model, self.plan, roles, self.mesh)
        self.batch_group: dist.ProcessGroup | None = None
        if roles.batch is not None:
            self.batch_group = self.mesh[roles.batch].get_group()
            self.batch_parts = self.mesh[roles.batch].size()
            self.batch_index = self.mesh[roles.batch].get_local_rank()
        else:
            self.batch_parts, self.batch_index = 1, 0
        return model

    def make_train_step(self, model: torch.nn.Module) -> TrainStep:
        step = super().make_train_step(model)
        assert isinstance(step, DistributedTrainStep)
        step.batch_group, step.batch_parts = self.batch_group, self.batch_parts
        return step

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """A step on this rank's rows of the global ``batch`` (sent by rank 0)."""
        local = local_rows(batch, self.batch_parts, self.batch_index, self.program.step.grad_accum)
        return self._train(batch_to_torch(local, self.device, self.program.precision))

    def step_at(self, step: int) -> dict[str, float]:
        """Step ``step`` on the rows this rank reads itself from the program's data source (only those rows; the
        next step's load in the background). ``data_bytes``: what this rank read for the step."""
        if self._feed is None:
            data, seed = self.program.data, self.program.seed
            rows = rank_rows(data.batch_size, self.batch_parts, self.batch_index, self.program.step.grad_accum)
            check = BatchCheck(data, expected_rows=len(rows), rng_rows=rng_rows(self.program, rows))
            self._check = check
            self._feed = Feed(lambda s: self.put(check(data_source.rows(data, s, seed, rows), s)), stop=None)
        tensors, _ = self._feed.get(step)
        metrics = self._train(tensors)
        assert self._check is not None
        return {**metrics, "data_bytes": float(self._check.bytes_read.pop(step, 0))}

    def _train(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        lr = self.train_step.lr
        with hints.activate(self.hint):
            loss, norm = self.train_step(tensors)
        return {"loss": self._batch_mean(loss), "lr": lr, "grad_norm": float(norm), **self.train_step.counted()}

    def evaluate(self, batch: dict[str, np.ndarray]) -> float:
        local = local_rows(batch, self.batch_parts, self.batch_index, 1)
        with hints.activate(self.hint):
            loss, count = eval_parts(self.eval_fn, self.model,
                                     batch_to_torch(local, self.device, self.program.precision), self.program,
                                     self.device.type)
        if count is None:
            return self._batch_mean(loss)
        if self.batch_group is not None:      # xb.LossSum: the global total over the global count
            parts = torch.stack([loss, count])
            dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=self.batch_group)
            loss, count = parts[0], parts[1]
        return float(per_item(loss, count))

    def _batch_mean(self, loss: torch.Tensor) -> float:
        """The mean of the ranks' losses over the batch axis (the loss of the global batch)."""
        if self.batch_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.batch_group)
            loss = loss / self.batch_parts
        return float(loss)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full arrays under the eager names (every DTensor gathered; tied names share one gather)."""
        out: dict[str, np.ndarray] = {}
        seen: dict[int, np.ndarray] = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            if id(value) not in seen:
                seen[id(value)] = tensor_to_numpy(value)
            out[name] = seen[id(value)]
        return out

    def write_checkpoint_part(self, tmp: str) -> dict[str, Any]:
        """This rank's pieces of a sharded checkpoint, written into the proxy's folder ``tmp`` (no gathering)."""
        return checkpoint_shards.write_part(tmp, self.rank, self.world, self.model, self.train_step, self.gather)

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order (a collective: every rank calls it)."""
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, value)
        return everyone


def threads_per_rank(world: int) -> int:
    """CPU ranks share the machine's cores (torchrun likewise sets OMP_NUM_THREADS=1 per process)."""
    return max(1, (os.cpu_count() or 1) // world)


def device_for(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        exact_fp32(device)
        return device
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank(dist.get_world_size()))
    return torch.device(device_type)


def process_group_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"
