"""The Inductor backend on torch.distributed: what one rank does.

Every rank builds the full model from the same weights and then applies the plan:

- the batch axis (the mesh axis that splits the batch's dimension 0) goes to FSDP2 (``fully_shard`` on the root
  module): when some parameter's planned spec names that axis (``xb.sharding.fsdp`` or a rule), parameters are
  sharded over it on their planned dimension (ZeRO-3: gathered for forward and backward, gradients
  reduce-scattered); otherwise they stay replicated over it, as the plan says, through FSDP2's hybrid mode on a
  2-D mesh (batch axis replicated, a size-1 shard axis), so gradients are all-reduced as in DDP;
- a model axis (any other axis with size > 1) goes to DTensor: every module that owns a parameter whose spec names
  it gets its own parameters as DTensors with the planned ``Shard(dim)`` placements (the rest ``Replicate()``)
  through ``distribute_module``; its inputs enter as replicated DTensors and its outputs leave as plain replicated
  tensors, so DTensor's sharding propagation splits that module's computation (a column-parallel Linear computes
  its output features locally, a row-parallel one all-reduces partial sums) while the program's own code between
  modules sees ordinary tensors;
- each rank takes its slice of every micro-batch of the global batch (the layout the JAX and torch_xla backends
  give the batch), and the reported loss is the mean over the batch axis, the same number on every rank.

The loss (forward and backward) and the optimizer update are compiled by torch.compile as in one process; FSDP2's
hooks run outside the compiled graphs (Dynamo skips them by design, ``torch._dynamo.config.skip_fsdp_hooks``), and
DTensor code and its collectives are traced into them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from xbridge import hints
from xbridge.errors import LoweringError
from xbridge.planning import ShardingPlan
from xbridge.program import Program
from xbridge.sharding import spec_axes
from xbridge.torch_train import (TorchTrainState, TrainStep, batch_to_torch, build_model, tensor_to_numpy,
                                 tied_groups)

UNSHARDED_AXIS = "_fsdp_shard"   # the size-1 shard dimension of FSDP2's hybrid mode (parameters replicated)


def compiled_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


class MeshRoles:
    """Which plan axis does what on torch.distributed: the batch axis (FSDP2), the model axis (DTensor)."""

    def __init__(self, plan: ShardingPlan) -> None:
        sizes = plan.axis_sizes
        where = f"inductor on {plan.devices} processes, mesh {' x '.join(f'{a}={s}' for a, s in sizes.items())}"
        if any(spec_axes(plan.batch[1:])):
            raise LoweringError(f"{where}: the batch spec {plan.batch} splits a dimension after the first; the "
                                "torch.distributed path splits only the example dimension")
        batch = [a for a in spec_axes(plan.batch[:1]) if sizes[a] > 1]
        if len(batch) > 1:
            raise LoweringError(f"{where}: the batch is split over {len(batch)} mesh axes ({', '.join(batch)}); "
                                "FSDP2 takes one data-parallel axis, so merge them into one")
        self.batch: str | None = batch[0] if batch else None
        used = {a for p in plan.params for a in spec_axes(p.spec) if sizes[a] > 1}
        model = [a for a in sizes if a in used and a != self.batch]
        if len(model) > 1:
            raise LoweringError(f"{where}: parameters are split over {len(model)} model axes "
                                f"({', '.join(model)}); FSDP2 composes with one tensor-parallel axis")
        self.model: str | None = model[0] if model else None
        self.fsdp = self.batch is not None and self.batch in used
        # the torch mesh: the batch axis first (FSDP2 slices its data-parallel and tensor-parallel dimensions from
        # one root mesh in order), the size-1 shard axis of the hybrid mode after it, then the other plan axes
        names = ([self.batch] if self.batch else []) + [a for a in sizes if a != self.batch]
        shape = [(a, sizes[a]) for a in names]
        if self.batch and not self.fsdp:
            shape.insert(1, (UNSHARDED_AXIS, 1))
        self.shape = dict(shape)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, tuple(self.shape.values()), mesh_dim_names=tuple(self.shape))


def local_rows(batch: dict[str, np.ndarray], parts: int, index: int, accum: int) -> dict[str, np.ndarray]:
    """This rank's examples: piece ``index`` of ``parts`` of every micro-batch, so that micro-batch ``m`` of the
    local batch is this rank's share of micro-batch ``m`` of the global one (as JAX and torch_xla lay it out)."""
    if parts == 1:
        return batch
    out = {}
    for key, value in batch.items():
        micro = value.shape[0] // accum
        piece = micro // parts
        out[key] = np.concatenate([value[m * micro + index * piece: m * micro + (index + 1) * piece]
                                   for m in range(accum)])
    return out


def _to_plain(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim).to_local()
    return value


