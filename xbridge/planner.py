"""The sharding plan: resolve the mesh, match rules to parameters, check every spec, and give per-device shapes.

``plan(program, devices=N)`` builds the model on torch's meta device (no memory, no init cost), so it is the same
for every backend and runs before anything compiles. The result names only mesh axes and shapes: it is
backend-neutral, and each backend turns it into its own layout objects.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from .errors import PlanError
from .ir.precision import DTYPES
from .ir.program import Program
from .ir.sharding import Spec, spec_axes
from .torch.weights import meta_model


@dataclass(frozen=True)
class ParamPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec                  # one entry per dimension (padded with None)
    rule: str | None            # the regex that matched, "fsdp:<axis>" for the preset, None when replicated
    shard_shape: tuple[int, ...]
    shard_bytes: int
    bytes: int

    @property
    def sharded(self) -> bool:
        return any(e is not None for e in self.spec)


@dataclass(frozen=True)
class ShardingPlan:
    mesh: tuple[tuple[str, int], ...]   # resolved axis sizes, in mesh order
    devices: int
    params: tuple[ParamPlan, ...]
    batch: Spec

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    def param(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def total_params(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    @property
    def bytes_per_device(self) -> int:
        return sum(p.shard_bytes for p in self.params)

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": dict(self.mesh), "devices": self.devices, "batch": list(self.batch),
            "bytes_per_device": self.bytes_per_device, "total_params": self.total_params,
            "params": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype,
                        "spec": [list(e) if isinstance(e, tuple) else e for e in p.spec], "rule": p.rule,
                        "shard_shape": list(p.shard_shape), "shard_bytes": p.shard_bytes, "bytes": p.bytes}
                       for p in self.params],
        }


def _fmt_spec(spec: Spec) -> str:
    return "(" + ", ".join(repr(e) for e in spec) + ("," if len(spec) == 1 else "") + ")"


def _check_spec(name: str, shape: tuple[int, ...], spec: Spec, rule: str,
                sizes: dict[str, int]) -> tuple[Spec, tuple[int, ...]]:
    where = f"parameter {name!r} of shape {tuple(shape)} (rule '{rule}', spec {_fmt_spec(spec)})"
    if len(spec) > len(shape):
        raise PlanError(f"{where}: the spec has {len(spec)} entries but the tensor has rank {len(shape)}; "
                        "drop the extra entries")
    axes = spec_axes(spec)
    for axis in axes:
        if axis not in sizes:
            raise PlanError(f"{where}: mesh axis {axis!r} is not in the mesh (axes: {', '.join(sizes)})")
    dup = {a for a in axes if axes.count(a) > 1}
    if dup:
        raise PlanError(f"{where}: mesh axis {sorted(dup)[0]!r} is used on more than one dimension")
    full = tuple(spec) + (None,) * (len(shape) - len(spec))
    shard = []
    for dim, (extent, entry) in enumerate(zip(shape, full)):
        group = (entry,) if isinstance(entry, str) else (entry or ())
        parts = math.prod(sizes[a] for a in group)
        if extent % parts:
            axis_desc = " x ".join(f"{a!r} (size {sizes[a]})" for a in group)
            raise PlanError(f"{where}: dimension {dim} ({extent}) is not divisible by mesh axis {axis_desc}; "
                            "change the rule or the mesh")
        shard.append(extent // parts)
    return full, tuple(shard)


def _fsdp_spec(shape: tuple[int, ...], axis: str, size: int) -> Spec:
    order = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    for dim in order:
        if shape[dim] % size == 0:
            return tuple(axis if d == dim else None for d in range(len(shape)))
    return ()


def _batch_group(batch: Spec) -> tuple[str, ...]:
    first = batch[0] if batch else None
    return (first,) if isinstance(first, str) else (first or ())


def batch_parts(program: Program, devices: int) -> int:
    """Into how many row blocks the batch's dimension 0 is split on ``devices`` devices (1: not split)."""
    sizes = program.mesh.resolve(devices)
    return math.prod(sizes.get(a, 1) for a in _batch_group(program.sharding.batch))


def plan(program: Program, devices: int, model: Any = None) -> ShardingPlan:
    """Resolve ``program``'s mesh on ``devices`` devices and its sharding rules on its parameters."""
    sizes = program.mesh.resolve(devices)
    rules = program.sharding.params
    sharding = program.sharding
    for axis in spec_axes(sharding.batch):
        if axis not in sizes:
            raise PlanError(f"batch spec {_fmt_spec(sharding.batch)}: mesh axis {axis!r} is not in the mesh "
                            f"(axes: {', '.join(sizes)})")
    if sharding.batch:
        group = _batch_group(sharding.batch)
        parts = math.prod(sizes[a] for a in group)
        micro = program.data.batch_size // program.step.grad_accum
        if micro % parts:
            raise PlanError(f"batch spec {_fmt_spec(sharding.batch)}: the micro-batch of {micro} examples "
                            f"(batch_size {program.data.batch_size} / grad_accum {program.step.grad_accum}) is not "
                            f"divisible by mesh axis {' x '.join(repr(a) for a in group)} of size {parts}")
    if sharding.fsdp is not None and sharding.fsdp not in sizes:
        raise PlanError(f"fsdp axis {sharding.fsdp!r} is not in the mesh (axes: {', '.join(sizes)})")

    model = meta_model(program) if model is None else model
    dtype = program.precision.params
    used: set[str] = set()
    params: list[ParamPlan] = []
    for name, tensor in model.named_parameters():
        shape = tuple(int(d) for d in tensor.shape)
        matches = [pattern for pattern in rules if re.fullmatch(pattern, name)]
        if len(matches) > 1:
            raise PlanError(f"parameter {name!r} of shape {shape} is matched by two sharding rules, '{matches[0]}' "
                            f"and '{matches[1]}'; make the regexes exclusive")
        rule: str | None
        if matches:
            rule = matches[0]
            used.add(rule)
            spec = rules[rule]
        elif sharding.fsdp is not None:
            spec = _fsdp_spec(shape, sharding.fsdp, sizes[sharding.fsdp])
            rule = f"fsdp:{sharding.fsdp}" if spec else None
        else:
            spec, rule = (), None
        full, shard = _check_spec(name, shape, spec, rule or "replicated", sizes)
        itemsize = DTYPES[dtype]
        params.append(ParamPlan(name, shape, dtype, full, rule, shard, math.prod(shard) * itemsize,
                                math.prod(shape) * itemsize))
    unused = [pattern for pattern in rules if pattern not in used]
    if unused:
        raise PlanError(f"sharding rule '{unused[0]}' (spec {_fmt_spec(rules[unused[0]])}) matches no parameter of "
                        f"program {program.name!r}; run `xbridge inspect` to list the parameter names")
    return ShardingPlan(tuple(sizes.items()), devices, tuple(params), sharding.batch)
