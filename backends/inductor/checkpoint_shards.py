"""What one inductor rank writes of a sharded checkpoint (xbridge/checkpoint/shards.py): the local shard of each DTensor
at its global offset, and a plain tensor (the same on every rank) as a full array, which only rank 0 writes. A
slice several ranks hold (a replicated placement, or a DTensor on a sub-mesh that other sub-meshes repeat) is
written once, by the lowest rank holding it: the ranks exchange which slices they hold before writing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from xbridge.errors import RunError
from xbridge.plugin import shards
from xbridge.torch.train import TrainStep, tensor_to_numpy


def pieces(value: torch.Tensor) -> shards.Sharded | np.ndarray:
    """This rank's piece of ``value``: a DTensor's local shard at its global offset; a plain tensor whole."""
    if not isinstance(value, DTensor):
        return tensor_to_numpy(value)
    if any(p.is_partial() for p in value.placements):
        raise RunError(f"a DTensor of shape {tuple(value.shape)} holds partial sums ({value.placements}); it cannot "
                       "be checkpointed before it is reduced")
    local = tensor_to_numpy(value.to_local())
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return shards.Sharded(tuple(value.shape), str(local.dtype), [(tuple(int(o) for o in offset), local)])


def write_part(tmp: str, rank: int, world: int, model: torch.nn.Module, train_step: TrainStep,
               gather: Callable[[Any], list[Any]]) -> dict[str, Any]:
    """Write this rank's pieces into the folder ``tmp`` (the proxy's temporary checkpoint folder); returns the part
    that describes them. ``gather(value)``: every rank's value, in rank order (a collective)."""
    state = {"model": {name: pieces(value) for name, value in model.state_dict(keep_vars=True).items()},
             "train": train_step.export_state(pieces)}
    held = sorted((kind, name, start) for kind, table in state.items() for name, value in table.items()
                  if isinstance(value, shards.Sharded) for start, _ in value.pieces)
    first: dict[tuple[str, str, tuple[int, ...]], int] = {}
    for other, claims in enumerate(gather(held)):
        for claim in claims:
            first.setdefault(tuple(claim), other)
    for kind, table in state.items():
        for name, value in table.items():
            if isinstance(value, shards.Sharded):
                value.pieces = [(s, a) for s, a in value.pieces if first[kind, name, s] == rank]
    group = shards.Group(rank, world, lambda name: None)    # the proxy collects the parts: no barrier needed
    return shards.write_part(Path(tmp), group, state["model"], state["train"])