def tensor_parallel(model: torch.nn.Module, plan: ShardingPlan, mesh: DeviceMesh, axis: str) -> list[str]:
    """DTensor placements for the parameters whose spec names ``axis``; returns the modules so distributed."""
    specs = {p.name: p.spec for p in plan.params}
    owners: dict[str, list[tuple[str, int]]] = {}
    for name, spec in specs.items():
        dims = [d for d, entry in enumerate(spec) if axis in spec_axes((entry,))]
        if dims:
            if any(isinstance(spec[d], tuple) for d in dims):
                raise LoweringError(f"parameter {name!r} (spec {spec}) splits one dimension over several mesh axes; "
                                    "the torch.distributed path takes one axis per dimension")
            owner, _, attr = name.rpartition(".")
            owners.setdefault(owner, []).append((attr, dims[0]))
    tied = {n for group in tied_groups(model) for n in group}
    submesh = mesh[axis]
    for owner, entries in owners.items():
        module = model.get_submodule(owner) if owner else model
        for attr, _ in entries:
            full = f"{owner}.{attr}" if owner else attr
            if full in tied:
                raise LoweringError(f"parameter {full!r} is tied to another parameter and has a {axis!r} rule; the "
                                    "torch.distributed path cannot split a shared parameter across modules")
        if any(p.numel() for c in module.children() for p in c.parameters()):
            first = f"{owner}.{entries[0][0]}" if owner else entries[0][0]
            raise LoweringError(f"parameter {first!r} has a {axis!r} rule, but "
                                f"its module {owner or '<root>'} ({type(module).__name__}) also runs submodules "
                                "with parameters; the torch.distributed path splits a module's own computation "
                                "(DTensor), so move the parameter into a leaf module or drop the rule")
        sharded = dict(entries)

        def partition(name: str, sub: torch.nn.Module, device_mesh: DeviceMesh, root=module, sharded=sharded) -> None:
            if sub is not root:
                return
            for attr, param in list(sub.named_parameters(recurse=False)):
                placement = [Shard(sharded[attr])] if attr in sharded else [Replicate()]
                # every rank holds the same full weights: each keeps its piece, no scatter from rank 0
                value = distribute_tensor(param.data, device_mesh, placement, src_data_rank=None)
                sub.register_parameter(attr, torch.nn.Parameter(value, requires_grad=param.requires_grad))
            for attr, buffer in list(sub.named_buffers(recurse=False)):
                sub.register_buffer(attr, distribute_tensor(buffer, device_mesh, [Replicate()], src_data_rank=None))

        distribute_module(module, submesh, partition)

        def enter(sub: torch.nn.Module, args: tuple, kwargs: dict, device_mesh=submesh) -> tuple[tuple, dict]:
            def lift(x: Any) -> Any:
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                    return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                return x
            return torch.utils._pytree.tree_map(lift, (args, kwargs))

        def leave(sub: torch.nn.Module, args: tuple, output: Any) -> Any:
            return torch.utils._pytree.tree_map(_to_plain, output)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave)
    return list(owners)


class ShardedGradScaler(torch.amp.GradScaler):
    """torch's GradScaler over gradients that are partly DTensors (sharded or replicated on different meshes):
    each rank unscales and checks its own pieces, and the found-inf flag is all-reduced, so every rank takes or
    skips the step together (what torch.distributed.fsdp's ShardedGradScaler does for flat parameters)."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    by_dtype.setdefault(grad.dtype, []).append(grad)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return {found_inf.device: found_inf}


class DistributedTrainStep(TrainStep):
    """The shared train step with the parts that must see every rank: the gradient norm for clipping, the loss
    scaler's overflow check, the non-finite check, and optimizer state that mirrors a sharded parameter."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.scaler is not None:
            self.scaler = ShardedGradScaler(self.device_type, enabled=True)

    def clip_gradients(self, max_norm: float) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        # each parameter's norm over all its shards (DTensor reduces it), then torch's formula on the host side
        norms = [_to_plain(torch.linalg.vector_norm(g, 2.0)) for g in grads]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        torch.nn.utils.clip_grads_with_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm,
                                             total, foreach=False)

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


