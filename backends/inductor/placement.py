"""Where the plan's mesh axes go on torch.distributed: the batch axis to FSDP2, a model axis to DTensor.

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
- the experts of a transformers mixture of experts split over a model axis go through transformers' own expert
  parallelism (:func:`expert_parallel`), not DTensor's propagation;
- each rank takes its slice of every micro-batch of the global batch (the layout the JAX and torch_xla backends
  give the batch).

This module imports no torch.distributed at module level beyond its types, so an unsupported layout is refused
before any process starts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

from xbridge.errors import LoweringError
from xbridge.ir.sharding import spec_axes
from xbridge.plugin import ShardingPlan
from xbridge.torch.train import tied_groups

UNSHARDED_AXIS = "_fsdp_shard"   # the size-1 shard dimension of FSDP2's hybrid mode (parameters replicated)


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


def rank_rows(batch_size: int, parts: int, index: int, accum: int) -> np.ndarray:
    """This rank's examples: piece ``index`` of ``parts`` of every micro-batch, so that micro-batch ``m`` of the
    local batch is this rank's share of micro-batch ``m`` of the global one (as JAX and torch_xla lay it out)."""
    micro = batch_size // accum
    piece = micro // parts
    return np.concatenate([np.arange(m * micro + index * piece, m * micro + (index + 1) * piece)
                           for m in range(accum)])


def local_rows(batch: dict[str, np.ndarray], parts: int, index: int, accum: int) -> dict[str, np.ndarray]:
    """This rank's rows (:func:`rank_rows`) of a global batch."""
    if parts == 1:
        return batch
    rows = rank_rows(next(iter(batch.values())).shape[0], parts, index, accum)
    return {key: value[rows] for key, value in batch.items()}


def to_plain(value: Any) -> Any:
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
        if expert_parallel(module, sharded, submesh):
            continue

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
            return torch.utils._pytree.tree_map(to_plain, output)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave)
    return list(owners)


def apply_batch_axis(model: torch.nn.Module, plan: ShardingPlan, roles: MeshRoles, mesh: DeviceMesh) -> None:
    """FSDP2 on the root module over the batch axis: sharded where the plan names the axis, else hybrid."""
    if roles.batch is None:
        return
    if roles.fsdp:
        dims: dict[int, int] = {}
        for name, param in model.named_parameters():
            spec = plan.param(name).spec
            dim = next((d for d, e in enumerate(spec) if roles.batch in spec_axes((e,))), None)
            if dim is not None:
                dims[id(param)] = dim
        fully_shard(model, mesh=mesh[roles.batch],
                    shard_placement_fn=lambda p: Shard(dims[id(p)]) if id(p) in dims else None)
    else:
        fully_shard(model, mesh=mesh[roles.batch, UNSHARDED_AXIS])


def expert_parallel(module: torch.nn.Module, sharded: dict[str, int], submesh: DeviceMesh) -> bool:
    """Experts of a transformers mixture of experts split over a model axis by their first (expert) dimension: run
    through transformers' own expert parallelism (transformers.distributed.expert_parallel), not through DTensor's
    propagation, which has no rule for the routing's ``floor_divide`` and takes ``_grouped_mm`` in bf16 only (torch
    2.9). Each rank keeps its experts (``Shard(0)``, ``num_experts`` the local count), every rank of the axis holds the
    same batch (the batch axis is FSDP2's), so ``AllReduceEP``: each rank runs its experts on every token with the
    other ranks' routes masked, and an all-reduce sums the outputs (and, backward, the inputs' gradients). True when
    ``module`` is such an experts module (a ``forward(hidden_states, top_k_index, top_k_weights)`` and a
    ``num_experts`` that every direct parameter has as its first dimension, all of them split there)."""
    import inspect

    params = dict(module.named_parameters(recurse=False))
    experts = getattr(module, "num_experts", None)
    try:
        arguments = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    if (arguments[1:3] != ["top_k_index", "top_k_weights"] or not isinstance(experts, int) or not params
            or set(sharded) != set(params) or any(d != 0 for d in sharded.values())
            or any(p.dim() == 0 or p.shape[0] != experts for p in params.values())):
        return False
    if experts % submesh.size():
        raise LoweringError(f"{type(module).__name__} has {experts} experts, which do not split evenly over the "
                            f"{submesh.size()} ranks of mesh axis {(submesh.mesh_dim_names or ('?',))[0]!r}")
    try:
        from transformers.distributed.expert_parallel import EpDispatchExpertsParallel, MoEParamShard
    except ImportError:         # not transformers' experts after all: DTensor's propagation, as for any module
        return False

    style = MoEParamShard(Shard(0), shards_expert_dim=True)      # every rank holds the full weights: no scatter
    for attr in params:
        style.shard_param(module, attr, submesh)
    EpDispatchExpertsParallel().install_forward(module, ep_mesh=submesh, tp_mesh=submesh,
                                                ep_implementation="all_reduce")
    return True