class RankEngine(TorchTrainState):
    """One rank of the distributed executable. Every method is called on every rank in the same order (the
    collectives inside them line up); results that differ by rank are gathered so that each rank returns the
    same value."""

    def __init__(self, program: Program, plan: ShardingPlan, device: torch.device, mode: str) -> None:
        self.program, self.plan, self.device, self.mode = program, plan, device, mode
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != plan.devices:
            raise LoweringError(f"the plan spans {plan.devices} devices but torch.distributed has {self.world} "
                                "processes; pass --devices equal to the number of processes")
        self.roles = MeshRoles(plan)
        self.mesh = self.roles.build_mesh(device.type)
        self._hints = hints.checker(plan.axis_sizes)
        self.warm_graphs = 0
        self.tensor_parallel: list[str] = []

    # ------------------------------------------------------------------ the protocol, per rank

    def init(self, weights: dict[str, np.ndarray]) -> None:
        model = build_model(self.program, weights, self.device)
        roles = self.roles
        if roles.model is not None:
            self.tensor_parallel = tensor_parallel(model, self.plan, self.mesh, roles.model)
        if roles.batch is not None:
            if roles.fsdp:
                dims = {}
                for name, param in model.named_parameters():
                    spec = self.plan.param(name).spec
                    dims[id(param)] = next((d for d, e in enumerate(spec) if roles.batch in spec_axes((e,))), None)
                fully_shard(model, mesh=self.mesh[roles.batch],
                            shard_placement_fn=lambda p: Shard(dims[id(p)]) if dims.get(id(p)) is not None else None)
            else:
                fully_shard(model, mesh=self.mesh[roles.batch, UNSHARDED_AXIS])
        self.model = model
        mode = None if self.mode == "default" else self.mode
        self.train_step = DistributedTrainStep(self.program, model, self.device, on_device=True,
                                               compile=lambda fn: torch.compile(fn, mode=mode))
        if roles.batch is not None:
            self.batch_group = self.mesh[roles.batch].get_group()
            self.batch_parts = self.mesh[roles.batch].size()
            self.batch_index = self.mesh[roles.batch].get_local_rank()
        else:
            self.batch_group, self.batch_parts, self.batch_index = None, 1, 0

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        local = local_rows(batch, self.batch_parts, self.batch_index, self.program.step.grad_accum)
        lr = self.train_step.lr
        with hints.activate(self._hints):
            loss = self.train_step(batch_to_torch(local, self.device, self.program.precision))
        if self.batch_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.batch_group)
            loss = loss / self.batch_parts
        return {"loss": float(loss), "lr": lr}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full arrays under the eager names (every DTensor gathered; tied names share one gather)."""
        out: dict[str, np.ndarray] = {}
        seen: dict[int, np.ndarray] = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            if id(value) not in seen:
                seen[id(value)] = tensor_to_numpy(value)
            out[name] = seen[id(value)]
        return out

    def trace_modules(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every rank runs the forward on the whole batch (FSDP2 gathers the parameters, DTensor modules return
        replicated outputs), so the outputs are the full ones and the same on every rank."""
        from xbridge.bisect import recording
        from xbridge.torch_train import compute_context

        tensors = batch_to_torch(batch, self.device, self.program.precision)
        # outputs of modules inside a DTensor module are DTensors: gathered (all ranks run the same forward)
        with torch.no_grad(), recording(self.model, tensor_to_numpy) as outputs, \
                compute_context(self.program.precision, self.device.type), hints.activate(self._hints):
            self.program.loss(self.model, tensors)
        return outputs

    def layout(self) -> dict[str, dict[str, Any]]:
        local = {}
        for name, param in self.model.named_parameters():
            if isinstance(param, DTensor):
                names = param.device_mesh.mesh_dim_names or ()
                sizes = param.device_mesh.shape   # a placement over a size-1 axis means nothing: not shown
                spec = "(" + ", ".join(f"{n}: {p}" for n, p, k in zip(names, param.placements, sizes) if k > 1) + ")"
                local[name] = (spec, list(param.to_local().shape))
            else:
                local[name] = ("replicated", list(param.shape))
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, local)
        return {name: {"spec": spec, "shard_shapes": [rank[name][1] for rank in everyone]}
                for name, (spec, _) in local.items()}

    def recompiles(self) -> int:
        """Compilations after warm-up, the most of any rank."""
        return max(self._gather(compiled_graphs() - self.warm_graphs))

    def recompile_reasons(self) -> list[str]:
        return [f"graph break x{count}: {reason}" for reason, count in counters["graph_break"].items()]

    def graph_breaks(self) -> int:
        return int(sum(counters["graph_break"].values()))

    def mark_warm(self) -> None:
        self.warm_graphs = compiled_graphs()

    def dump(self, directory: Path) -> list[Path]:
        return sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix in (".py", ".txt", ".log"))

    def _gather(self, value: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, value)
        return everyone


def threads_per_rank(world: int) -> int:
    """CPU ranks share the machine's cores (torchrun likewise sets OMP_NUM_THREADS=1 per process)."""
    return max(1, (os.cpu_count() or 1) // world)


def device_for(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        return torch.device("cuda", local_rank)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads_per_rank(dist.get_world_size()))
    return torch.device(device_type)


def process_group_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"

